"""Generation and beam search throughput side by side with Hugging Face, in one run.

GPT-2: GPT-2 small's shape (12 layers, hidden 768, 12 heads, 1,024 positions, vocabulary
50,257) with random weights on both sides; prompts of 32 random tokens; 128 new tokens,
greedy (no end-of-sequence id, so every row makes all 128); batch 1 and 8. Ours:
`CachedGenerator` (prefill, then one-token steps over key/value caches written in place,
graph mode); the reference: `transformers.GPT2LMHeadModel.generate` on torch.

LLaMA: a LLaMA of the same size (12 layers, hidden 768, 12 query heads over 4 key/value
heads, SwiGLU width 2,048 by LLaMA's rule, an output head of its own over the same
vocabulary), the same prompts and steps; the reference: `transformers.LlamaForCausalLM`.

Beam search: the tiny Transformer config's dimensions (3 + 3 layers, hidden 256, 4 heads,
feed-forward 1024, vocabulary 8,000) with random weights; 64 source sentences of 20 random
tokens + eos, batches of 32, beam 4, length penalty 0.6, 71 target positions (the source
length + model.max_decode_extra). Ours: `translate_ids`, as `model-zoo translate` runs it;
the reference: `transformers.MarianMTModel.generate` at the same dimensions, made to decode
the same 71 positions (min_new_tokens = max_new_tokens).

Each side runs in its own process; the figure is the best of `--rounds` timed runs after
one warm-up run (ours compiles its graphs then).

With `--cli`, a third column times the commands users run, in processes of their own:
`model-zoo generate CONFIG --ckpt CKPT --prompt-ids-file F --batch-size B --max-new-tokens N
--greedy` at the same shape (the random weights saved as a checkpoint), and `model-zoo
translate CONFIG --ckpt CKPT --input F --beam 4` on text lines that encode to sources of the
same length. Per token (per sentence) is the difference of two commands, so that start-up,
loading and compilation cancel: the input (one batch of prompts; 32 lines) once and four
times, so that the difference is three batches of the shapes the first one compiled.

The weight floor beside each model: at batch 1 a token costs one read of every weight a
step uses (the products' weights and the output head; one row of each embedding table), so
those bytes / the read bandwidth measured here (numpy's matrix-vector product over 512 MB)
is the fastest a token can be made without smaller weights.

    python benchmarks/generate_throughput.py
    python benchmarks/generate_throughput.py --part gpt2 --batch-sizes 1 --rounds 2 --cli
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(num_layers=12, hidden_size=768, num_heads=12, seq_length=1024, vocab_size=50257)
# the LLaMA of GPT-2 small's size: its `model` keys beside SHAPE's
LLAMA = dict(num_kv_heads=4, ffn_hidden_size=2048, tie_word_embeddings=False)
CONFIGS = {name: os.path.join(ROOT, "model_zoo", "models", name, "configs", "tiny.yaml")
           for name in ("gpt2", "llama")}
MODEL_KEYS = {"gpt2": dict(SHAPE, dropout=0.0, attention_dropout=0.0),
              "llama": dict(SHAPE, **LLAMA)}


def weight_bytes(model: str) -> int:
    """float32 bytes of the weights a batch-1 step reads: every product's and the head's."""
    hidden, layers, vocab = SHAPE["hidden_size"], SHAPE["num_layers"], SHAPE["vocab_size"]
    if model == "gpt2":   # qkv, output, 4x feed-forward; the head is the tied embedding table
        return 4 * (layers * 12 * hidden ** 2 + vocab * hidden)
    kv_width = 2 * LLAMA["num_kv_heads"] * hidden // SHAPE["num_heads"]
    block = 2 * hidden ** 2 + kv_width * hidden + 3 * hidden * LLAMA["ffn_hidden_size"]
    return 4 * (layers * block + vocab * hidden)


def prompts(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, SHAPE["vocab_size"], (batch, length))


def ours(model: str, batch: int, length: int, new_tokens: int, rounds: int) -> float:
    import mindspore as ms
    from model_zoo.causal_lm.generate import CachedGenerator
    from model_zoo.config import import_model, load_config
    from model_zoo.parallel.context import set_run_context
    set_run_context("CPU")   # as the commands set it
    ms.set_seed(0)
    config = load_config(CONFIGS[model], [f"model.{key}={value}"
                                          for key, value in MODEL_KEYS[model].items()])
    lm = import_model(model).build_train_network(config, ms.float32).lm
    generator = CachedGenerator(lm)
    rows = prompts(batch, length).tolist()
    return _best(lambda: generator.generate(rows, new_tokens), batch, new_tokens, rounds)


def reference(model: str, batch: int, length: int, new_tokens: int, rounds: int) -> float:
    import torch
    import transformers
    torch.manual_seed(0)
    if model == "gpt2":
        config = transformers.GPT2Config(
            n_layer=SHAPE["num_layers"], n_embd=SHAPE["hidden_size"], n_head=SHAPE["num_heads"],
            n_positions=SHAPE["seq_length"], vocab_size=SHAPE["vocab_size"])
        model = transformers.GPT2LMHeadModel(config).eval()
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=SHAPE["num_layers"], hidden_size=SHAPE["hidden_size"],
            num_attention_heads=SHAPE["num_heads"], num_key_value_heads=LLAMA["num_kv_heads"],
            intermediate_size=LLAMA["ffn_hidden_size"], max_position_embeddings=SHAPE["seq_length"],
            vocab_size=SHAPE["vocab_size"], tie_word_embeddings=LLAMA["tie_word_embeddings"])
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.from_numpy(prompts(batch, length))

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)
    return _best(run, batch, new_tokens, rounds)


def _best(run, batch: int, new_tokens: int, rounds: int) -> float:
    """Items per second (batch x new_tokens per run) of the fastest of `rounds` runs."""
    run()   # warm-up: compilation, allocator
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return batch * new_tokens / min(times)


BEAM = dict(sentences=64, batch=32, source_tokens=20, beam=4, length_penalty=0.6)
TINY_TRANSFORMER = os.path.join(ROOT, "model_zoo", "models", "transformer", "configs",
                                "tiny.yaml")


def sources() -> list:
    """The beam benchmark's sources: random ids (past the special ids 0-3) and eos (3)."""
    rng = np.random.default_rng(0)
    return [rng.integers(4, 8000, BEAM["source_tokens"]).tolist() + [3]
            for _ in range(BEAM["sentences"])]


