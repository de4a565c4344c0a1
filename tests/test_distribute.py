"""The distributed launchers: real data-parallel CPU workers, a dying worker, the Ascend setup."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # the slow tier (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "run_distribute_train.sh")
TABLE_2P = os.path.join(ROOT, "rank_tables", "rank_table_2p.json")


def run_script(args, env=None, timeout=300):
    full_env = dict(os.environ, GLOG_v="3", PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def read_checkpoint(path):
    import mindspore as ms
    return {name: value.asnumpy() for name, value in ms.load_checkpoint(str(path)).items()}


def test_a_killed_worker_ends_the_job_naming_its_rank(tmp_path, write_config):
    config = write_config({"train.steps": 100000, "train.log_steps": 1,
                                     "train.save_steps": 100000})
    out = tmp_path / "out"
    env = dict(os.environ, GLOG_v="3", PYTHON=sys.executable, DEVICE_TARGET="CPU",
               FAILURE_GRACE_SECONDS="2")
    job = subprocess.Popen(["bash", SCRIPT, "2", TABLE_2P, config, "--output-dir", str(out)],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        pids = {}
        while len(pids) < 2:
            line = job.stdout.readline()
            assert line, "the launcher stopped before starting both ranks"
            match = re.match(r"rank (\d+): pid (\d+)", line)
            if match:
                pids[int(match.group(1))] = int(match.group(2))
        log = out / "rank_1" / "train.log"
        deadline = time.monotonic() + 120
        while "step 2/" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "rank 1 never started training"
            assert job.poll() is None, job.stderr.read()
            time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "rank 1 was killed by SIGKILL" in stderr
    assert "last lines of" in stderr and "rank_1" in stderr
    assert elapsed < 2 + 15, f"the job took {elapsed:.0f} s to stop"
    assert not _alive(pids[0]), "rank 0 was left running"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def dry_launch(args, env=None, script=SCRIPT):
    """DRY_LAUNCH=1 of a launch script: its CompletedProcess and its `rank R device D:`
    lines as {rank: (device, {added variable: value}, command words)}."""
    full_env = {k: v for k, v in os.environ.items()   # the scripts' defaults, not a test's
                if k not in ("DEVICE_TARGET", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")}
    full_env.update(GLOG_v="3", PYTHON=sys.executable, DRY_LAUNCH="1", **(env or {}))
    result = subprocess.run(["bash", script, *args], cwd=ROOT, env=full_env,
                            capture_output=True, text=True, timeout=120)
    ranks = {}
    for line in result.stdout.splitlines():
        match = re.match(r"rank (\d+) device (\S+): (.*)$", line)
        if match:
            words = shlex.split(match.group(3))
            split = next(i for i, word in enumerate(words) if "=" not in word)
            ranks[int(match.group(1))] = (match.group(2), dict(w.split("=", 1)
                                                               for w in words[:split]),
                                          words[split:])
    return result, ranks


def plan_passes(command, device_num):
    """The rank's command with `train` replaced by `plan --device-num N`, run: its status."""
    at = command.index("train")
    planned = command[:at] + ["plan", "--device-num", str(device_num)] + command[at + 1:]
    return subprocess.run(planned, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, GLOG_v="3"))


@pytest.mark.parametrize("table, device_num, server_ip, ranks", [
    ("rank_table_8p.json", 8, None, range(8)),
    ("rank_table_2x8p.json", 16, "10.155.111.141", range(8, 16))])
