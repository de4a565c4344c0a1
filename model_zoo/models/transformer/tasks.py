"""The Transformer's hooks (the model-folder contract, model_zoo/models/base.py): data, the
training network, sacreBLEU evaluation, translation.

The trainer and the command line reach the model only through the names of this module.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import List

import mindspore as ms
import numpy as np
from mindspore import ops

import model_zoo.config
from model_zoo.config import Config
from model_zoo.data import Tokenizer
from model_zoo.data.manifest import check_sources_to_build
from model_zoo.errors import DataError, UserInputError
from model_zoo.files import read_text_lines
from model_zoo.checkpoint.files import load_network

from . import data as translation_data
from .data import (BUILTIN_LOCALE_DE, TOKENIZER_FILE, build_translation_dataset,
                   create_translation_dataset, read_examples, reference_file,
                   translation_dataset_ready)
from .decode import Translator
from .model import FlatDecoderStep, TransformerConfig, TransformerForTraining

EVAL_BATCH = 32


@dataclass
class TransformerDataConfig(model_zoo.config.DataConfig):
    """The Transformer's `data` section.

    sources: `builtin:locale-de` (English-German pairs of the system's message catalogs),
    `SOURCE_FILE:TARGET_FILE` pairs (one sentence per line) or files of pairs (.tsv, .jsonl
    keyed by source_lang and target_lang), built on first use.
    """

    dataset_dir: str = "datasets/transformer"
    sources: List[str] = field(default_factory=lambda: [BUILTIN_LOCALE_DE])
    source_lang: str = "en"
    target_lang: str = "de"
    dev_size: int = 1000
    test_size: int = 1000
    seed: int = 1


ModelConfig = TransformerConfig
DataConfig = TransformerDataConfig
add_data_arguments = translation_data.add_data_arguments
run_data_command = translation_data.run_data_command


def dataset_ready(config: Config) -> bool:
    """Whether data.dataset_dir holds the dataset this config trains on."""
    return translation_dataset_ready(config.data.dataset_dir, config.model.vocab_size,
                                     config.model.seq_length,
                                     (config.data.source_lang, config.data.target_lang))


def prepare_data(config: Config):
    """Build the dataset in data.dataset_dir from data.sources unless it is already there."""
    data, model = config.data, config.model
    if dataset_ready(config):
        return
    check_sources_to_build(data.dataset_dir, data.sources)
    print(f"building the dataset in {data.dataset_dir} from {' '.join(data.sources)} ...",
          flush=True)
    manifest = build_translation_dataset(
        data.dataset_dir, data.sources, vocab_size=model.vocab_size,
        seq_length=model.seq_length, dev_size=data.dev_size, test_size=data.test_size,
        seed=data.seed, languages=(data.source_lang, data.target_lang),
        source=" ".join(data.sources))
    splits = manifest["splits"]
    print(f"dataset: {manifest['pairs']['found']} sentence pairs found; train "
          f"{splits['train']['kept']}, dev {splits['dev']['kept']}, test {splits['test']['kept']}; "
          f"padding {manifest['padding_ratio']['bucketed']:.1%} with length buckets "
          f"({manifest['padding_ratio']['full_length']:.1%} without)", flush=True)


def build_train_network(config: Config, compute_dtype):
    """The cell the trainer optimises: the five batch columns -> label-smoothed loss."""
    return TransformerForTraining(config.model, config.parallel, compute_dtype)


def plan_inputs(config: Config, batch_size: int):
    """The training network's inputs for the plan check: the five batch columns at the
    longest bucket."""
    import mindspore as ms
    return [((batch_size, config.model.seq_length), ms.int32)] * 5


def random_batch(config: Config, batch_size: int, rng) -> list:
    """A valid batch of random values in `plan_inputs`' columns (`model-zoo dryrun
    --check-numbers`): source, decoder-input and label ids in the vocabulary, every
    position real."""
    shape = (batch_size, config.model.seq_length)
    ones = np.ones(shape, np.int32)
    return [rng.integers(0, config.model.vocab_size, shape).astype(np.int32), ones,
            rng.integers(0, config.model.vocab_size, shape).astype(np.int32), ones,
            rng.integers(0, config.model.vocab_size, shape).astype(np.int32)]


def inference_graphs(config: Config, network, batch_size: int) -> dict:
    """`model-zoo export`: the pieces of beam search (model.beam_size beams, as `translate`
    runs it): the encoder (source ids and mask, int32 batch x seq_length -> memory and source
    bias), the cross-attention keys and values of the memory, and one decoder step over
    batch x beam hypotheses (its inputs, the per-layer tuples flattened, in
    `FlatDecoderStep`)."""
    translator = Translator(network.transformer)
    beam = config.model.beam_size
    shape = (batch_size, config.model.seq_length)
    source = (ms.Tensor(np.zeros(shape, np.int32)), ms.Tensor(np.ones(shape, np.int32)))
    beams = ms.Tensor(np.repeat(np.arange(batch_size), beam), ms.int32)
    memory = ops.gather(translator.encoder(*source)[0], beams, 0)  # (batch x beam, seq, hidden)
    caches, cross = translator.prepare(source[0].asnumpy(), source[1].asnumpy(), beam,
                                       length=translator.max_len)
    rows = np.arange(batch_size * beam)
    step = translator.step_arguments(np.full(rows.size, config.model.bos_token_id), rows, 0,
                                     caches, cross)
    flat_step = [tensor for item in step
                 for tensor in (item if isinstance(item, tuple) else (item,))]
    return {"encoder": (translator.encoder, source),
            "cross_key_values": (translator.cross, (memory,)),
            "decoder_step": (FlatDecoderStep(translator.step_cell(2 * beam)), tuple(flat_step))}


def create_train_dataset(config: Config, shard, skip_batches: int = 0):
    """This rank's length-bucketed batches of the train split, resumable at `skip_batches`."""
    return create_translation_dataset(
        config.data.dataset_dir, "train", shard.batch_size,
        num_shards=shard.num_shards, shard_id=shard.shard_id, seed=config.train.seed,
        shuffle=config.data.shuffle, skip_batches=skip_batches)


def create_heldout_dataset(config: Config, shard):
    """This rank's length-bucketed batches of the dev split, once, in order (whole batches
    only)."""
    return create_translation_dataset(
        config.data.dataset_dir, "dev", shard.batch_size, num_shards=shard.num_shards,
        shard_id=shard.shard_id, seed=config.train.seed, shuffle=False, repeat=False)


def batch_tokens(batch) -> int:
    """Real (unpadded) source plus target tokens of one batch (Tensors, or the numpy arrays
    a dataset sink counts on their way to the device)."""
    source_mask, decoder_mask = batch[1], batch[3]
    return int(np.asarray(source_mask).sum() + np.asarray(decoder_mask).sum())


def _tokenizer(config: Config) -> Tokenizer:
    path = os.path.join(config.data.dataset_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise DataError(f"no tokenizer at {path}: train once, or build the dataset with "
                        f"`model-zoo data transformer`")
    return Tokenizer(path)


def _padded_batches(source_ids: list, length_of, batch_size: int):
    """Sentences grouped by padded length (few shapes to compile), in fixed-size batches
    (the last one filled with copies); yields (indices, ids, mask)."""
    order = sorted(range(len(source_ids)), key=lambda i: (length_of(len(source_ids[i])), i))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        length = max(length_of(len(source_ids[i])) for i in chunk)
        rows = chunk + [chunk[-1]] * (batch_size - len(chunk))
        ids = np.zeros((batch_size, length), np.int32)
        for row, index in enumerate(rows):
            ids[row, :len(source_ids[index])] = source_ids[index]
        yield chunk, ids, (ids != 0).astype(np.int32)


def translate_ids(config: Config, transformer, source_ids: list, beam_size: int,
                  batch_size: int = EVAL_BATCH) -> list:
    """Translations (id lists) of tokenized sources (each ending with eos), in input order."""
    # one Translator per model, kept on it: its cells keep their compiled graphs from call to
    # call (an eval every train.eval_steps, a benchmark's rounds)
    translator = getattr(transformer, "translator", None)
    if translator is None:
        translator = transformer.translator = Translator(transformer)
    transformer.set_train(False)   # training may have switched it back since
    buckets = [8, 16, 24, 32, 48, 64, 96, 128, 256]

    def length_of(n):
        return next((b for b in buckets if b >= n), n)

    results = [None] * len(source_ids)
    for indices, ids, mask in _padded_batches(source_ids, length_of, batch_size):
        if beam_size > 1:
            outputs = translator.beam_search(ids, mask, beam_size)
        else:
            outputs = translator.greedy(ids, mask)
        for index, output in zip(indices, outputs):
            results[index] = output
    return results


def evaluate(config: Config, network, split: str = "test", beam_size: int = None) -> dict:
    """sacreBLEU of `network`'s translations of a held-out split against its references."""
    import sacrebleu
    tokenizer = _tokenizer(config)
    examples = read_examples(config.data.dataset_dir, split)
    with open(reference_file(config.data.dataset_dir, split), encoding="utf-8") as handle:
        references = handle.read().splitlines()
    beam = beam_size or config.model.beam_size
    hypotheses_ids = translate_ids(config, network.transformer, examples.source_ids, beam)
    hypotheses = [tokenizer.decode(ids) for ids in hypotheses_ids]
    wanted = [references[i] for i in examples.indices]
    bleu = sacrebleu.corpus_bleu(hypotheses, [wanted])
    return {"split": split, "sentences": len(hypotheses), "beam": beam,
            "bleu": round(bleu.score, 2), "signature": str(bleu.format(signature=True))}


def sample_text(config: Config, network) -> str:
    """A few held-out translations, printed after training."""
    tokenizer = _tokenizer(config)
    examples = read_examples(config.data.dataset_dir, "test")
    ids = translate_ids(config, network.transformer, examples.source_ids[:3], 1, batch_size=3)
    return " | ".join(f"{tokenizer.decode(s[:-1])} -> {tokenizer.decode(t)}"
                      for s, t in zip(examples.source_ids[:3], ids))


def run_translate(config: Config, ckpt: str, args) -> str:
    """`model-zoo translate`: one translation per input line (a file or standard input)."""
    if args.beam is not None and args.beam < 1:
        raise UserInputError(f"--beam {args.beam}: a beam holds at least 1 hypothesis (1 is "
                             f"greedy); leave it out for the config's model.beam_size")
    tokenizer = _tokenizer(config)
    if args.input:
        lines = read_text_lines(args.input, "--input")
    else:
        lines = sys.stdin.read().splitlines()
    limit = config.model.seq_length
    source_ids = [tokenizer.encode(line)[:limit - 1] + [tokenizer.eos_id] for line in lines]
    network = load_network(config, ckpt)
    beam = config.model.beam_size if args.beam is None else args.beam
    translations = translate_ids(config, network.transformer, source_ids, beam)
    return "\n".join(tokenizer.decode(ids) if line.strip() else ""
                     for line, ids in zip(lines, translations))
