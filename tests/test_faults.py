"""Faults during training, in real processes: SIGTERM and SIGINT (the run finishes its step,
saves a checkpoint, says how to resume, exits 128 + the signal; the checkpoint resumes) and
a second run on the same output directory (refused, naming the first), a disk that fills
up during a checkpoint save (older checkpoints kept, no partial files), signals to one rank
or to the launcher of a data-parallel job, and the leftovers of killed runs and builds.
Corrupt and mismatched inputs are in test_cli.py (one error line each)."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from model_zoo.checkpoint.files import CHECKPOINT_PATTERN as CHECKPOINT


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


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_resumes(write_config, tmp_path):
    """A SIGTERM saves the step's checkpoint; --resume continues from it, past a metrics
    line torn mid-append (a full disk or a kill while writing), which it drops."""
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
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"step": 99, "loss": 1.2, "step_')   # an append a full disk cut short

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


def test_sighup_from_a_dropped_terminal_saves_a_checkpoint(write_config, tmp_path):
    """A dropped ssh session: the run's terminal is gone (every write to it fails) and
    SIGHUP arrives. The run saves the step's checkpoint as for SIGTERM and exits 129."""
    import pty
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    run_dir = tmp_path / "run"
    terminal, its_end = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(run_dir)],
        stdout=its_end, stderr=its_end, start_new_session=True,
        env=dict(os.environ, GLOG_v="3"))
    os.close(its_end)
    printed = b""
    try:
        while b"step 2/" not in printed:
            printed += os.read(terminal, 4096)
        os.close(terminal)   # the terminal hangs up: writes to it fail from now on
        process.send_signal(signal.SIGHUP)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 129, printed.decode(errors="replace")
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*.ckpt")
    steps = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert checkpoint.name == f"step_{len(steps):08d}.ckpt"


@pytest.mark.slow
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
    assert result.stderr.strip() == (f"error: --output-dir {str(target)!r} is a file, not a "
                                     f"directory")
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


@pytest.mark.slow
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


def test_a_disk_too_full_for_the_first_checkpoint_says_to_start_again(write_config,
                                                                       small_disk):
    """With no checkpoint saved yet there is nothing to --resume from: the error says so."""
    config = write_config({"train.steps": 2, "train.save_steps": 1, "model.hidden_size": 256,
                           "model.num_heads": 4})   # a 1 MB disk holds no checkpoint
    result = run_cli("train", config, "--output-dir", small_disk / "run")
    assert result.returncode == 2, result.stdout + result.stderr
    line = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert line.startswith("error: cannot save the step 1 checkpoint") and (
        "no checkpoint was saved before it, so free some space and start the run again "
        "(without --resume)") in line