def beam_ours(rounds: int) -> float:
    import mindspore as ms
    from model_zoo.config import load_config
    from model_zoo.models.transformer.model import Transformer
    from model_zoo.models.transformer.tasks import translate_ids
    from model_zoo.parallel.context import set_run_context
    set_run_context("CPU")   # as the commands set it
    ms.set_seed(0)
    config = load_config(TINY_TRANSFORMER, ["model.dropout=0", "model.attention_dropout=0",
                                            f"model.length_penalty={BEAM['length_penalty']}"])
    transformer = Transformer(config.model)
    rows = sources()
    return _best(lambda: translate_ids(config, transformer, rows, BEAM["beam"],
                                       batch_size=BEAM["batch"]), len(rows), 1, rounds)


def beam_reference(rounds: int) -> float:
    import torch
    import transformers
    from model_zoo.config import load_config
    model_config = load_config(TINY_TRANSFORMER).model
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=model_config.vocab_size, d_model=model_config.hidden_size,
        encoder_layers=model_config.num_layers, decoder_layers=model_config.num_layers,
        encoder_attention_heads=model_config.num_heads,
        decoder_attention_heads=model_config.num_heads,
        encoder_ffn_dim=model_config.ffn_hidden_size, decoder_ffn_dim=model_config.ffn_hidden_size,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=3, decoder_start_token_id=2,
        forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0)
    model = transformers.MarianMTModel(config).eval()
    rows = torch.tensor(sources())
    positions = BEAM["source_tokens"] + 1 + model_config.max_decode_extra

    def run():
        with torch.no_grad():
            for start in range(0, len(rows), BEAM["batch"]):
                ids = rows[start:start + BEAM["batch"]]
                model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=BEAM["beam"],
                               length_penalty=BEAM["length_penalty"], do_sample=False,
                               max_new_tokens=positions, min_new_tokens=positions)
    return _best(run, len(rows), 1, rounds)


