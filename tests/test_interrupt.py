"""SIGTERM and SIGINT during training: the run finishes its step, saves a checkpoint, says how
to resume, and exits 128 + the signal; the checkpoint resumes (real processes)."""

import json
import os
import signal
import subprocess
import sys


from conftest import run_cli


def train_until_signalled(config, run_dir, sig, after_step=3):
    """Start `model-zoo train`, send `sig` once step `after_step` is logged; returns
    (exit status, everything it printed)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, GLOG_v="3"))
    printed = []
    try:
        for line in process.stdout:
            printed.append(line)
            if line.startswith(f"step {after_step}/"):
                process.send_signal(sig)
                break
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, "".join(printed) + rest


def stopped_step(output: str) -> int:
    (line,) = [line for line in output.splitlines() if line.startswith("stopped by")]
    return int(line.split("after step ")[1].split(";")[0])


def test_sigterm_saves_a_checkpoint_that_resumes(write_config, tmp_path):
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    run_dir = tmp_path / "run"
    status, output = train_until_signalled(config, run_dir, signal.SIGTERM)
    assert status == 143, output
    step = stopped_step(output)
    assert step >= 3
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}.ckpt"
    assert checkpoint.is_file()
    assert f"continue with: model-zoo train {config} --output-dir {run_dir} --resume" in output
    assert "received SIGTERM: stopping after this step" in output
    assert "held-out evaluation" not in output          # no evaluation of a stopped run

    result = run_cli("train", config, "--output-dir", run_dir, "--resume",
                     "--set", f"train.steps={step + 2}")
    assert result.returncode == 0, result.stderr
    assert f"resuming from {checkpoint} (step {step})" in result.stdout
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 3))             # nothing lost, nothing repeated


def test_sigint_stops_cleanly(write_config, tmp_path):
    """Ctrl-C. MindSpore's graph runtime installs a native SIGINT handler on every graph run
    that re-raises it as SIGTERM, so a Ctrl-C during a step is reported as SIGTERM (143);
    between steps it is SIGINT (130). Either way the step's checkpoint is saved."""
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    run_dir = tmp_path / "run"
    status, output = train_until_signalled(config, run_dir, signal.SIGINT)
    assert status in (130, 143), output
    step = stopped_step(output)
    assert (run_dir / "checkpoints" / f"step_{step:08d}.ckpt").is_file()
    assert "Traceback" not in output