def run_two_ranks_until_signalled(config, out, send_signal):
    """Start 2 data-parallel CPU ranks with scripts/run_distribute_train.sh, call
    `send_signal(launcher, rank_pids)` once both logged step 3; returns (launcher exit
    status, its stderr, its stdout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = subprocess.Popen(
        ["bash", os.path.join(root, "scripts", "run_distribute_train.sh"), "2",
         os.path.join(root, "rank_tables", "rank_table_2p.json"), config, "--output-dir",
         str(out)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, GLOG_v="3", PYTHON=sys.executable, DEVICE_TARGET="CPU"))
    try:
        pids = {}
        while len(pids) < 2:
            line = job.stdout.readline()
            assert line, job.stderr.read()
            if line.startswith("rank "):
                rank, pid = line.split(":")[0].split()[1], line.split("pid ")[1].split(",")[0]
                pids[int(rank)] = int(pid)
        logs = [out / f"rank_{rank}" / "train.log" for rank in (0, 1)]
        deadline = time.monotonic() + 180
        while not all("step 3/" in (log.read_text() if log.exists() else "") for log in logs):
            assert time.monotonic() < deadline and job.poll() is None, job.stderr.read()
            time.sleep(0.2)
        send_signal(job, pids)
        stdout, stderr = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    return job.returncode, stderr, stdout


def assert_both_ranks_stopped_at_one_step(out):
    steps = []
    for rank in (0, 1):
        log = (out / f"rank_{rank}" / "train.log").read_text()
        steps.append(stopped_step(log))
        assert "Traceback" not in log, log
    assert steps[0] == steps[1], steps
    names = [sorted(p.name for p in (out / f"rank_{rank}" / "checkpoints").iterdir())
             for rank in (0, 1)]
    assert names[0] == names[1] == [f"step_{steps[0]:08d}.ckpt"]
    return steps[0]


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_at_the_same_step(write_config, tmp_path):
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    out = tmp_path / "out"
    status, stderr, _ = run_two_ranks_until_signalled(
        config, out, lambda job, pids: os.kill(pids[1], signal.SIGTERM))
    assert status == 143, stderr
    rank_0 = (out / "rank_0" / "train.log").read_text()
    assert "stopped by another rank's signal after step" in rank_0
    assert "stopped by SIGTERM after step" in (out / "rank_1" / "train.log").read_text()
    step = assert_both_ranks_stopped_at_one_step(out)

    resumed = subprocess.run(
        ["bash", "scripts/run_distribute_train.sh", "2", "rank_tables/rank_table_2p.json",
         config, "--output-dir", str(out), "--resume", "--set", f"train.steps={step + 2}"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
        text=True, timeout=300,
        env=dict(os.environ, GLOG_v="3", PYTHON=sys.executable, DEVICE_TARGET="CPU"))
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        assert f"(step {step})" in (out / f"rank_{rank}" / "train.log").read_text()


@pytest.mark.slow
def test_the_launcher_forwards_a_signal_to_every_rank(write_config, tmp_path):
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                           "train.save_steps": 100000})
    out = tmp_path / "out"
    status, stderr, stdout = run_two_ranks_until_signalled(
        config, out, lambda job, pids: job.send_signal(signal.SIGINT))
    assert status == 130, stderr
    assert "received SIGINT: asking every rank to save a checkpoint and stop" in stderr
    step = assert_both_ranks_stopped_at_one_step(out)
    # the ranks point at the launcher, which prints the one command that resumes the job
    assert "continue with: the launch command again with --resume" in (
        out / "rank_0" / "train.log").read_text()
    prefix = "the ranks saved a checkpoint and stopped; continue the job with: "
    (line,) = [line for line in stdout.splitlines() if line.startswith(prefix)]
    again = line[len(prefix):]   # the script's command line, from its folder, with --resume
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert shlex.split(again)[:3] == ["cd", root, "&&"] and again.endswith(" --resume")
    assert "scripts/run_distribute_train.sh 2 " in again
    resumed = subprocess.run(["bash", "-c", f"{again} --set train.steps={step + 1}"],
                             capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, GLOG_v="3"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {step + 1}/{step + 1}" in (out / "rank_1" / "train.log").read_text()


@pytest.fixture(scope="module")
def reference_losses(tiny_dataset, tmp_path_factory):
    """Per-step losses of an uninterrupted 10-step run that saves every step."""
    from conftest import write_tiny_config
    root = tmp_path_factory.mktemp("reference")
    config = write_tiny_config(root / "tiny.yaml", tiny_dataset, RANDOM_RUN)
    result = run_cli("train", config, "--output-dir", root / "run")
    assert result.returncode == 0, result.stderr
    return config, losses_of(root / "run")


RANDOM_RUN = {"train.steps": 10, "train.log_steps": 1, "train.save_steps": 1,
              "train.keep_checkpoints": 2}


def losses_of(run_dir):
    return [json.loads(line)["loss"] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT,),
                                     (signal.SIGTERM, signal.SIGTERM), (signal.SIGKILL,)],
                         ids=["SIGTERM", "SIGINT", "SIGTERM twice", "SIGKILL"])
@pytest.mark.slow
def test_a_signal_at_a_random_moment_loses_nothing(reference_losses, tmp_path, signals):
    """Every step saves a checkpoint, so the signal often lands in a save. One signal: the
    run saves and exits 128 + signal; two, or SIGKILL: it ends at once, maybe mid-save;
    after the last step: the final evaluation stops at once. Either way --resume continues
    to the same losses as the uninterrupted run."""
    import random
    config, reference = reference_losses
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    after_step, delay = rng.randint(1, 8), rng.uniform(0, 0.05)
    process = start_training(config, run_dir)
    try:
        for line in process.stdout:
            if line.startswith(f"step {after_step}/"):
                break
        time.sleep(delay)
        for sig in signals:
            process.send_signal(sig)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    expected = (-signal.SIGKILL,) if signals[0] == signal.SIGKILL else (
        128 + signals[0], 128 + signal.SIGTERM)
    assert process.returncode in (0, *expected), (seed, output)
    assert "Traceback" not in output, (seed, output)

    if process.returncode != 0:   # killed before the first save ended: nothing to resume
        saved = list((run_dir / "checkpoints").glob("step_*[0-9].ckpt"))
        result = run_cli("train", config, "--output-dir", run_dir,
                         *(["--resume"] if saved else []))
        assert result.returncode == 0, (seed, result.stdout + result.stderr)
    assert losses_of(run_dir) == reference, seed
    assert not list((run_dir / "checkpoints").glob("*.tmp.*")), seed


def test_leftovers_of_killed_runs_and_builds_are_cleaned_up(tiny_dataset, tmp_path):
    """A killed build leaves a staging folder and a lock file beside the dataset, a killed
    run its output directory's lock: the next run takes them over and removes them."""
    from conftest import write_tiny_config
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    staging = dataset / ".train.mindrecord.k1ll3d"
    staging.mkdir()
    (staging / "train.mindrecord").write_bytes(b"half a file")
    build_lock = tmp_path / "dataset.lock"
    build_lock.write_text("")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("12345\n")
    config = write_tiny_config(tmp_path / "tiny.yaml", dataset, {"train.steps": 2})

    result = run_cli("train", config, "--output-dir", run_dir)

    assert result.returncode == 0, result.stderr
    assert not staging.exists() and not build_lock.exists()
    assert not (run_dir / ".lock").exists()