def test_dry_launch_prints_each_rank_of_this_server_and_its_layout_passes_the_plan(
        tmp_path, table, device_num, server_ip, ranks):
    """The headline command with no config on an 8-device server (and on the second server
    of two): the default one-device config is laid out for DEVICE_NUM, each line holds the
    rank's whole added environment and command, the command passes `model-zoo plan` for
    that many devices, and nothing starts."""
    out = os.path.join(ROOT, "outputs", "tiny")   # the default config's default output
    before = sorted(os.listdir(out)) if os.path.isdir(out) else None
    env = {"DEVICE_TARGET": "Ascend", **({"SERVER_IP": server_ip} if server_ip else {})}
    result, lines = dry_launch([str(device_num), os.path.join(ROOT, "rank_tables", table)], env)
    assert result.returncode == 0, result.stderr
    assert sorted(lines) == list(ranks)
    assert len(result.stdout.splitlines()) == len(ranks)
    commands = set()
    for rank, (device, added, command) in lines.items():
        assert device == str(rank % 8)
        assert (added["RANK_ID"], added["DEVICE_ID"]) == (str(rank), device)
        assert added["RANK_SIZE"] == str(device_num) and added["DEVICE_TARGET"] == "Ascend"
        assert added["RANK_TABLE_FILE"] == os.path.join(ROOT, "rank_tables", table)
        assert added["HCCL_CONNECT_TIMEOUT"] == "1200" and added["HCCL_EXEC_TIMEOUT"] == "1800"
        assert added["ASCEND_WORK_PATH"] == os.path.join(out, f"rank_{rank}", "ascend_work")
        assert f"parallel.data_parallel={device_num}" in command
        commands.add(tuple(command))
    assert len(commands) == 1
    planned = plan_passes(list(commands.pop()), device_num)
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr
    assert (sorted(os.listdir(out)) if os.path.isdir(out) else None) == before, \
        "a dry launch wrote to its output folder"


def test_a_layout_that_does_not_fit_the_devices_stops_the_launch_before_any_rank(tmp_path):
    """One `error:` line and exit 2, before anything starts: a model-parallel size that does
    not divide DEVICE_NUM, and a layout the plan refuses (a batch that 8 replicas cannot
    share); the same for a real launch as for a dry one."""
    out = tmp_path / "out"
    table = os.path.join(ROOT, "rank_tables", "rank_table_8p.json")
    for wrong, message in ((["--set", "parallel.model_parallel=3"], "DEVICE_NUM 8 is not a "
                            "multiple of model_parallel x pipeline_stage = 3"),
                           (["--set", "train.global_batch_size=12"], "does not pass the plan")):
        result, lines = dry_launch(["8", table, "--output-dir", str(out), *wrong],
                                   {"DEVICE_TARGET": "Ascend"})
        assert result.returncode == 2 and not lines, result.stdout
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], result.stderr
    assert not out.exists()


