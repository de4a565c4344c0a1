"""What decoder-only model folders (GPT-2, LLaMA) share: their data section, data
preparation, datasets, plan inputs, exported graphs, held-out evaluation, sample text and
`model-zoo generate`. A folder's `tasks.py` binds these to its own training network; every
function here reaches the model through the training network's `.lm`, a language model
with the cached-decoding methods `model_zoo.causal_lm.generate` names.
"""

import math
import time
from dataclasses import dataclass, field
from typing import List

import mindspore as ms
import numpy as np

from model_zoo.config import Config, DataConfig
from model_zoo.data import (BUILTIN_PYTHON_DOCS, count_samples, create_dataset, load_tokenizer,
                            parse_token_ids)
from model_zoo.data.streaming import BuildOptions
from model_zoo.data.manifest import check_sources_to_build
from model_zoo.errors import UserInputError
from model_zoo.files import read_text_lines
from model_zoo.checkpoint.files import load_network

from model_zoo.causal_lm.data import (build_dataset, describe_build, lm_dataset_ready,
                                      split_files)
from model_zoo.causal_lm.generate import generate_ids


@dataclass
class CausalLMDataConfig(DataConfig):
    """A decoder-only model's `data` section (a folder's subclass sets its dataset_dir).

    sources: text files (documents separated by blank lines) or `builtin:python-docs`, the
    docstrings of Python's standard library, used to build the dataset on first use.
    """

    dataset_dir: str = "datasets/lm"
    sources: List[str] = field(default_factory=lambda: [BUILTIN_PYTHON_DOCS])
    heldout_fraction: float = 0.05
    seed: int = 1


def dataset_ready(config: Config) -> bool:
    """Whether data.dataset_dir holds the dataset this config trains on."""
    return lm_dataset_ready(config.data.dataset_dir, config.model.vocab_size,
                            config.model.seq_length)


def prepare_data(config: Config):
    """Build the dataset in data.dataset_dir from data.sources unless it is already there."""
    data, model = config.data, config.model
    if dataset_ready(config):
        return
    check_sources_to_build(data.dataset_dir, data.sources)
    print(f"building the dataset in {data.dataset_dir} from {' '.join(data.sources)} ...",
          flush=True)
    started = time.perf_counter()
    manifest = build_dataset(data.dataset_dir, data.sources, vocab_size=model.vocab_size,
                             seq_length=model.seq_length,
                             options=BuildOptions(heldout_fraction=data.heldout_fraction,
                                                  seed=data.seed))
    print(describe_build(manifest, data.dataset_dir, time.perf_counter() - started), flush=True)


def plan_inputs(config: Config, batch_size: int):
    """The training network's inputs for the plan check: token ids (batch, seq_length + 1)."""
    return [((batch_size, config.model.seq_length + 1), ms.int32)]


def random_batch(config: Config, batch_size: int, rng) -> List[np.ndarray]:
    """A batch of random token ids in `plan_inputs`' shape (`model-zoo dryrun
    --check-numbers`)."""
    return [rng.integers(0, config.model.vocab_size, (batch_size, config.model.seq_length + 1))
            .astype(np.int32)]


def inference_graphs(config: Config, network, batch_size: int) -> dict:
    """`model-zoo export`: the logits (batch, seq_length, vocab) of token ids int32
    (batch, seq_length)."""
    ids = ms.Tensor(np.zeros((batch_size, config.model.seq_length), np.int32))
    return {"logits": (network.lm, (ids,))}


def create_train_dataset(config: Config, shard, skip_batches: int = 0):
    """This rank's batches of the train split, resumable at `skip_batches`."""
    return create_dataset(split_files(config.data.dataset_dir, "train"),
                          ["input_ids"], shard.batch_size,
                          num_shards=shard.num_shards, shard_id=shard.shard_id,
                          shuffle=config.data.shuffle, seed=config.train.seed,
                          skip_batches=skip_batches)


def create_heldout_dataset(config: Config, shard):
    """This rank's batches of the held-out split, once, in order (whole batches only)."""
    return create_dataset(split_files(config.data.dataset_dir, "heldout"), ["input_ids"],
                          shard.batch_size, num_shards=shard.num_shards,
                          shard_id=shard.shard_id, shuffle=False, repeat=False)