def test_a_signal_after_the_last_checkpoint_stops_the_evaluation(write_config, tmp_path):
    """SIGTERM 0.3 s after the last checkpoint is saved lands in the final evaluation (its
    compile, here): the run stops there, 143, without a sample, and without raising inside
    MindSpore's compile (which reported a failed compile, wrote analyze_fail.ir, or lost
    the signal and evaluated on to exit 0)."""
    config = write_config({"train.steps": 4, "train.save_steps": 4, "train.log_steps": 1})
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env=dict(os.environ, GLOG_v="3", PYTHONPATH=os.getcwd()))
    printed = []
    try:
        for line in process.stdout:
            printed.append(line)
            if line.startswith("saved ") and "step_00000004" in line:
                time.sleep(0.3)
                process.send_signal(signal.SIGTERM)
                break
        output = "".join(printed) + process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, output
    assert "sample:" not in output and "analyze_fail" not in output, output
    assert "stopped by SIGTERM after step 4" in output
    assert not (tmp_path / "rank_0").exists()   # MindSpore's failed-compile report


def test_a_signal_during_the_last_step_stops_before_the_evaluation():
    """The last step's vote has already been taken when a signal arrives during it: the
    run must still stop (at once, its checkpoint saved) instead of evaluating."""
    from model_zoo.train.interrupt import StopRequests, TrainingInterrupted
    with StopRequests() as stop:
        stop._handle(signal.SIGTERM, None)
        with pytest.raises(TrainingInterrupted) as stopped:
            stop.steps_done(10, "step_00000010.ckpt")
    assert stopped.value.exit_status == 143 and stopped.value.step == 10