def test_a_rank_table_without_an_ascend_runtime_is_refused_not_run_on_cpu(tmp_path):
    """No silent CPU fallback: a rank table (or DEVICE_TARGET=Ascend) where MindSpore's Ascend
    backend does not load ends in one `error:` line naming what is missing, exit 2, nothing
    started; without a rank table the CPU workers' first line says what runs."""
    out = tmp_path / "out"
    table = os.path.join(ROOT, "rank_tables", "rank_table_2p.json")
    for env in ({}, {"DEVICE_TARGET": "Ascend"}):
        result = subprocess.run(
            ["bash", SCRIPT, "2", table, "--output-dir", str(out)], cwd=ROOT,
            env={**{k: v for k, v in os.environ.items() if k != "DEVICE_TARGET"},
                 "PYTHON": sys.executable, **env}, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith("error: rank table ") and "no usable Ascend runtime" \
            in result.stderr and "set_env.sh" in result.stderr, result.stderr
        assert result.stdout == "" and not out.exists()
    result, lines = dry_launch(["2", "--output-dir", str(out)])
    assert result.returncode == 0 and sorted(lines) == [0, 1], result.stderr
    assert result.stderr.splitlines()[0].startswith("no Ascend: starting 2 data-parallel CPU "
                                                    "workers")
    assert all(device == "cpu" and added["MS_ROLE"] == "MS_WORKER"
               for device, added, _ in lines.values())


MSRUN_SCRIPT = os.path.join(ROOT, "scripts", "run_distribute_train_msrun.sh")


def test_msrun_on_several_servers_wants_each_server_named_and_ascend_unless_cpu(tmp_path):
    """msrun: a job of more workers than a server holds (or fewer local workers) without
    NODE_RANK, LOCAL_WORKER_NUM and MASTER_ADDR is one `error:` line naming the missing ones,
    exit 2 (else the other servers wait CLUSTER_TIME_OUT for it); so is a server without
    Ascend unless DEVICE_TARGET=CPU. On Ascend each worker gets the folder under which it
    makes its own CANN working folder (`use_rank_workdirs`)."""
    out = tmp_path / "out"
    for env, message in (
            ({}, "set NODE_RANK, LOCAL_WORKER_NUM, MASTER_ADDR on each"),
            ({"LOCAL_WORKER_NUM": "8", "NODE_RANK": "1"}, "set MASTER_ADDR on each"),
            ({"LOCAL_WORKER_NUM": "6", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
             "WORKER_NUM 16 is not a multiple of LOCAL_WORKER_NUM 6"),
            ({"LOCAL_WORKER_NUM": "8", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"},
             "NODE_RANK 2 is not below the job's 2 servers of 8 workers")):
        result, lines = dry_launch(["16", "--output-dir", str(out)], env, MSRUN_SCRIPT)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and message in errors[0], \
            (env, result.stderr)
        assert not lines
    result = subprocess.run(["bash", MSRUN_SCRIPT, "2", "--output-dir", str(out)], cwd=ROOT,
                            env={**{k: v for k, v in os.environ.items()
                                    if k != "DEVICE_TARGET"}, "PYTHON": sys.executable},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(
        "error: msrun on Ascend, but no usable Ascend runtime here") \
        and "set DEVICE_TARGET=CPU" in result.stderr, result.stderr
    assert not out.exists()
    result, lines = dry_launch(["16", "--output-dir", str(out)], {
        "DEVICE_TARGET": "Ascend", "NODE_RANK": "1", "LOCAL_WORKER_NUM": "8",
        "MASTER_ADDR": "10.0.0.1"}, MSRUN_SCRIPT)
    assert result.returncode == 0 and sorted(lines) == list(range(8, 16)), result.stderr
    assert "MODEL_ZOO_RANK_WORKDIRS=" + str(out) in result.stdout.splitlines()[-1]
    assert not out.exists()


def test_an_msrun_worker_makes_its_own_working_folders(tmp_path):
    from model_zoo.launch.local import use_rank_workdirs
    environ = {"MODEL_ZOO_RANK_WORKDIRS": str(tmp_path), "RANK_ID": "9", "DEVICE_ID": "1"}
    use_rank_workdirs(environ)
    assert environ["ASCEND_WORK_PATH"] == str(tmp_path / "rank_9" / "ascend_work")
    assert environ["MS_COMPILER_CACHE_PATH"] == str(tmp_path / "rank_9" / "compile_cache")
    assert (tmp_path / "rank_9" / "ascend_work").is_dir()
    environ = {"ASCEND_WORK_PATH": "/mine", "DEVICE_ID": "1"}   # no folder asked: untouched
    use_rank_workdirs(environ)
    assert environ == {"ASCEND_WORK_PATH": "/mine", "DEVICE_ID": "1"}


def test_a_dead_ascend_rank_ends_the_job_within_the_grace_period(tmp_path):
    """`--devices` (the Ascend launch of run_distribute_train.sh), with a stand-in rank
    command: rank 1 dies after a second while rank 0 would wait for it for minutes (as in
    an HCCL collective, where a SIGTERM only asks for a stop after a step that never
    ends); the launcher stops rank 0 within --grace, not seconds after it, and names
    rank 1."""
    stand_in = ("import os, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "if os.environ['RANK_ID'] == '1':\n"
                "    time.sleep(1); sys.exit(5)\n"
                "time.sleep(300)\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--devices", "4:0,5:1", "--output-dir",
         str(tmp_path), "--grace", "2", "--", sys.executable, "-c", stand_in],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 1 + 2 + 3   # rank 1's second, the grace, start-up
    assert "rank 1 (device 5) exited with code 5; stopping the job within 2 s" in result.stderr
    assert "rank 0 on device 4: pid" in result.stdout
    assert (tmp_path / "rank_0" / "train.log").exists()


def test_rank_table_mismatch_stops_before_anything_starts(tmp_path, write_config):
    config = write_config({})
    out = tmp_path / "out"
    result = run_script(["4", TABLE_2P, config, "--output-dir", str(out)],
                        env={"DEVICE_TARGET": "CPU"})
    assert result.returncode == 2
    assert "error:" in result.stderr and "4" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("args", [[], ["--help"]])
def test_no_arguments_or_help_prints_the_usage(args):
    result = run_script(args)
    assert result.returncode == 1
    assert ("Usage: bash scripts/run_distribute_train.sh DEVICE_NUM [RANK_TABLE_FILE] [CONFIG]"
            in result.stdout)
    assert "default: model_zoo/models/gpt2/configs/tiny.yaml" in result.stdout


def test_the_script_reads_config_paths_as_train_does_and_wants_a_rank_table_on_ascend():
    """The short form model_zoo/<model>/configs/X.yaml is the shipped config (as for `model-zoo
    train`); a missing config is named; only Ascend needs a rank table."""
    result = run_script(["2", "model_zoo/gpt2/configs/nothere.yaml"])
    assert result.returncode == 2
    assert "error: config file model_zoo/gpt2/configs/nothere.yaml does not exist" in result.stderr
    result = run_script(["2", "model_zoo/gpt2/configs/tiny.yaml"], env={"DEVICE_TARGET": "Ascend"})
    assert result.returncode == 2
    assert "error: Ascend needs the HCCL rank table" in result.stderr
    result = run_script(["2", "model_zoo"])   # a directory: neither a rank table nor a config
    assert result.returncode == 2
    assert "error: model_zoo is a directory: give a rank table file (JSON) or a config" \
        in result.stderr


def test_msrun_launcher_stops_two_cpu_workers_to_resume(tmp_path, write_config):
    """The msrun script on two CPU workers (a run to its end: the first-run check's jobs,
    below): a long run stopped by SIGTERM to the script, which reaches both workers (msrun
    would kill them): each saves the same step and waits for the other before leaving, and
    the script prints the command that continues the job and exits 143."""
    script = os.path.join(ROOT, "scripts", "run_distribute_train_msrun.sh")
    env = dict(os.environ, GLOG_v="3", PYTHON=sys.executable, DEVICE_TARGET="CPU",
               MASTER_PORT=str(20000 + os.getpid() % 20000))
    long = write_config({"train.steps": 100000, "train.save_steps": 100000,
                         "train.log_steps": 1}, name="long.yaml")
    out = tmp_path / "long"
    logs = [out / "msrun_logs" / f"worker_{rank}.log" for rank in (0, 1)]
    job = subprocess.Popen(["bash", script, "2", long, "--output-dir", str(out)], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = stop_when_logged(job, logs[1], "step 2/")
    assert job.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-2000:]
    assert re.search(r"continue the job with: cd \S+ && .*run_distribute_train_msrun\.sh 2 "
                     r".* --resume$", stdout, re.M), stdout[-2000:]
    saved = stopped_steps(logs)
    assert saved[0] == saved[1]
    for rank in (0, 1):
        assert (out / f"rank_{rank}" / "checkpoints" / f"step_{saved[0]:08d}.ckpt").exists()


def test_a_rank_refusing_its_input_makes_the_job_exit_2(tmp_path, write_config):
    config = write_config({})
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--workers", "2", "--output-dir", str(out),
         "--", sys.executable, "-m", "model_zoo", "train", config, "--set", "train.lr=.inf"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, GLOG_v="3"))
    assert result.returncode == 2, result.stderr
    assert "error: train.lr must be a finite number, got inf" in result.stderr


def test_a_data_parallel_run_resumes_on_more_ranks(tmp_path, write_config):
    """Two CPU ranks started by the script (no rank table on CPU) read different shards and
    end with the same state and the same logged losses (the global batch's: StopVote);
    resumed on 4 ranks, ranks 2 and 3 start from rank 0's checkpoint, the step count
    continues, and all four end with the same state."""
    config = write_config({"train.steps": 4, "train.save_steps": 2,
                           "train.global_batch_size": 8})
    out = tmp_path / "out"
    first = run_script(["2", config, "--output-dir", str(out)], env={"DEVICE_TARGET": "CPU"})
    assert first.returncode == 0, first.stdout + first.stderr[-2000:]
    assert "rank 0:" in first.stdout and "rank 1:" in first.stdout
    infos = [json.loads((out / f"rank_{r}" / "run_info.json").read_text()) for r in (0, 1)]
    assert [(i["rank"], i["shard_id"]) for i in infos] == [(0, 0), (1, 1)]
    assert all(i["num_shards"] == 2 and i["batch_size_per_rank"] == 4 for i in infos)
    assert infos[0]["first_batch_sha1"] != infos[1]["first_batch_sha1"], \
        "both ranks read the same samples"
    saved = [read_checkpoint(out / f"rank_{r}" / "checkpoints" / "step_00000004.ckpt")
             for r in (0, 1)]
    for name in saved[0]:
        np.testing.assert_array_equal(saved[0][name], saved[1][name], err_msg=name)
    losses = [[entry["loss"] for entry in map(json.loads, (
        out / f"rank_{r}" / "metrics.jsonl").read_text().splitlines()) if "loss" in entry]
        for r in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 4

    resumed = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--workers", "4", "--output-dir", str(out),
         "--", sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(out),
         "--resume", "--set", "parallel.data_parallel=4", "--set", "train.steps=6"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (2, 3):
        log = (out / f"rank_{rank}" / "train.log").read_text()
        assert "resumes from rank 0's" in log and "step 5/6" in log
        info = json.loads((out / f"rank_{rank}" / "run_info.json").read_text())
        assert (info["num_shards"], info["batch_size_per_rank"]) == (4, 2)
    final = [read_checkpoint(out / f"rank_{r}" / "checkpoints" / "step_00000006.ckpt")
             for r in range(4)]
    for name in final[0]:
        for other in final[1:]:
            np.testing.assert_array_equal(final[0][name], other[name], err_msg=name)
    assert int(final[0]["train_step"]) == 6


def test_servers_with_their_own_disks_resume_from_the_step_they_all_saved(tmp_path,
                                                                          write_config):
    """Two "servers": each rank writes under its own output root and sees no other rank's
    folder. A kill between the ranks' saves leaves rank 0 a step ahead; on --resume the
    ranks tell each other their steps (one all-gather) and both resume from step 2,
    repeating the losses the first run logged."""
    import shlex
    config = write_config({"train.steps": 4, "train.save_steps": 2, "train.log_steps": 1,
                           "train.global_batch_size": 8, "parallel.data_parallel": 2})
    root = tmp_path / "server"   # rank r's outputs: server_r/rank_r

    def launch(*extra):
        train = shlex.join([sys.executable, "-m", "model_zoo", "train", config, *extra])
        return subprocess.run(
            [sys.executable, "-m", "model_zoo.launch", "--workers", "2", "--output-dir",
             str(tmp_path / "logs"), "--", "sh", "-c",
             f'exec {train} --output-dir "{root}_$RANK_ID"'],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))

    def losses(rank):
        path = tmp_path / f"server_{rank}" / f"rank_{rank}" / "metrics.jsonl"
        return {entry["step"]: entry["loss"] for entry in map(json.loads,
                                                              path.read_text().splitlines())
                if "loss" in entry}

    first = launch()
    assert first.returncode == 0, first.stderr[-2000:]
    assert not (tmp_path / "server_0" / "rank_1").exists()
    logged = losses(0)
    (tmp_path / "server_1" / "rank_1" / "checkpoints" / "step_00000004.ckpt").unlink()
    resumed = launch("--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (tmp_path / "logs" / "rank_0" / "train.log").read_text()
    assert "resuming from step 2, the newest step every rank saved" in log
    assert losses(0) == logged and sorted(logged) == [1, 2, 3, 4]


def test_the_sink_path_trains_as_the_host_feed_and_resumes(tmp_path, write_config):
    """train.dataset_sink=true: the steps run through MindSpore's Model.train (the path that
    sinks the data on Ascend; on CPU MindSpore feeds it from the host) with its callback
    driving the loop, on two data-parallel ranks: the same metrics and checkpoints as the
    host feed, and a resume from step 4 ends where the uninterrupted run did."""
    config = write_config({"train.steps": 6, "train.save_steps": 2, "train.log_steps": 2,
                           "train.global_batch_size": 8, "parallel.data_parallel": 2,
                           "train.keep_checkpoints": 5})

    def launch(out, *extra):
        result = subprocess.run(
            [sys.executable, "-m", "model_zoo.launch", "--workers", "2", "--output-dir",
             str(out), "--", sys.executable, "-m", "model_zoo", "train", config,
             "--output-dir", str(out), *extra],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
        assert result.returncode == 0, result.stderr[-3000:]

    def logged(out, rank=0):
        timing = {"samples_per_s", "tokens_per_s", "step_ms", "outside_step_ms"}
        return [{key: value for key, value in json.loads(line).items() if key not in timing}
                for line in (out / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()]

    launch(tmp_path / "fed")
    launch(tmp_path / "sunk", "--set", "train.dataset_sink=true")
    assert "dataset sink mode: 2 steps a call" in \
        (tmp_path / "sunk" / "rank_0" / "train.log").read_text()
    assert logged(tmp_path / "sunk") == logged(tmp_path / "fed") == \
        logged(tmp_path / "sunk", rank=1)
    assert [entry["step"] for entry in logged(tmp_path / "sunk") if "loss" in entry] == [2, 4, 6]
    for step in (2, 4, 6):
        name = f"step_{step:08d}.ckpt"
        fed, sunk = (read_checkpoint(tmp_path / run / "rank_1" / "checkpoints" / name)
                     for run in ("fed", "sunk"))
        assert fed.keys() == sunk.keys()
        for key in fed:
            np.testing.assert_array_equal(fed[key], sunk[key], err_msg=f"{name} {key}")
    ended = read_checkpoint(tmp_path / "sunk" / "rank_0" / "checkpoints" / "step_00000006.ckpt")
    for rank in (0, 1):
        (tmp_path / "sunk" / f"rank_{rank}" / "checkpoints" / "step_00000006.ckpt").unlink()
    launch(tmp_path / "sunk", "--resume", "--set", "train.dataset_sink=true")
    resumed = read_checkpoint(tmp_path / "sunk" / "rank_0" / "checkpoints" /
                              "step_00000006.ckpt")
    for key in ended:
        np.testing.assert_array_equal(resumed[key], ended[key], err_msg=key)


@pytest.mark.parametrize("sink", [False, True])
def test_bad_steps_are_skipped_on_every_rank_then_the_run_stops_to_resume(tmp_path,
                                                                          write_config, sink):
    """A diverging run (train.lr=1e30): from step 2 the loss is not finite; both ranks skip
    steps 2-4 together (the step's losses and decisions are all-reduced), then stop after
    train.max_bad_steps=2 in a row with the step 4 checkpoint (every value finite: the bad
    steps changed nothing), an `error:` line pointing to the launcher's --resume command and
    exit status 3, which the launcher passes on with that command. The same through the sink
    path's Model.train, which the loop stops the way MindSpore documents (`request_stop`)."""
    config = write_config({"train.steps": 50, "train.save_steps": 50, "train.log_steps": 1,
                           "train.global_batch_size": 8, "parallel.data_parallel": 2,
                           "train.lr": 1e30, "train.max_bad_steps": 2,
                           "train.dataset_sink": sink})
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--workers", "2", "--output-dir", str(out),
         "--", sys.executable, "-m", "model_zoo", "train", config, "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert result.returncode == 3, result.stderr[-2000:]
    assert "the ranks stopped after too many bad steps" in result.stderr
    assert re.search(r"continue the job with: python3 -m model_zoo.launch --workers 2 .* "
                     r"--resume$", result.stdout.strip(), re.M)
    for rank in (0, 1):
        log = (out / f"rank_{rank}" / "train.log").read_text()
        for step in (2, 3, 4):
            assert f"step {step} skipped: the loss is" in log
        assert "step 5" not in log
        assert re.search(r"error: more than 2 steps in a row were skipped .*; stopped after "
                         r"step 4, saved \S+step_00000004.ckpt; continue with: the launch "
                         r"command again with --resume \(the launcher prints it\)", log)
        saved = read_checkpoint(out / f"rank_{rank}" / "checkpoints" / "step_00000004.ckpt")
        assert int(saved["train_step"]) == 4
        assert all(np.all(np.isfinite(value)) for value in saved.values())


def stop_when_logged(job, log, text, sig=signal.SIGTERM, group=False, timeout=180):
    """Send `sig` to `job` (its process group with `group`) once `log` holds `text`; then
    its (stdout, stderr)."""
    try:
        deadline = time.monotonic() + timeout
        while text not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and job.poll() is None, job.stderr.read()
            time.sleep(0.2)
        if group:
            os.killpg(job.pid, sig)
        else:
            job.send_signal(sig)
        return job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            job.kill()


def stopped_steps(logs):
    """The step each log's last `stopped by SIGNAL after step N` names."""
    return [int(re.findall(r"stopped by \S+ after step (\d+)", log.read_text())[-1])
            for log in logs]


def test_the_printed_resume_command_continues_the_job_from_a_fresh_shell(tmp_path,
                                                                           write_config):
    """SIGTERM to a two-rank CPU job started by the script: every rank saves and stops, and
    the launcher prints the command that continues the job (the script's own command line
    with --resume, its folder and launch variables included). Run by a shell with an empty
    environment, it resumes both ranks at the next step (stopped again by a signal: the run
    is long, so that no signal comes too late)."""
    config = write_config({"train.steps": 100000, "train.save_steps": 100000,
                           "train.log_steps": 1})
    out = tmp_path / "out"
    logs = [out / f"rank_{rank}" / "train.log" for rank in (0, 1)]
    env = dict(os.environ, GLOG_v="3", PYTHON=sys.executable, DEVICE_TARGET="CPU")
    job = subprocess.Popen(["bash", SCRIPT, "2", config, "--output-dir", str(out)], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = stop_when_logged(job, logs[1], "step 2/")   # the script execs the launcher
    assert job.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    command = re.search(r"continue the job with: (.*)$", stdout, re.M).group(1)
    assert command.endswith(" --resume") and "run_distribute_train.sh 2" in command
    saved = stopped_steps(logs)
    assert saved[0] == saved[1]
    resumed = subprocess.Popen(["env", "-i", f"PATH={os.environ['PATH']}", "bash", "-c", command],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    stdout, stderr = stop_when_logged(resumed, logs[1], f"step {saved[0] + 1}/", group=True)
    assert "continue the job with: " + command in stdout, stdout + stderr[-2000:]
    again = stopped_steps(logs)
    assert again[0] == again[1] > saved[0]
    for log in logs:
        resumed_log = log.read_text().split("=== rank")[-1]
        assert f"step {saved[0] + 1}/" in resumed_log and "step 1/" not in resumed_log


def test_ranks_whose_dataset_copies_differ_stop_before_the_first_step(tmp_path, tiny_dataset):
    """Two CPU ranks, each reading its own copy of the dataset (as two servers do), the
    second built from other text: both stop with one `error:` line naming rank 1's server
    and the tokenizer file that differs, before step 1. (Equal copies pass: every other
    launched run here has them.)"""
    from model_zoo.data import python_docstrings_corpus
    from model_zoo.data.streaming import BuildOptions
    from model_zoo.causal_lm.data import build_dataset
    from conftest import TINY_DOCUMENTS, TINY_SEQ, TINY_VOCAB, write_jsonl, write_tiny_config

    shutil.copytree(tiny_dataset, tmp_path / "data_0")
    corpus = write_jsonl(tmp_path / "other.jsonl",
                         python_docstrings_corpus()[TINY_DOCUMENTS:2 * TINY_DOCUMENTS])
    build_dataset(tmp_path / "data_1", [corpus], vocab_size=TINY_VOCAB, seq_length=TINY_SEQ,
                  options=BuildOptions(heldout_fraction=0.1, seed=1),
                  source="python docstrings (test slice)", record_sources=False)
    config = write_tiny_config(tmp_path / "tiny.yaml", tiny_dataset,
                               {"parallel.data_parallel": 2, "train.steps": 2})

    train = (f"exec {shlex.quote(sys.executable)} -m model_zoo train {config} --output-dir "
             f"{tmp_path / 'differ'} --set data.dataset_dir={tmp_path}/data_$RANK_ID")
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--workers", "2", "--output-dir",
         str(tmp_path / "differ"), "--", "sh", "-c", train],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert result.returncode == 2, result.stderr[-2000:]
    host = socket.gethostname()
    for rank in (0, 1):
        log = (tmp_path / "differ" / f"rank_{rank}" / "train.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "step 1/" not in log, log[-2000:]
        assert (f"rank 1 (server {host}) has another tokenizer.model than rank 0 (server "
                f"{host})") in errors[0] and f"data_{rank}" in errors[0]


def test_the_launch_plan_holds_the_layout_against_this_servers_chip(monkeypatch, capsys):
    """On Ascend the launch plans against the chip the server has (its name read from CANN):
    a layout of 56 GiB a device passes on a 64 GB 910B and is one error naming the chip on a
    32 GB 910B4; CANN's names map to the plan's profiles."""
    from model_zoo.errors import UserInputError
    from model_zoo.parallel import context
    from model_zoo.plan.launch import launch_overrides
    assert context.chip_of("Ascend910B4").memory == 32 * 2 ** 30
    assert context.chip_of("Ascend910B2").profile == "ascend910b"
    assert context.chip_of("Ascend910ProB").profile == "ascend910"
    assert context.chip_of("Ascend310P3") is None
    config = os.path.join(ROOT, "model_zoo", "models", "mixtral", "configs", "plan",
                          "mixtral-8x7b-d16m1p4e8-910b.yaml")
    monkeypatch.setattr(context, "server_chip", lambda: context.chip_of("Ascend910B1"))
    assert launch_overrides(config, [], 64, "Ascend") == []
    assert "on 64 devices of this server's Ascend910B1 (64 GB)" in capsys.readouterr().err
    monkeypatch.setattr(context, "server_chip", lambda: context.chip_of("Ascend910B4"))
    with pytest.raises(UserInputError, match=r"on 64 devices of this server's Ascend910B4 "
                                             r"\(32 GB\) does not pass the plan: needs 55.97 "
                                             r"GiB per device, a run may fill 26.00"):
        launch_overrides(config, [], 64, "Ascend")


def test_the_first_run_check_passes_on_cpu(tmp_path):
    """scripts/ascend_first_run.sh --cpu: the three drills of a server's first run (equal
    gradient norms with accumulation 4 and 1, a 2-stage pipeline, an fp16 overflow skipped
    with the scale halved on both ranks) each PASS, as they run on this machine."""
    from model_zoo.train.metrics import read_metrics
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ascend_first_run.sh"),
                             "--cpu", "--output-dir", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=1200,
                            env=dict(os.environ, GLOG_v="3", PYTHON=sys.executable))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("  PASS (") == 3 and "3 of 3 drills passed" in result.stdout
    for rank in (0, 1):   # msrun's CPU workers, each its slice of the batch, to the end
        job = tmp_path / "overflow"
        assert (job / "msrun_logs" / f"worker_{rank}.log").exists()
        info = json.loads((job / f"rank_{rank}" / "run_info.json").read_text())
        assert (info["device_num"], info["shard_id"]) == (2, rank)
        first, second = read_metrics(str(job / f"rank_{rank}" / "metrics.jsonl"))[:2]
        assert not first["finite"] and second["loss_scale"] == first["loss_scale"] / 2
