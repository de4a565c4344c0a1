"""Start a multi-process job on one machine, and watch it.

    python3 -m model_zoo.launch --workers 2 --output-dir OUT -- \\
        python3 -m model_zoo train CONFIG --output-dir OUT
    python3 -m model_zoo.launch --devices 0:0,1:1 --output-dir OUT -- \\
        python3 -m model_zoo train CONFIG --output-dir OUT

`--devices DEVICE:RANK,...` (Ascend, an HCCL rank table in RANK_TABLE_FILE): one process
per listed device of this server, told its DEVICE_ID and RANK_ID, without a scheduler
(`scripts/run_distribute_train.sh` starts it on each server). The rest is the same.

One scheduler and `--workers` workers run the same command on loopback, told their roles
by MindSpore's dynamic-cluster variables (MS_ROLE, MS_SCHED_HOST, MS_SCHED_PORT,
MS_WORKER_NUM, MS_NODE_ID). Worker i logs to OUT/rank_<i>/train.log (appended, so an
earlier run's log is kept) and the scheduler to OUT/scheduler.log.

The launcher exits 0 when every worker succeeds. When one fails, the others get
`--grace` seconds to finish, then are stopped; the launcher names the failed rank, prints
the end of its log and exits 2 if the rank refused its input (exit 2, one `error:` line),
else 1. A worker that dies therefore ends the job within the grace period plus a few
seconds, instead of leaving the others waiting in a collective forever.

SIGINT or SIGTERM to the launcher is forwarded to every worker: each finishes its step,
saves a checkpoint and exits 128 + the signal (the ranks agree on the step inside the
train step, so a signal that reaches one rank only stops them all the same way). The
launcher waits up to `--stop-timeout` seconds for them and exits with that status; a
second signal is forwarded too, and the workers then exit at once.
"""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

POLL_SECONDS = 0.5
BAD_INPUT_STATUS = 2
BAD_STEPS_STATUS = 3   # a rank that saved and stopped after too many bad steps (interrupt.py)
# threads each process's CPU kernels may use (nn/cpu_kernels.cc `usable_cores`)
CPU_THREADS = "MODEL_ZOO_CPU_THREADS"
# a rank that saved and stopped: the others get --stop-timeout to do the same
STOPPED_STATUSES = (128 + signal.SIGINT, 128 + signal.SIGTERM, BAD_STEPS_STATUS)
STOP_SECONDS = 5.0
LOG_TAIL_LINES = 20


@dataclass
class Process:
    """A started process of the job: its role, rank (None for the scheduler) and log."""

    name: str
    rank: int
    popen: subprocess.Popen
    log_path: str


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_log_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"rank_{rank}", "train.log")


def start(command, env, log_path, name, rank=None) -> Process:
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"=== {name} started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                  f"{' '.join(command)}\n")
        log.flush()
        popen = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return Process(name, rank, popen, log_path)


def cpu_threads_share(workers: int) -> int:
    """Each of `workers` ranks' share of this machine's cores (its affinity mask), for the
    CPU kernels' threads; the msrun script asks it too."""
    return max(1, len(os.sched_getaffinity(0)) // workers)


def cluster_env(role: str, port: int, workers: int, cluster_timeout: int, rank=None) -> dict:
    """The environment of one process of a CPU job of `workers` ranks on this machine:
    MindSpore's dynamic-cluster variables, and each rank's share of the cores for the CPU
    kernels' threads (`CPU_THREADS`, unless already set)."""
    env = dict(os.environ)
    env.update({"MS_ROLE": role, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port),
                "MS_WORKER_NUM": str(workers), "MS_TOPO_TIMEOUT": str(cluster_timeout),
                "DEVICE_TARGET": env.get("DEVICE_TARGET", "CPU")})
    env.setdefault(CPU_THREADS, str(cpu_threads_share(workers)))
    if rank is not None:
        env.update({"MS_NODE_ID": str(rank), "RANK_ID": str(rank)})
    return env


def stop(processes):
    """SIGTERM the process groups still running, then SIGKILL what is left."""
    running = [p for p in processes if p.popen.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in running):
        time.sleep(0.1)
    for process in running:
        if process.popen.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.popen.wait()


def _signal_group(process, sig):
    try:
        os.killpg(process.popen.pid, sig)
    except ProcessLookupError:
        pass


def _wait(process, seconds):
    try:
        process.popen.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return "(no log)\n"


