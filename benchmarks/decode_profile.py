"""Where a decoding step's time goes: the fused CPU kernels (each timed inside), MindSpore
around them (the step cell's call and its executor), and Python around the step cell.

The models and prompts are generate_throughput.py's (GPT-2 small's shape, or the LLaMA of
its size, random weights, prompts of 32 tokens); `--rounds` calls of `CachedGenerator.
generate` make 128 new tokens each after one warm-up call. The kernels are timed by the
clock of `cpu_kernels.cc` (MODEL_ZOO_KERNEL_CLOCK, set here before they load); the prefill
calls are timed apart and left out of the step's figures. The weight floor is
generate_throughput.py's: the weight bytes a batch-1 step reads over numpy's read bandwidth.

    python benchmarks/decode_profile.py --model gpt2 --batch 1
    python benchmarks/decode_profile.py --model llama --batch 8
"""

import argparse
import ctypes
import os
import sys
import time

os.environ["MODEL_ZOO_KERNEL_CLOCK"] = "1"   # before the kernels load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_throughput as shapes  # noqa: E402  (the benchmark's models and prompts)


class KernelClock:
    """The kernels' clock: {name: (seconds, calls)} since the last reset."""

    def __init__(self, library: str):
        self.library = ctypes.CDLL(library)

    def read(self) -> dict:
        size = self.library.KernelClockRead(None, 0)
        text = ctypes.create_string_buffer(size)
        self.library.KernelClockRead(text, size)
        found = {}
        for line in text.value.decode().splitlines():
            name, seconds, calls = line.split()
            found[name] = (float(seconds), int(calls))
        return found

    def total(self) -> float:
        return sum(seconds for seconds, _ in self.read().values())

    def reset(self):
        self.library.KernelClockReset()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(shapes.TITLES), default="gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import mindspore as ms
    from mindspore import nn
    from model_zoo.causal_lm import generate as generation
    from model_zoo.config import import_model, load_config
    from model_zoo.nn import cpu_kernels
    from model_zoo.parallel.context import set_run_context
    if not cpu_kernels.available():
        sys.exit("the CPU kernels did not build here: nothing of theirs to profile")
    set_run_context("CPU")
    ms.set_seed(0)
    config = load_config(shapes.CONFIGS[args.model], [
        f"model.{key}={value}" for key, value in shapes.MODEL_KEYS[args.model].items()])
    lm = import_model(args.model).build_train_network(config, ms.float32).lm
    clock = KernelClock(cpu_kernels.library())
    spent = {"step": 0.0, "prefill": 0.0, "prefill kernels": 0.0, "steps": 0}

    def timed_call(self, ids, *inputs):
        """A step (one position) or prefill (several): the same cell, timed apart."""
        started, kernels = time.perf_counter(), clock.total()
        try:
            return nn.Cell.__call__(self, ids, *inputs)
        finally:
            if ids.shape[1] == 1:
                spent["step"] += time.perf_counter() - started
                spent["steps"] += 1
            else:
                spent["prefill"] += time.perf_counter() - started
                spent["prefill kernels"] += clock.total() - kernels

    generation.DecodeStep.__call__ = timed_call
    generator = generation.CachedGenerator(lm)
    rows = shapes.prompts(args.batch, 32).tolist()
    generator.generate(rows, args.new_tokens)   # compiles
    clock.reset()
    spent.update({key: 0 for key in spent})
    started = time.perf_counter()
    for _ in range(args.rounds):
        generator.generate(rows, args.new_tokens)
    total = time.perf_counter() - started
    kernels = clock.read()
    steps = spent["steps"]
    in_steps = sum(seconds for seconds, _ in kernels.values()) - spent["prefill kernels"]
    floor = 1000 * shapes.weight_bytes(args.model) / shapes.read_bandwidth()

    def per_step(seconds: float) -> str:
        return f"{1000 * seconds / steps:.2f} ms"

    print(f"{shapes.TITLES[args.model]}, batch {args.batch}, {args.rounds} x "
          f"{args.new_tokens} tokens: {per_step(total - spent['prefill'])} a decoding step "
          f"(batch-1 weight floor {floor:.1f} ms)")
    print(f"  the step cell's calls: {per_step(spent['step'])}, of which the kernels "
          f"{per_step(in_steps)} and MindSpore around them {per_step(spent['step'] - in_steps)}")
    print(f"  Python around the step cell: "
          f"{per_step(total - spent['prefill'] - spent['step'])}; prefill apart: "
          f"{1000 * spent['prefill'] / args.rounds:.1f} ms a call")
    print(f"  {'kernel (prefill included)':<30} {'calls a step':>12} {'ms a step':>10}")
    for name, (seconds, calls) in sorted(kernels.items(), key=lambda item: -item[1][0]):
        print(f"  {name:<30} {calls / steps:>12.1f} {1000 * seconds / steps:>10.2f}")


if __name__ == "__main__":
    main()
