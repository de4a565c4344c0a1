"""Generation throughput side by side with Hugging Face, on this machine, in one run.

GPT-2 small's shape (12 layers, hidden 768, 12 heads, 1,024 positions, vocabulary 50,257)
with random weights on both sides; prompts of 32 random tokens; 128 new tokens, greedy (no
end-of-sequence id, so every row makes all 128); batch 1 and 8. Ours: `CachedGenerator`
(the attention's key/value caches, one compiled step per batch size, graph mode); the
reference: `transformers.GPT2LMHeadModel.generate` on torch (its own key/value cache).
Each side runs in its own process; new tokens/s is the best of `--rounds` timed runs after
one warm-up run (ours compiles its step then).

    python benchmarks/generate_throughput.py
    python benchmarks/generate_throughput.py --batch-sizes 1 --new-tokens 64 --rounds 2
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(num_layers=12, hidden_size=768, num_heads=12, seq_length=1024, vocab_size=50257)


def prompts(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, SHAPE["vocab_size"], (batch, length))


def ours(batch: int, length: int, new_tokens: int, rounds: int) -> float:
    import mindspore as ms
    from model_zoo.models.gpt2.generate import CachedGenerator
    from model_zoo.models.gpt2.model import GPT2Config, GPT2LMHeadModel
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(dropout=0.0, attention_dropout=0.0, **SHAPE))
    generator = CachedGenerator(lm)
    rows = prompts(batch, length).tolist()
    return _best(lambda: generator.generate(rows, new_tokens), batch, new_tokens, rounds)


def reference(batch: int, length: int, new_tokens: int, rounds: int) -> float:
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=SHAPE["num_layers"], n_embd=SHAPE["hidden_size"],
                                     n_head=SHAPE["num_heads"], n_positions=SHAPE["seq_length"],
                                     vocab_size=SHAPE["vocab_size"])
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.from_numpy(prompts(batch, length))

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)
    return _best(run, batch, new_tokens, rounds)


def _best(run, batch: int, new_tokens: int, rounds: int) -> float:
    run()   # warm-up: compilation, allocator
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return batch * new_tokens / min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=("ours", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:   # one side in this process: print its tokens/s
        side = ours if args.side == "ours" else reference
        print(json.dumps(side(args.batch, args.prompt_tokens, args.new_tokens, args.rounds)))
        return
    print(f"GPT-2 small shape, prompt {args.prompt_tokens} tokens, {args.new_tokens} new "
          f"tokens, greedy, best of {args.rounds} rounds")
    print(f"{'batch':>5} {'ours tokens/s':>14} {'Hugging Face':>13} {'ours / HF':>10}")
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT)
    for batch in args.batch_sizes:
        speeds = {}
        for side in ("ours", "reference"):
            command = [sys.executable, os.path.abspath(__file__), "--side", side, "--batch",
                       str(batch), "--prompt-tokens", str(args.prompt_tokens),
                       "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            speeds[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{batch:>5} {speeds['ours']:>14.1f} {speeds['reference']:>13.1f} "
              f"{speeds['ours'] / speeds['reference']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