def evaluate(config: Config, network) -> dict:
    """Mean next-token loss and perplexity of `network` (the training network) on held-out
    data."""
    path = split_files(config.data.dataset_dir, "heldout")
    samples = count_samples(path)
    batch_size = max(1, min(config.train.global_batch_size, samples))
    dataset = create_dataset(path, ["input_ids"], batch_size, shuffle=False, repeat=False)
    network.set_train(False)
    losses = [float(network(ids).asnumpy()) for (ids,) in dataset.create_tuple_iterator()]
    loss = float(np.mean(losses))
    evaluated = len(losses) * batch_size
    return {"split": "heldout", "samples": evaluated,
            "tokens": evaluated * config.model.seq_length, "loss": round(loss, 4),
            "perplexity": round(math.exp(min(loss, 50.0)), 2)}


def tokenizer_for(config: Config):
    """The dataset's tokenizer (trained, or imported by `convert`), or None when the model
    came without one."""
    return load_tokenizer(config.data.dataset_dir)


def sample_text(config: Config, network, prompt: str = "Return the") -> str:
    """A short sampled continuation, printed after training to show what the model learnt."""
    tokenizer = tokenizer_for(config)
    if tokenizer is None:
        return "(no tokenizer)"
    ids, = generate_ids(network.lm, [tokenizer.encode(prompt)], 40, greedy=False, top_k=20,
                        seed=config.train.seed, eos_id=tokenizer.eos_id)
    return prompt + tokenizer.decode(ids)


def run_generate(config: Config, ckpt: str, args) -> str:
    """`model-zoo generate`: for each prompt in order, a line `ids: ...` with its new ids,
    then its text when the dataset has a tokenizer. Prompts go `--batch-size` at a time
    (sampling draws from one seeded generator per batch)."""
    if args.batch_size < 1:
        raise UserInputError(f"--batch-size must be >= 1, got {args.batch_size}")
    tokenizer = tokenizer_for(config)
    prompts = read_prompts(args, tokenizer, config.model.vocab_size,
                           config.data.dataset_dir)
    network = load_network(config, ckpt)
    lines = []
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        try:
            results = generate_ids(network.lm, batch, args.max_new_tokens, greedy=args.greedy,
                                   top_k=args.top_k, top_p=args.top_p,
                                   temperature=args.temperature,
                                   repetition_penalty=args.repetition_penalty, seed=args.seed)
        except ValueError as err:
            raise UserInputError(str(err)) from None
        for prompt, ids in zip(batch, results):
            lines.append("ids: " + " ".join(str(i) for i in ids))
            if tokenizer is not None:
                lines.append(tokenizer.decode(prompt + ids))
    return "\n".join(lines)


def read_prompts(args, tokenizer, vocab_size: int, dataset_dir: str) -> list:
    """The prompts `model-zoo generate` was given, as id lists; UserInputError naming the
    flag (and the file's line) of an empty or unreadable one, or of text without a
    tokenizer to encode it."""
    path = args.input or args.prompt_ids_file
    if path:
        texts = [(f"{path} line {number}", line) for number, line in enumerate(
            read_text_lines(path, "--input" if args.input else "--prompt-ids-file"), 1)]
    else:
        texts = [("--prompt-ids" if args.prompt_ids is not None else "--prompt",
                  args.prompt_ids if args.prompt_ids is not None else args.prompt)]
    as_ids = args.prompt_ids is not None or args.prompt_ids_file
    if not as_ids and tokenizer is None:
        raise UserInputError(f"no tokenizer in {dataset_dir} to encode text prompts; give "
                             f"token ids with --prompt-ids or --prompt-ids-file")
    prompts = []
    for where, text in texts:
        prompt = (parse_token_ids(text, where, vocab_size) if as_ids
                  else tokenizer.encode(text))
        if not prompt:
            raise UserInputError(f"{where}: the prompt is empty")
        prompts.append(prompt)
    if not prompts:
        raise UserInputError(f"{path}: no prompt in the file")
    return prompts