class ForwardedSignals:
    """While active, SIGINT and SIGTERM to the launcher go to every worker's process group;
    `signum` is the first one received."""

    def __init__(self, workers):
        self.workers, self.signum, self._previous = workers, None, {}

    def _forward(self, signum, frame):
        first = self.signum is None
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        print(f"received {name}: " + ("asking every rank to save a checkpoint and stop (send "
                                      "it again to stop them at once)" if first else
                                      "stopping every rank at once"),
              file=sys.stderr, flush=True)
        for worker in self.workers:
            _signal_group(worker, signum)

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def watch(workers, scheduler, grace: float, timeout: float, stop_timeout: float = 600.0,
          signals=None) -> int:
    """Wait for the job (`scheduler`: None without one); returns the exit status of the
    whole job. A rank that stops on a signal (or a signal to the launcher, `signals`) gives
    the others `stop_timeout` seconds to save, and so does a rank that ends successfully
    (the others should follow soon; ranks that wait for one that has left would wait
    forever); a rank that fails gives them `grace`. After a signal to the launcher every
    exit counts as stopping."""
    started = time.monotonic()
    failed = None
    stopping_since = None
    helpers = [scheduler] if scheduler is not None else []
    while True:
        codes = [w.popen.poll() for w in workers]
        signalled = signals is not None and signals.signum
        if stopping_since is None and (signalled or any(
                code in (0, *STOPPED_STATUSES) for code in codes)):
            stopping_since = time.monotonic()
            if signalled or any(code in STOPPED_STATUSES for code in codes):
                print(f"the ranks are saving a checkpoint and stopping (waiting up to "
                      f"{stop_timeout:g} s)", file=sys.stderr, flush=True)
        if failed is None and not signalled:
            for worker in workers + helpers:
                code = worker.popen.poll()
                if code not in (None, 0, *STOPPED_STATUSES):
                    failed, failed_at = worker, time.monotonic()
                    print(f"{worker.name} {describe_exit(code)}; stopping the job "
                          f"within {grace:g} s", file=sys.stderr, flush=True)
                    break
        if all(code is not None for code in codes):
            break
        if failed is not None and time.monotonic() - failed_at >= grace:
            break
        if stopping_since is not None and time.monotonic() - stopping_since >= stop_timeout:
            print(f"the ranks did not end within --stop-timeout {stop_timeout:g} s of the "
                  f"first; stopping them", file=sys.stderr, flush=True)
            break
        if timeout and time.monotonic() - started >= timeout:
            print(f"the job ran longer than --timeout {timeout:g} s; stopping it",
                  file=sys.stderr, flush=True)
            stop(workers + helpers)
            return 1
        time.sleep(POLL_SECONDS)
    if failed is None and scheduler is not None:
        _wait(scheduler, STOP_SECONDS)
    stop(workers + helpers)
    return job_status(workers, failed, signals)


def job_status(workers, failed, signals) -> int:
    """0 if every rank succeeded; 128 + the signal if the ranks stopped on one; 3 if they
    stopped after too many bad steps; else the status of a failed rank (2 for refused
    input, 1 otherwise). A failure or a bad-steps stop prints the end of a rank's log."""
    if failed is None and signals is not None and signals.signum:
        return 128 + signals.signum
    if failed is None:
        failed = next((w for w in workers
                       if w.popen.returncode not in (0, *STOPPED_STATUSES)), None)
    if failed is not None:
        print(f"{failed.name} failed ({describe_exit(failed.popen.returncode)}); "
              f"last lines of {failed.log_path}:\n{log_tail(failed.log_path)}",
              file=sys.stderr, flush=True)
        return BAD_INPUT_STATUS if failed.popen.returncode == BAD_INPUT_STATUS else 1
    bad_steps = next((w for w in workers if w.popen.returncode == BAD_STEPS_STATUS), None)
    if bad_steps is not None:
        print(f"the ranks stopped after too many bad steps; last lines of "
              f"{bad_steps.log_path}:\n{log_tail(bad_steps.log_path)}", file=sys.stderr,
              flush=True)
        return BAD_STEPS_STATUS
    stopped = [w.popen.returncode for w in workers if w.popen.returncode in STOPPED_STATUSES]
    return stopped[0] if stopped else 0


