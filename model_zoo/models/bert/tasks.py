"""BERT's hooks (the model-folder contract, model_zoo/models/base.py): data, the training
networks, evaluation, fill-mask, conversion.

`model.task` picks the path: "pretrain" (masked LM + next sentence prediction on raw text)
or "classify" (fine-tuning on the docstring-topic task; see data.py for why that task).
The trainer and the command line reach the model only through the names of this module.
"""

import os
from dataclasses import dataclass, field
from typing import List


import model_zoo.config
from model_zoo.config import Config
from model_zoo.data import (BUILTIN_PYTHON_DOCS, HFTokenizer, create_dataset, load_tokenizer,
                            parse_token_ids, read_manifest, split_paths)
from model_zoo.data.streaming import BuildOptions
from model_zoo.data.manifest import check_sources_to_build
from model_zoo.errors import ConfigError, DataError, UserInputError
from model_zoo.checkpoint.files import load_network

from . import convert, data_command
from .classification import (CLASSIFICATION_COLUMNS, CLASSIFICATION_FILES,
                             build_classification_dataset, classification_dataset_ready)
from .data import (PRETRAINING_COLUMNS, PRETRAINING_FILES, TOKENIZER_FILE,
                   build_pretraining_dataset, encode_text, load_bert_tokenizer,
                   pretraining_dataset_ready)
from .fill_mask import fill_mask, format_fill_mask
from .model import BertConfig, LogitsCell, build_bert_network


@dataclass
class BertDataConfig(model_zoo.config.DataConfig):
    """BERT's `data` section.

    Pretraining: `sources` (text files or `builtin:python-docs`) are turned into masked
    sentence pairs on first use. Fine-tuning (model.task: classify): the topic dataset is
    built on first use with the pretraining dataset's `tokenizer`.
    """

    dataset_dir: str = "datasets/bert"
    sources: List[str] = field(default_factory=lambda: [BUILTIN_PYTHON_DOCS])
    tokenizer: str = ""
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    whole_word_mask: bool = False
    dupe_factor: int = 2
    heldout_fraction: float = 0.05
    seed: int = 1


ModelConfig = BertConfig
DataConfig = BertDataConfig
add_data_arguments = data_command.add_data_arguments
run_data_command = data_command.run_data_command
add_convert_arguments = convert.add_convert_arguments
run_convert_command = convert.run_convert_command


def _pretraining(config: Config) -> bool:
    return config.model.task == "pretrain"


def dataset_ready(config: Config) -> bool:
    """Whether data.dataset_dir holds the dataset of this config's task."""
    data, model = config.data, config.model
    if _pretraining(config):
        return pretraining_dataset_ready(data.dataset_dir, model.vocab_size, model.seq_length,
                                         data.max_predictions_per_seq)
    return classification_dataset_ready(data.dataset_dir, model.vocab_size, model.seq_length)


def prepare_data(config: Config):
    """Build the task's dataset in data.dataset_dir unless it is already there."""
    data, model = config.data, config.model
    if _pretraining(config):
        if dataset_ready(config):
            return
        check_sources_to_build(data.dataset_dir, data.sources)
        print(f"building the pretraining dataset in {data.dataset_dir} from "
              f"{' '.join(data.sources)} ...", flush=True)
        manifest = build_pretraining_dataset(
            data.dataset_dir, data.sources, vocab_size=model.vocab_size,
            seq_length=model.seq_length, max_predictions_per_seq=data.max_predictions_per_seq,
            masked_lm_prob=data.masked_lm_prob, whole_word_mask=data.whole_word_mask,
            dupe_factor=data.dupe_factor,
            options=BuildOptions(heldout_fraction=data.heldout_fraction, seed=data.seed))
        print(f"dataset: {manifest['splits']['train']['examples']} train / "
              f"{manifest['splits']['heldout']['examples']} held-out sentence pairs", flush=True)
        return
    if not data.tokenizer:
        raise ConfigError("data.tokenizer is empty: fine-tuning needs the pretraining "
                          "dataset's tokenizer.model")
    if not os.path.isfile(data.tokenizer):
        raise DataError(f"data.tokenizer: {data.tokenizer} does not exist (pretrain first)")
    if not classification_dataset_ready(data.dataset_dir, model.vocab_size, model.seq_length,
                                        tokenizer_path=data.tokenizer):
        print(f"building the classification dataset in {data.dataset_dir} ...", flush=True)
        build_classification_dataset(data.dataset_dir, data.tokenizer,
                                     seq_length=model.seq_length, seed=data.seed)
    labels = read_manifest(data.dataset_dir)["labels"]
    if len(labels) != model.num_labels:
        raise ConfigError(f"model.num_labels={model.num_labels} but the dataset in "
                          f"{data.dataset_dir} has {len(labels)} labels ({', '.join(labels)})")


