"""`bash scripts/ascend_first_run.sh [--cpu]`: a few minutes' check of a server before a
long job (docs/ascend.md, "Before a long job"). Three drills on two devices, each printing
PASS or what differed; exit 0 when all pass, 1 otherwise.

1. accumulation: GPT-2 tiny, one step of the same global batch of 8 with
   train.grad_accumulation 4 and 1 (model_parallel 2: MindSpore's GradAccumulation cell):
   the gradient norms agree within 1e-3 (the kernels sum in another order).
2. pipeline: GPT-2 tiny on 2 stages, 2 micro batches, 3 steps, with HCCL_EXEC_TIMEOUT=120:
   a collective or a Send that waits for a peer that never comes (`model-zoo dryrun
   --check-numbers` lists the Sends whose compiled order may do that: its
   `reordered_sends`) ends the job in two minutes, not the default half hour.
3. fp16 overflow: GPT-2 tiny in fp16 on 2 data-parallel devices, 2 steps from a loss
   scale of 2^40: the first step overflows on every rank, is skipped everywhere, and the
   second runs at half the scale everywhere.

On Ascend the jobs are started by scripts/run_distribute_train_msrun.sh (no rank table
needed). `--cpu` runs the same drills on this machine, as the tests do: 1 and 3 as two CPU
workers (data parallel, the train step accumulating itself), 2 as the CPU stand-in of the
compiled pipeline (`model-zoo dryrun --check-numbers`, which runs each stage's compiled
graph on a CPU rank).
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from model_zoo.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = "model_zoo/models/gpt2/configs/tiny.yaml"
DEVICES = 2
BASE = ["model.num_layers=2", "train.global_batch_size=8", "train.log_steps=1",
        "train.save_steps=1000"]
HUGE_LOSS_SCALE = 2.0 ** 40     # overflows any fp16 gradient
TIMEOUT = 900                   # seconds a drill's job may take, its compile included
# the drills' HCCL time-outs: a rank that never connects, or a collective whose peer never
# comes, ends the job well within TIMEOUT
HCCL_TIMEOUTS = {"HCCL_CONNECT_TIMEOUT": "300", "HCCL_EXEC_TIMEOUT": "300"}
STOP_SECONDS = 60               # after a SIGTERM, how long the job has to save and stop


def run_job(name: str, overrides, out: Path, cpu: bool, env=None):
    """One training job of GPT-2 tiny on DEVICES devices (msrun), its output in out/name:
    (exit status, the job's last lines, {rank: its metrics.jsonl entries})."""
    folder = out / name
    script = ROOT / "scripts" / "run_distribute_train_msrun.sh"
    command = ["bash", str(script), str(DEVICES), TINY, "--output-dir", str(folder),
               *[part for override in BASE + overrides for part in ("--set", override)]]
    job_env = dict(os.environ, GLOG_v="3", MASTER_PORT=str(20000 + os.getpid() % 20000),
                   DEVICE_TARGET="CPU" if cpu else "Ascend", **{**HCCL_TIMEOUTS, **(env or {})})
    status, output = run_to_end(command, job_env)
    metrics = {}
    for rank in range(DEVICES):
        path = folder / f"rank_{rank}" / "metrics.jsonl"
        metrics[rank] = read_metrics(str(path)) if path.exists() else []
    return status, " | ".join(output.strip().splitlines()[-3:]), metrics


def run_to_end(command, env) -> tuple:
    """(exit status, output) of `command`, run in a session of its own. Past TIMEOUT it is
    asked to stop (a SIGTERM: the launch script's workers save and stop), then told again
    (the script then ends its workers and msrun at once, which run in sessions of their
    own), then killed: status None."""
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = job.communicate(timeout=TIMEOUT)[0]
        return job.returncode, output
    except subprocess.TimeoutExpired:
        pass
    output = ""
    for signum, grace in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGTERM, 10),
                          (signal.SIGKILL, None)):
        try:
            os.killpg(job.pid, signum)
        except ProcessLookupError:
            pass
        try:
            output = job.communicate(timeout=grace)[0]
            break
        except subprocess.TimeoutExpired:
            continue
    return None, f"{output}\nstopped after {TIMEOUT} s"