def launch(command, workers: int, output_dir: str, grace: float = 10.0,
           cluster_timeout: int = 120, timeout: float = 0.0, port: int = 0,
           stop_timeout: float = 600.0) -> int:
    """Run `command` as a scheduler plus `workers` ranks on loopback; returns the exit status."""
    port = port or free_port()
    scheduler = start(command, cluster_env("MS_SCHED", port, workers, cluster_timeout),
                      os.path.join(output_dir, "scheduler.log"), "scheduler")
    processes = [scheduler]
    ranks = []
    # the handlers stay while the job is stopped, so a Ctrl-C then cannot cut the cleanup
    # short and leave ranks running in their own sessions
    with ForwardedSignals(ranks) as signals:
        try:
            for rank in range(workers):
                ranks.append(start(command,
                                   cluster_env("MS_WORKER", port, workers, cluster_timeout,
                                               rank),
                                   rank_log_path(output_dir, rank), f"rank {rank}", rank))
                processes.append(ranks[-1])
                print(f"rank {rank}: pid {ranks[-1].popen.pid}, log {ranks[-1].log_path}",
                      flush=True)
            return watch(ranks, scheduler, grace, timeout, stop_timeout, signals)
        finally:
            stop(processes)


def launch_devices(command, devices, output_dir: str, grace: float = 10.0,
                   timeout: float = 0.0, stop_timeout: float = 600.0) -> int:
    """Run `command` once per (device id, rank id) of `devices` on this server, each told
    its DEVICE_ID and RANK_ID (Ascend with a rank table: HCCL connects the ranks, no
    scheduler), and watch them as `launch` does; returns the exit status."""
    ranks = []
    print(f"launcher: pid {os.getpid()} (kill -TERM it to make every rank save a checkpoint "
          f"and stop)", flush=True)
    with ForwardedSignals(ranks) as signals:
        try:
            for device, rank in devices:
                env = dict(os.environ, DEVICE_ID=str(device), RANK_ID=str(rank))
                ranks.append(start(command, env, rank_log_path(output_dir, rank),
                                   f"rank {rank} (device {device})", rank))
                print(f"rank {rank} on device {device}: pid {ranks[-1].popen.pid}, log "
                      f"{ranks[-1].log_path}", flush=True)
            return watch(ranks, None, grace, timeout, stop_timeout, signals)
        finally:
            stop(ranks)


def device_list(text: str):
    """'0:0,1:1' -> [(0, 0), (1, 1)]: (device id, rank id) pairs."""
    try:
        pairs = [tuple(int(part) for part in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(pair) != 2 or min(pair) < 0 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected DEVICE:RANK pairs such as 0:0,1:1, got "
                                         f"{text!r}")
    return pairs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m model_zoo.launch",
        description="Run a command as one process per rank on this machine, and stop them all "
                    "when one fails.")
    ranks = parser.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--workers", type=int,
                       help="number of ranks of a MindSpore dynamic cluster (CPU)")
    ranks.add_argument("--devices", type=device_list, metavar="DEVICE:RANK,...",
                       help="this server's devices and their ranks (Ascend, rank table)")
    parser.add_argument("--output-dir", required=True,
                        help="logs go to OUTPUT_DIR/rank_<i>/train.log and scheduler.log")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the other ranks get after one fails (default 10)")
    parser.add_argument("--cluster-timeout", type=int, default=120,
                        help="seconds to wait for all ranks to join (default 120)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="stop the job after this many seconds (default: no limit)")
    parser.add_argument("--stop-timeout", type=float, default=600.0,
                        help="seconds the ranks get to save a checkpoint and stop after a "
                             "signal (default 600)")
    parser.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every process runs, after --")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.devices:
        status = launch_devices(command, args.devices, args.output_dir, args.grace,
                                args.timeout, args.stop_timeout)
    else:
        if args.workers < 1:
            parser.error("--workers must be >= 1")
        status = launch(command, args.workers, args.output_dir, args.grace,
                        args.cluster_timeout, args.timeout, args.port, args.stop_timeout)
    if status in STOPPED_STATUSES and "train" in command:
        print(f"the ranks saved a checkpoint and stopped; continue the job with: "
              f"{resume_command(argv)}", flush=True)
    return status


def resume_command(argv) -> str:
    """This launch again, its training command with --resume (the ranks' own resume lines
    are for one process: run alone, a rank finds fewer devices than its layout needs)."""
    again = ["python3", "-m", "model_zoo.launch"] + list(argv)
    if "--resume" not in again:
        again.append("--resume")
    return shlex.join(again)


if __name__ == "__main__":
    raise SystemExit(main())
