"""Compile time and host memory of the shipped layouts under MindSpore's own parallel
compiler, measured with the command users run, `model-zoo dryrun`.

    python benchmarks/compile_time.py                                # every shipped layout
    python benchmarks/compile_time.py \
        --configs model_zoo/models/gpt2/configs/plan/gpt-100b-d1m8p16.yaml
    python benchmarks/compile_time.py --blocks-per-stage 0           # full depth (slow)

Each config is compiled for the first rank of its first and last pipeline stage, with all
its micro batches and accumulation steps, at `--blocks-per-stage` blocks per stage
(default 1; 0 keeps the config's depth). Per config it prints the command's wall time and,
per rank, MindSpore's compile seconds and the process's peak resident memory; the figures
also go to benchmarks/results/compile_time.json. What it measures is MindSpore's frontend
(the parallel pass, on its GPU branch) that an Ascend job runs before its first step; the
Ascend backend's own graph compile comes after it on a cluster and is not in these figures.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from model_zoo.plan.docs import cluster_config_files, shown_path  # noqa: E402
from model_zoo.dryrun.run import blocks_overrides  # noqa: E402
from model_zoo.config import load_config  # noqa: E402


def measure(path: str, blocks_per_stage: int, timeout: float) -> dict:
    config = load_config(path, layout_checked=False)
    parallel, train = config.parallel, config.train
    overrides = []
    layers = config.model.num_layers
    if blocks_per_stage:
        layers = blocks_per_stage * parallel.pipeline_stage
        overrides += blocks_overrides(parallel, [blocks_per_stage] * parallel.pipeline_stage)
    last = (parallel.pipeline_stage - 1) * parallel.devices_per_stage
    ranks = ",".join(str(rank) for rank in sorted({0, last}))
    command = [sys.executable, "-m", "model_zoo", "dryrun", path, "--ranks", ranks, "--json",
               "--timeout", str(timeout)] + [f"--set={override}" for override in overrides]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, GLOG_v="3"))
    wall = time.perf_counter() - started
    micro = parallel.micro_batch_num if parallel.pipeline_stage > 1 else 1
    entry = {"config": shown_path(path), "devices": parallel.device_num, "layers": layers,
             "micro_steps": micro * train.grad_accumulation, "wall_s": round(wall, 1)}
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        entry["error"] = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return entry
    entry["ok"] = report["ok"]
    entry["ranks"] = [{key: rank[key] for key in ("rank", "compiled", "compile_s",
                                                    "peak_rss_mb", "error")}
                      for rank in report["ranks"]]
    return entry


def line(entry: dict) -> str:
    head = (f"{entry['config']:58s} {entry['devices']:5d} {entry['layers']:4d} "
            f"{entry['micro_steps']:6d} {entry['wall_s']:7.1f}")
    if "error" in entry:
        return head + f"  error: {entry['error']}"
    ranks = "  ".join(f"r{rank['rank']}: {rank['compile_s']} s {rank['peak_rss_mb']} MB"
                      if rank["compiled"] else f"r{rank['rank']}: FAILED {rank['error']}"
                      for rank in entry["ranks"])
    return head + "  " + ranks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", help="configs to compile (default: every "
                                                     "shipped cluster and layout config)")
    parser.add_argument("--blocks-per-stage", type=int, default=1,
                        help="blocks per pipeline stage (default 1; 0: the config's depth)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds a rank may compile (default 3600)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "compile_time.json"))
    args = parser.parse_args()
    configs = args.configs or cluster_config_files()
    print(f"{'config':58s} {'devs':>5s} {'lays':>4s} {'micro':>6s} {'wall s':>7s}  "
          f"per rank: MindSpore's compile, peak memory", flush=True)
    entries = []
    for path in configs:
        entries.append(measure(path, args.blocks_per_stage, args.timeout))
        print(line(entries[-1]), flush=True)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump({"blocks_per_stage": args.blocks_per_stage, "configs": entries}, handle,
                  indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