def accumulation_drill(out: Path, cpu: bool) -> str:
    """'' when one step accumulated 4 times has one step's gradient norm, else what differed."""
    layout = [] if cpu else ["parallel.model_parallel=2"]
    norms = {}
    for accumulation in (1, 4):
        status, tail, metrics = run_job(f"accumulation_{accumulation}", layout + [
            "train.steps=1", f"train.grad_accumulation={accumulation}"], out, cpu)
        if status != 0 or not metrics[0]:
            return f"the job with accumulation {accumulation} failed ({status}): {tail}"
        norms[accumulation] = metrics[0][0]["grad_norm"]
    if abs(norms[4] - norms[1]) > 1e-3 * max(1.0, abs(norms[1])):
        return (f"gradient norm {norms[4]:.6g} with accumulation 4, {norms[1]:.6g} without, "
                f"on the same batch")
    return ""


def pipeline_drill(out: Path, cpu: bool) -> str:
    """'' when a 2-stage pipeline runs 3 steps without a hang, else what happened."""
    overrides = ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2"]
    if cpu:
        command = [sys.executable, "-m", "model_zoo", "dryrun", TINY, "--set",
                   *BASE[:2], "train.grad_clip=0.5", *overrides, "--check-numbers",
                   "--steps", "3", "--output-dir", str(out / "pipeline")]
        status, output = run_to_end(command, dict(os.environ, GLOG_v="3"))
        if status != 0:
            return f"the pipeline's numbers differ: {output.strip().splitlines()[-1:]}"
        hangs = output.count("its peer joins that only after receiving the Send")
        if hangs:   # the CPU runs them; whether Ascend waits there, only a server says
            print(f"  (the CPU ranks ran {hangs} Send(s) ahead of a collective their peer "
                  f"joins later: `model-zoo dryrun --check-numbers` lists them)", flush=True)
        return ""
    started = time.monotonic()
    status, tail, metrics = run_job("pipeline", overrides + ["train.steps=3"], out, cpu,
                                    env={"HCCL_EXEC_TIMEOUT": "120"})
    if status != 0:
        return (f"the job stopped ({status}) after {time.monotonic() - started:.0f} s: a "
                f"collective or Send waited past HCCL_EXEC_TIMEOUT=120 or a rank failed "
                f"({tail})")
    if len(metrics[0]) < 3:
        return f"rank 0 logged {len(metrics[0])} of 3 steps"
    return ""


def overflow_drill(out: Path, cpu: bool) -> str:
    """'' when a planted fp16 overflow is skipped, and the scale halved, on every rank."""
    status, tail, metrics = run_job("overflow", [
        "train.steps=2", "train.precision=fp16", f"train.loss_scale={HUGE_LOSS_SCALE:.0f}",
        "train.max_bad_steps=10"], out, cpu)
    if status != 0:
        return f"the job failed ({status}): {tail}"
    for rank, entries in metrics.items():
        if len(entries) < 2:
            return f"rank {rank} logged {len(entries)} of 2 steps"
        first, second = entries[0], entries[1]
        if first["finite"] or first["loss_scale"] != HUGE_LOSS_SCALE:
            return (f"rank {rank}: step 1 at loss scale {first['loss_scale']:g} was "
                    f"{'applied' if first['finite'] else 'skipped'}; expected skipped at "
                    f"{HUGE_LOSS_SCALE:g}")
        if second["loss_scale"] != HUGE_LOSS_SCALE / 2:
            return f"rank {rank}: step 2 ran at loss scale {second['loss_scale']:g}, not half"
    return ""


DRILLS = (("accumulation 4 against 1: equal gradient norms", accumulation_drill),
          ("a 2-stage pipeline, 3 steps, HCCL_EXEC_TIMEOUT=120", pipeline_drill),
          ("an fp16 overflow skipped and the scale halved on every rank", overflow_drill))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/ascend_first_run.sh",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="run the drills on this machine's CPU (as the tests do)")
    parser.add_argument("--output-dir", default="outputs/first_run",
                        help="where the jobs write (default outputs/first_run)")
    args = parser.parse_args(argv)
    out = Path(args.output_dir).resolve()
    failed = 0
    for title, drill in DRILLS:
        started = time.monotonic()
        print(f"{title} ...", flush=True)
        problem = drill(out, args.cpu)
        failed += bool(problem)
        print(f"  {'FAIL: ' + problem if problem else 'PASS'} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    print(f"{len(DRILLS) - failed} of {len(DRILLS)} drills passed"
          + ("" if not failed else f"; the jobs' logs are in {out}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