def test_a_built_dataset_whose_lock_cannot_be_taken_trains_and_an_unwritable_output_is_one_line(
        tiny_dataset, tmp_path):
    """A complete dataset on a mount where its build lock cannot be written (here: a folder
    where the lock file would go; root writes through read-only permissions) trains as it
    is; an --output-dir that cannot be created is one error line."""
    from conftest import write_tiny_config
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    (tmp_path / "dataset.lock").mkdir()   # open(..., "a+") of the lock fails
    config = write_tiny_config(tmp_path / "tiny.yaml", dataset, {"train.steps": 1})
    blocked = tmp_path / "a_file"
    blocked.write_text("keep me")

    refused = run_cli("train", config, "--output-dir", blocked / "run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: --output-dir {str(blocked / 'run')!r}: cannot write there")

    result = run_cli("train", config, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr


def test_a_signal_while_mindspore_is_imported_is_one_line(tmp_path):
    """SIGTERM 0.8 s after `model-zoo train` starts lands in MindSpore's import (about two
    seconds here): one error line and 143, not the half-imported modules' exit hooks
    failing after it (tracebacks, "Fatal Python error", SIGABRT)."""
    from conftest import write_tiny_config
    config = write_tiny_config(tmp_path / "tiny.yaml", tmp_path / "dataset")
    process = subprocess.Popen([sys.executable, "-m", "model_zoo", "train", config,
                                "--output-dir", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, GLOG_v="3"))
    time.sleep(0.8)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")


def test_a_stop_python_drops_is_raised_at_the_next_safe_point():
    """A signal whose Stopped is raised in a `__del__` or a weakref callback (the import
    machinery's module locks have one: a SIGTERM during MindSpore's import once landed
    there and the run trained to the end) is not printed as "Exception ignored" and lost:
    `raise_dropped_stop` raises it. Other exceptions there are still printed."""
    script = """
import os, signal, sys
from model_zoo.train.interrupt import Stopped, raise_dropped_stop, stop_at_once
stop_at_once()
class Signalling:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)   # its handler raises Stopped in __del__
class Failing:
    def __del__(self):
        raise ValueError("not a stop")
Failing()
raise_dropped_stop()   # nothing dropped yet
Signalling()
print("went on")
try:
    raise_dropped_stop()
except Stopped as stop:
    print("stopped by", stop.signum)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["went on", f"stopped by {int(signal.SIGTERM)}"]
    assert "ValueError: not a stop" in result.stderr and "Stopped" not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_dataset_build_is_one_line(tmp_path, signum):
    """Ctrl-C or SIGTERM before the training loop (here: while the dataset is built) ends
    with one `error:` line and 128 + the signal, not a traceback or silence."""
    from conftest import write_tiny_config
    config = write_tiny_config(tmp_path / "tiny.yaml", tmp_path / "dataset")
    process = subprocess.Popen([sys.executable, "-m", "model_zoo", "train", config,
                                "--output-dir", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:   # the build has begun
        if line.startswith("building the dataset"):
            break
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"error: stopped by {signal.Signals(signum).name}; nothing was saved beyond what was "
        f"already written (a dataset build resumes where it stopped)")


def test_a_disk_that_fills_during_the_dataset_build_is_named(small_disk, tmp_path):
    """MindRecord's writer reports a full disk as it reports rows of another schema; the
    build tells them apart by the space left and says which."""
    from conftest import write_tiny_config
    config = write_tiny_config(tmp_path / "tiny.yaml", small_disk / "dataset")
    result = run_cli("train", config, "--output-dir", tmp_path / "run")
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {small_disk / 'dataset'}") and (
        "no space left to write rows" in line and "the build resumes" in line), line