def _split(config: Config, split: str):
    files = PRETRAINING_FILES if _pretraining(config) else CLASSIFICATION_FILES
    columns = PRETRAINING_COLUMNS if _pretraining(config) else CLASSIFICATION_COLUMNS
    return split_paths(config.data.dataset_dir, files, split), columns


def build_train_network(config: Config, compute_dtype):
    """BertForPreTraining or BertForSequenceClassification, by model.task."""
    return build_bert_network(config.model, config.parallel, compute_dtype)


def plan_inputs(config: Config, batch_size: int):
    """The training network's inputs for the plan check, in the dataset's column order."""
    import mindspore as ms
    seq, predictions = config.model.seq_length, config.data.max_predictions_per_seq
    if _pretraining(config):
        return [((batch_size, seq), ms.int32)] * 3 + [
            ((batch_size, predictions), ms.int32), ((batch_size, predictions), ms.int32),
            ((batch_size, predictions), ms.float32), ((batch_size,), ms.int32)]
    return [((batch_size, seq), ms.int32)] * 3 + [((batch_size,), ms.int32)]


def random_batch(config: Config, batch_size: int, rng) -> list:
    """A valid batch of random values in `plan_inputs`' columns (`model-zoo dryrun
    --check-numbers`): token ids in the vocabulary, both segments, every position real;
    for pretraining, predictions at random positions of weight 1 and next-sentence labels;
    for classification, labels among `model.num_labels`."""
    import numpy as np
    model, seq = config.model, config.model.seq_length

    def ints(high, *shape):
        return rng.integers(0, high, (batch_size, *shape)).astype(np.int32)

    text = [ints(model.vocab_size, seq), ints(2, seq), np.ones((batch_size, seq), np.int32)]
    if not _pretraining(config):
        return text + [ints(model.num_labels)]
    predictions = config.data.max_predictions_per_seq
    return text + [ints(seq, predictions), ints(model.vocab_size, predictions),
                   np.ones((batch_size, predictions), np.float32), ints(2)]


def inference_graphs(config: Config, network, batch_size: int) -> dict:
    """`model-zoo export`: from input_ids, token_type_ids and attention_mask (int32, batch x
    seq_length), and for pretraining masked_lm_positions (int32, batch x predictions), the
    logits: (masked-LM (batch * predictions, vocab), next-sentence (batch, 2)), or the
    classifier's (batch, num_labels)."""
    import mindspore as ms
    import numpy as np
    shape = (batch_size, config.model.seq_length)
    inputs = [ms.Tensor(np.zeros(shape, np.int32)), ms.Tensor(np.zeros(shape, np.int32)),
              ms.Tensor(np.ones(shape, np.int32))]
    if _pretraining(config):
        inputs.append(ms.Tensor(np.zeros((batch_size, config.data.max_predictions_per_seq),
                                         np.int32)))
    return {"logits": (LogitsCell(network), tuple(inputs))}


def create_train_dataset(config: Config, shard, skip_batches: int = 0):
    path, columns = _split(config, "train")
    return create_dataset(path, columns, shard.batch_size, num_shards=shard.num_shards,
                          shard_id=shard.shard_id, shuffle=config.data.shuffle,
                          seed=config.train.seed, skip_batches=skip_batches)


def create_heldout_dataset(config: Config, shard):
    """This rank's batches of the held-out split (pretraining) or the dev split
    (fine-tuning), once, in order (whole batches only)."""
    path, columns = _split(config, "heldout" if _pretraining(config) else "dev")
    return create_dataset(path, columns, shard.batch_size, num_shards=shard.num_shards,
                          shard_id=shard.shard_id, shuffle=False, repeat=False)


def _batches(config: Config, split: str):
    """Every example of a held-out split once, in order (the last short batch included)."""
    path, columns = _split(config, split)
    return create_dataset(path, columns, 32, shuffle=False, repeat=False,
                          drop_remainder=False).create_tuple_iterator(output_numpy=True)