def _timed_command(arguments: list) -> float:
    """Seconds `model-zoo ARGUMENTS` takes as a user runs it (its own process)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "model_zoo", *arguments],
                          capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"))
    if done.returncode != 0:
        sys.exit(f"model-zoo {' '.join(arguments[:2])} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def _difference(longer: float, shorter: float) -> float:
    """Seconds the longer command took over the shorter; exits when run-to-run noise left
    no difference to measure."""
    if longer <= shorter:
        sys.exit(f"the longer command ({longer:.1f} s) was not slower than the shorter "
                 f"({shorter:.1f} s): start-up noise hides the work; raise --rounds or "
                 f"--new-tokens")
    return longer - shorter


def _random_checkpoint(config, path: str, seed: int = 0) -> str:
    """The config's training network with seeded random weights, saved to `path`."""
    import mindspore as ms
    from model_zoo.config import import_model
    from model_zoo.parallel.context import set_run_context
    set_run_context("CPU")
    ms.set_seed(seed)
    ms.save_checkpoint(import_model(config.model.name).build_train_network(config, ms.float32),
                       path)
    return path


def cli_generate(model: str, batch: int, length: int, new_tokens: int, rounds: int) -> float:
    """Tokens/s of `model-zoo generate` at the model's shape, as the library side runs it
    (`batch` prompts a batch, new_tokens each): 3 x batch x new_tokens / the difference
    between the fastest runs over the prompts four times and once (four batches and one;
    the later batches compile nothing)."""
    from model_zoo.config import load_config
    with tempfile.TemporaryDirectory() as workdir:
        overrides = [f"model.{key}={value}" for key, value in MODEL_KEYS[model].items()] + [
            f"data.dataset_dir={workdir}/no-dataset"]   # no tokenizer: ids only
        config = load_config(CONFIGS[model], overrides)
        ckpt = _random_checkpoint(config, os.path.join(workdir, f"{model}.ckpt"))
        sets = [flag for override in overrides for flag in ("--set", override)]
        rows = [" ".join(map(str, row)) + "\n" for row in prompts(batch, length)]

        def fastest(copies: int) -> float:
            ids_file = os.path.join(workdir, f"prompts{copies}.txt")
            with open(ids_file, "w", encoding="utf-8") as handle:
                handle.writelines(rows * copies)
            return min(_timed_command(["generate", CONFIGS[model], *sets, "--ckpt", ckpt,
                                       "--prompt-ids-file", ids_file, "--batch-size",
                                       str(batch), "--max-new-tokens", str(new_tokens),
                                       "--greedy"]) for _ in range(rounds))
        return 3 * batch * new_tokens / _difference(fastest(4), fastest(1))


def beam_cli(rounds: int) -> list:
    """[sentences/s of `model-zoo translate`, of `translate_ids` in this process on the same
    sentences and weights]: the tiny Transformer's dimensions, random weights, 32 text lines
    of about the benchmark's source length (decoded random ids that encode to 17-24 tokens
    with eos, one padded length; the tokenizer is the tiny config's dataset's, built here on
    first use). The command's figure is 3 x 32 / the difference between the fastest runs
    over the lines four times and once: every batch has one shape, so the later ones compile
    nothing."""
    from model_zoo.config import import_model, load_config
    from model_zoo.models.transformer.tasks import EVAL_BATCH, translate_ids
    from model_zoo.checkpoint.files import load_network
    overrides = ["model.dropout=0", "model.attention_dropout=0",
                 f"model.length_penalty={BEAM['length_penalty']}"]
    config = load_config(TINY_TRANSFORMER, overrides)
    module = import_model("transformer")
    module.prepare_data(config)
    tokenizer = module.tasks._tokenizer(config)
    rng = np.random.default_rng(0)
    lines = []
    while len(lines) < EVAL_BATCH:   # lines of 17-24 tokens with eos: one padded shape
        line = tokenizer.decode(rng.integers(4, config.model.vocab_size,
                                             BEAM["source_tokens"]).tolist()).strip()
        if len(line.splitlines()) == 1 and 16 < len(tokenizer.encode(line)) + 1 <= 24:
            lines.append(line)
    with tempfile.TemporaryDirectory() as workdir:
        ckpt = _random_checkpoint(config, os.path.join(workdir, "transformer.ckpt"))
        # the library on the same sentences and weights, as `run_translate` encodes them
        sources = [tokenizer.encode(line)[:config.model.seq_length - 1] + [tokenizer.eos_id]
                   for line in lines]
        network = load_network(config, ckpt)
        library = _best(lambda: translate_ids(config, network.transformer, sources,
                                              BEAM["beam"]), len(sources), 1, rounds)
        sets = [flag for override in overrides for flag in ("--set", override)]

        def fastest(copies: int) -> float:
            path = os.path.join(workdir, f"lines{copies}.txt")
            with open(path, "w", encoding="utf-8") as handle:
                handle.writelines(line + "\n" for line in lines * copies)
            return min(_timed_command(["translate", TINY_TRANSFORMER, *sets, "--ckpt", ckpt,
                                       "--input", path, "--beam", str(BEAM["beam"])])
                       for _ in range(rounds))
        return [3 * len(lines) / _difference(fastest(4), fastest(1)), library]


