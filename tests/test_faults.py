"""Faults during training, in real processes: SIGTERM and SIGINT (the run finishes its step,
saves a checkpoint, says how to resume, exits 128 + the signal; the checkpoint resumes) and
a second run on the same output directory (refused, naming the first), and a disk that
fills up during a checkpoint save (older checkpoints kept, no partial files)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import run_cli
from model_zoo.train.checkpoint import CHECKPOINT_PATTERN as CHECKPOINT


def start_training(config, run_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, GLOG_v="3"))


def train_until_signalled(config, run_dir, sig, after_step=3, while_running=None):
    """Start `model-zoo train`, send `sig` once step `after_step` is logged (first calling
    `while_running()` if given); returns (exit status, everything it printed)."""
    process = start_training(config, run_dir)
    printed = []
    try:
        for line in process.stdout:
            printed.append(line)
            if line.startswith(f"step {after_step}/"):
                if while_running is not None:
                    while_running()
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


def test_a_second_run_on_the_same_directory_is_refused(write_config, tmp_path):
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    run_dir = tmp_path / "run"
    second = {}

    def run_a_second_time():
        holder = (run_dir / ".lock").read_text().strip()
        result = run_cli("train", config, "--output-dir", run_dir)
        second.update(holder=holder, status=result.returncode, stderr=result.stderr,
                      listing=sorted(os.listdir(run_dir)))

    status, output = train_until_signalled(config, run_dir, signal.SIGTERM,
                                           while_running=run_a_second_time)
    assert second["status"] == 2
    assert second["stderr"].strip() == (f"error: {run_dir} is in use by another run (pid "
                                        f"{second['holder']}); wait for it to end, or choose "
                                        f"another --output-dir")
    assert status == 143, output                     # the first run went on, then stopped
    assert not (run_dir / ".lock").exists()          # released on the way out
    result = run_cli("train", config, "--output-dir", run_dir, "--resume",
                     "--set", "train.steps=5")
    assert result.returncode == 0, result.stderr     # the directory is free again


def test_output_dir_naming_a_file(write_config, tmp_path):
    config = write_config({"train.steps": 2})
    target = tmp_path / "a_file"
    target.write_text("keep me")
    result = run_cli("train", config, "--output-dir", target)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --output-dir {str(target)!r} is a file, not a directory"
    assert target.read_text() == "keep me"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (room for about three tiny checkpoints) at tmp_path/disk; skipped where
    this process may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip() or 'no mount'}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_keeps_older_checkpoints(write_config, small_disk):
    import mindspore as ms
    config = write_config({"train.steps": 100, "train.log_steps": 1, "train.save_steps": 1,
                           "train.keep_checkpoints": 100})
    run_dir = small_disk / "run"
    result = run_cli("train", config, "--output-dir", run_dir)

    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: cannot save the step ") and "No space left on device" in line
    assert "free some space and continue with --resume" in line
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    assert len(checkpoints) >= 2 and all(CHECKPOINT.match(p.name) for p in checkpoints), \
        checkpoints                                          # no partial files left
    for checkpoint in checkpoints:
        assert ms.load_checkpoint(str(checkpoint))           # every older one loads
    newest = int(CHECKPOINT.match(checkpoints[-1].name).group(1))

    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    result = run_cli("train", config, "--output-dir", run_dir, "--resume",
                     "--set", f"train.steps={newest + 2}")
    assert result.returncode == 0, result.stderr
    assert f"(step {newest})" in result.stdout