def evaluate(config: Config, network) -> dict:
    """Pretraining: masked-LM and next-sentence accuracy on the held-out pairs.
    Fine-tuning: accuracy on the dev split against the majority-class baseline."""
    from mindspore import Tensor
    logits = LogitsCell(network)
    logits.set_train(False)
    if _pretraining(config):
        mlm_correct = mlm_total = nsp_correct = examples = 0
        for ids, types, mask, positions, labels, weights, next_label in _batches(config,
                                                                                 "heldout"):
            mlm, nsp = logits(Tensor(ids), Tensor(types), Tensor(mask), Tensor(positions))
            predicted = mlm.asnumpy().argmax(-1).reshape(labels.shape)
            mlm_correct += float(((predicted == labels) * weights).sum())
            mlm_total += float(weights.sum())
            nsp_correct += int((nsp.asnumpy().argmax(-1) == next_label).sum())
            examples += len(ids)
        return {"split": "heldout", "examples": examples, "predictions": int(mlm_total),
                "mlm_accuracy": round(mlm_correct / max(mlm_total, 1), 4),
                "nsp_accuracy": round(nsp_correct / max(examples, 1), 4)}
    correct = examples = 0
    for ids, types, mask, label in _batches(config, "dev"):
        scores = logits(Tensor(ids), Tensor(types), Tensor(mask)).asnumpy()
        correct += int((scores.argmax(-1) == label).sum())
        examples += len(ids)
    baseline = read_manifest(config.data.dataset_dir)["majority_baseline"]
    return {"split": "dev", "examples": examples, "accuracy": round(correct / max(examples, 1), 4),
            "majority_baseline": baseline["dev_accuracy"],
            "majority_label": baseline["label"]}


def _tokenizer(config: Config):
    """The pretraining dataset's tokenizer (checked to have BERT's ids), the Hugging Face
    one `convert` imported, or None."""
    if not config.data.tokenizer:
        found = load_tokenizer(config.data.dataset_dir)
        if isinstance(found, HFTokenizer):
            return found
    path = config.data.tokenizer or os.path.join(config.data.dataset_dir, TOKENIZER_FILE)
    return load_bert_tokenizer(path) if os.path.isfile(path) else None


def sample_text(config: Config, network) -> str:
    """Fill-mask on a held-out sentence, printed after pretraining."""
    if not _pretraining(config):
        return "(classification)"
    tokenizer = _tokenizer(config)
    text = "Return the [MASK] of the file."
    ids = _encode_with_masks(config, tokenizer, text)
    if len(ids) > config.model.seq_length:   # a model of very short sequences
        ids = ids[:config.model.seq_length - 1] + [config.model.sep_token_id]
    results = fill_mask(network, ids, mask_id=config.model.mask_token_id, top_k=5,
                        seq_length=config.model.seq_length)
    return text + "\n" + format_fill_mask(results, tokenizer)


def _encode_with_masks(config: Config, tokenizer, text: str) -> list:
    """[CLS] text [SEP] with every literal [MASK] as the mask id (all of it: the caller
    checks the length)."""
    model = config.model
    ids = [model.cls_token_id]
    for index, piece in enumerate(text.split("[MASK]")):
        if index:
            ids.append(model.mask_token_id)
        if piece.strip():
            # an imported vocabulary has its own special ids: its ids are taken as they are
            ids.extend(tokenizer.encode(piece) if isinstance(tokenizer, HFTokenizer)
                       else encode_text(tokenizer, piece))
    return ids + [model.sep_token_id]


def run_fill_mask(config: Config, ckpt: str, args) -> str:
    """`model-zoo fill-mask`: a line `mask <position>: <ids>` per masked position."""
    if not _pretraining(config):
        raise UserInputError("fill-mask needs a pretraining config (model.task: pretrain)")
    mask_id = config.model.mask_token_id if args.mask_id is None else args.mask_id
    tokenizer = _tokenizer(config)
    if args.ids is not None:
        ids = parse_token_ids(args.ids, "--ids", config.model.vocab_size)
    elif tokenizer is None:
        raise UserInputError(f"no tokenizer for {config.data.dataset_dir} to encode --text; "
                             f"give token ids with --ids")
    else:
        ids = _encode_with_masks(config, tokenizer, args.text)
    if len(ids) > config.model.seq_length:   # before the mask check: no silent cut
        raise UserInputError(f"the input has {len(ids)} tokens ([CLS] and [SEP] included), "
                             f"more than model.seq_length={config.model.seq_length}: "
                             f"shorten it")
    if mask_id not in ids:
        raise UserInputError(f"no mask token (id {mask_id}) in the input: put [MASK] in --text "
                             f"or the mask id in --ids")
    if args.top_k < 1:
        raise UserInputError(f"--top-k must be >= 1, got {args.top_k}")
    network = load_network(config, ckpt)
    results = fill_mask(network, ids, mask_id=mask_id, top_k=args.top_k,
                        seq_length=config.model.seq_length)
    return format_fill_mask(results, tokenizer)