def read_bandwidth() -> float:
    """Bytes a second this machine reads weights at: numpy's matrix-vector product over a
    512 MB matrix, the fastest of 5."""
    matrix = np.ones((128, 2 ** 20), np.float32)
    vector = np.ones(2 ** 20, np.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        matrix @ vector
        best = min(best, time.perf_counter() - started)
    return matrix.nbytes / best


SIDES = {"gpt2": (ours, reference, cli_generate), "llama": (ours, reference, cli_generate),
         "beam": (beam_ours, beam_reference, beam_cli)}
TITLES = {"gpt2": "GPT-2 small shape", "llama": "LLaMA of GPT-2 small's size (4 key/value heads)"}
SIDE_INDEX = {"ours": 0, "reference": 1, "cli": 2}


def run_side(part: str, side: str, args, batch: int = None) -> float:
    """One side of one part in a process of its own; returns its figure."""
    command = [sys.executable, os.path.abspath(__file__), "--part", part, "--side", side,
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
               "--rounds", str(args.rounds)] + (["--batch", str(batch)] if batch else [])
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{part} {side} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("gpt2", "llama", "beam", "all"), default="all")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cli", action="store_true",
                        help="also time `model-zoo generate` / `model-zoo translate` as a user "
                             "runs them")
    parser.add_argument("--side", choices=tuple(SIDE_INDEX), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:   # one side in this process: print its figure
        function = SIDES[args.part][SIDE_INDEX[args.side]]
        if args.part in TITLES:
            print(json.dumps(function(args.part, args.batch, args.prompt_tokens,
                                      args.new_tokens, args.rounds)))
        else:
            print(json.dumps(function(args.rounds)))
        return
    sides = ("ours", "reference") + (("cli",) if args.cli else ())
    cli_heading = f" {'CLI':>9} {'CLI / ours':>10}" if args.cli else ""

    def cli_columns(figures):
        return f" {figures[2]:>9.1f} {figures[2] / figures[0]:>9.2f}x" if args.cli else ""

    bandwidth = read_bandwidth() if any(part in (args.part, "all") for part in TITLES) else 0
    for part, title in TITLES.items():
        if args.part not in (part, "all"):
            continue
        floor = 1000 * weight_bytes(part) / bandwidth
        print(f"{title}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
              f"greedy, best of {args.rounds} rounds; weight floor at batch 1: "
              f"{weight_bytes(part) / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s, {floor:.1f} ms "
              f"a token ({1000 / floor:.1f} tokens/s)")
        # ms a token: the command's with --cli, else the library's
        print(f"{'batch':>5} {'ours tokens/s':>14} {'Hugging Face':>13} {'ours / HF':>10}"
              f"{cli_heading} {'ms a token':>10} {'/ floor':>8}")
        for batch in args.batch_sizes:
            figures = [run_side(part, side, args, batch) for side in sides]
            mine, theirs = figures[:2]
            per_token = 1000 * batch / figures[-1 if args.cli else 0]
            to_floor = f"{per_token / floor:>7.2f}x" if batch == 1 else f"{'-':>8}"
            print(f"{batch:>5} {mine:>14.1f} {theirs:>13.1f} {mine / theirs:>9.2f}x"
                  f"{cli_columns(figures)} {per_token:>10.1f} {to_floor}", flush=True)
    if args.part in ("beam", "all"):
        print(f"beam search, tiny Transformer dimensions, {BEAM['sentences']} sentences of "
              f"{BEAM['source_tokens']} tokens in batches of {BEAM['batch']}, beam "
              f"{BEAM['beam']}, best of {args.rounds} rounds", flush=True)
        mine, theirs = (run_side("beam", side, args) for side in ("ours", "reference"))
        print(f"{'ours sentences/s':>17} {'Marian (HF)':>12} {'ours / HF':>10}")
        print(f"{mine:>17.1f} {theirs:>12.1f} {mine / theirs:>9.2f}x", flush=True)
        if args.cli:
            command, library = run_side("beam", "cli", args)
            print(f"model-zoo translate on 32 text lines (random ids decoded), beam "
                  f"{BEAM['beam']}: {command:.1f} sentences/s; translate_ids on the same "
                  f"sentences: {library:.1f}; CLI / library {command / library:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
