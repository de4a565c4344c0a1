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

`--env NAME=VALUE` adds a variable to every process's environment (the launch scripts pass
theirs so); `--dry-run` prints, for every rank, `rank R device D: ENV=VALUE ... COMMAND` (the
variables the launch adds to the launcher's own environment, and the command: the part
after the colon runs as it is in a shell) and starts nothing. With `--devices`,
`--bind-cores` gives each rank an equal range of this machine's cores (`taskset -c`, as
MindSpore's model-zoo scripts bind each device's process) and `--rank-workdirs` gives each
rank its own CANN working folder and compile cache in OUT/rank_<i>/ (ASCEND_WORK_PATH,
MS_COMPILER_CACHE_PATH), where kernel_meta, fusion results and CANN's logs land instead of
in one folder shared by the server's processes. Each rank's environment is appended to
OUT/rank_<i>/env.txt when it starts.

SIGINT, SIGTERM or SIGHUP to the launcher is forwarded to every worker: each finishes its step,
saves a checkpoint and exits 128 + the signal (the ranks agree on the step inside the
train step, so a signal that reaches one rank only stops them all the same way). The
launcher waits up to `--stop-timeout` seconds for them and exits with that status; a
second signal is forwarded too, and the workers then exit at once. After a signal, a stop
for bad steps or a failed rank, the launcher prints the command that continues the job:
`--again COMMAND` (the launch script's own command line, which the scripts pass) plus
`--resume`, else this launch again with `--resume`.
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
from typing import Dict, List, Optional

from model_zoo.errors import at_least
from model_zoo.train.interrupt import STOP_SIGNALS, leave_a_hung_up_terminal

POLL_SECONDS = 0.5
BAD_INPUT_STATUS = 2
BAD_STEPS_STATUS = 3   # a rank that saved and stopped after too many bad steps (interrupt.py)
# threads each process's CPU kernels may use (nn/cpu_kernels.cc `usable_cores`)
CPU_THREADS = "MODEL_ZOO_CPU_THREADS"
# a rank that saved and stopped: the others get --stop-timeout to do the same
STOPPED_STATUSES = (*(128 + signum for signum in STOP_SIGNALS), BAD_STEPS_STATUS)
STOP_SECONDS = 5.0
# each rank's own CANN working folder (kernel_meta, fusion results, CANN's logs: CANN's
# ASCEND_WORK_PATH) and MindSpore compile cache, under OUT/rank_<i>/ (--rank-workdirs)
WORKDIR_VARIABLES = {"ASCEND_WORK_PATH": "ascend_work", "MS_COMPILER_CACHE_PATH": "compile_cache"}
LOG_TAIL_LINES = 20
# msrun starts every worker of a server with one environment: set, each worker makes its
# own working folders under this folder itself (`use_rank_workdirs`)
RANK_WORKDIRS_ROOT = "MODEL_ZOO_RANK_WORKDIRS"


@dataclass
class RankSpec:
    """A process the launch starts: its name in messages, rank (None for the scheduler),
    device, the variables it adds to the launcher's environment, its command and log."""

    name: str
    rank: Optional[int]
    device: str
    env: Dict[str, str]
    command: List[str]
    log_path: str

    def line(self) -> str:
        """`rank R device D: ENV=VALUE ... COMMAND` (`scheduler: ...`), what --dry-run prints;
        the part after the colon runs as it is in a shell."""
        words = ([f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
                 + [shlex.quote(word) for word in self.command])
        head = self.name if self.rank is None else f"rank {self.rank} device {self.device}"
        return f"{head}: {' '.join(words)}"

    @property
    def on_device(self) -> bool:
        """A rank of an accelerator (--devices), not of the CPU cluster."""
        return self.device.isdigit()


@dataclass
class Process:
    """A started process of the job: its role, rank (None for the scheduler) and log."""

    name: str
    rank: Optional[int]
    popen: subprocess.Popen
    log_path: str


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_log_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"rank_{rank}", "train.log")


def start(spec: RankSpec) -> Process:
    """Start `spec`'s process in its own session, its output appended to its log; a rank's
    whole environment is appended to env.txt beside the log."""
    env = dict(os.environ, **spec.env)
    folder = os.path.dirname(spec.log_path) or "."
    os.makedirs(folder, exist_ok=True)
    for name in WORKDIR_VARIABLES:
        if name in spec.env:
            os.makedirs(spec.env[name], exist_ok=True)
    stamp = time.strftime('%Y-%m-%d %H:%M:%S')
    if spec.rank is not None:
        with open(os.path.join(folder, "env.txt"), "a", encoding="utf-8") as record:
            record.write(f"=== {spec.name} {stamp}\n"
                         + "".join(f"{name}={env[name]}\n" for name in sorted(env)))
    with open(spec.log_path, "a", encoding="utf-8") as log:
        log.write(f"=== {spec.name} started {stamp}: {' '.join(spec.command)}\n")
        log.flush()
        popen = subprocess.Popen(spec.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return Process(spec.name, spec.rank, popen, spec.log_path)


def cpu_threads_share(workers: int) -> int:
    """Each of `workers` ranks' share of this machine's cores (its affinity mask), for the
    CPU kernels' threads; the msrun script asks it too."""
    return max(1, len(os.sched_getaffinity(0)) // workers)


def cluster_variables(role: str, port: int, workers: int, cluster_timeout: int,
                      rank=None) -> dict:
    """The variables one process of a CPU job of `workers` ranks on this machine adds to
    the launcher's environment: MindSpore's dynamic-cluster variables, and each rank's share
    of the cores for the CPU kernels' threads (`CPU_THREADS`, unless already set)."""
    added = {"MS_ROLE": role, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port),
             "MS_WORKER_NUM": str(workers), "MS_TOPO_TIMEOUT": str(cluster_timeout)}
    added.setdefault("DEVICE_TARGET", os.environ.get("DEVICE_TARGET", "CPU"))
    if CPU_THREADS not in os.environ:
        added[CPU_THREADS] = str(cpu_threads_share(workers))
    if rank is not None:
        added.update({"MS_NODE_ID": str(rank), "RANK_ID": str(rank)})
    return added


def cluster_env(role: str, port: int, workers: int, cluster_timeout: int, rank=None) -> dict:
    """The whole environment of that process (`cluster_variables` over the launcher's)."""
    return dict(os.environ, **cluster_variables(role, port, workers, cluster_timeout, rank))


def worker_specs(command, workers: int, output_dir: str, port: int, cluster_timeout: int,
                 job_env=None) -> List[RankSpec]:
    """The scheduler and `workers` ranks of a CPU job on loopback, scheduler first."""
    job_env = job_env or {}

    def variables(role, rank=None):   # the job's own first, and they win
        return {**job_env, **cluster_variables(role, port, workers, cluster_timeout, rank),
                **job_env}

    scheduler = RankSpec("scheduler", None, "-", variables("MS_SCHED"), list(command),
                         os.path.join(output_dir, "scheduler.log"))
    return [scheduler] + [RankSpec(f"rank {rank}", rank, "cpu", variables("MS_WORKER", rank),
                                   list(command), rank_log_path(output_dir, rank))
                          for rank in range(workers)]


def device_specs(command, devices, output_dir: str, job_env=None, bind_cores: bool = False,
                 rank_workdirs: bool = False, cpus=None) -> List[RankSpec]:
    """One rank per (device id, rank id) of `devices` on this server, each told its
    DEVICE_ID and RANK_ID; with `bind_cores` each runs under `taskset -c` on its share of
    `cpus` (default: this process's affinity), with `rank_workdirs` its CANN working folder
    and compile cache are its own (`WORKDIR_VARIABLES`)."""
    ranges = core_ranges(len(devices), cpus) if bind_cores else None
    if bind_cores and ranges is None:
        print(f"warning: {len(cpus or os.sched_getaffinity(0))} cores for {len(devices)} "
              f"devices: the ranks are not bound to cores", file=sys.stderr, flush=True)
    specs = []
    for index, (device, rank) in enumerate(devices):
        env = {**(job_env or {}), "DEVICE_ID": str(device), "RANK_ID": str(rank)}
        if rank_workdirs:
            folder = os.path.abspath(os.path.join(output_dir, f"rank_{rank}"))
            env.update({name: os.path.join(folder, sub)
                        for name, sub in WORKDIR_VARIABLES.items()})
        prefix = ["taskset", "-c", ranges[index]] if ranges else []
        specs.append(RankSpec(f"rank {rank} (device {device})", rank, str(device), env,
                              prefix + list(command), rank_log_path(output_dir, rank)))
    return specs


def use_rank_workdirs(environ=os.environ):
    """In a worker msrun started (`RANK_WORKDIRS_ROOT` set by the msrun script): this
    rank's own CANN working folder and compile cache under ROOT/rank_<rank>/, as the
    rank-table launch gives each device (`WORKDIR_VARIABLES`; a variable already set is
    kept), made if missing. `model-zoo` calls it first, before MindSpore or CANN load."""
    root = environ.get(RANK_WORKDIRS_ROOT)
    if not root:
        return
    rank = environ.get("RANK_ID") or environ.get("MS_NODE_ID") or environ.get("DEVICE_ID", "0")
    for name, sub in WORKDIR_VARIABLES.items():
        environ.setdefault(name, os.path.join(root, f"rank_{rank}", sub))
        os.makedirs(environ[name], exist_ok=True)


def core_ranges(count: int, cpus=None) -> Optional[List[str]]:
    """`count` equal, disjoint shares of `cpus` (default: this process's affinity) in
    `taskset -c` form ('0-23', '24-47', ...), in order; None when there are fewer cores than
    shares. The remainder of an uneven split is left to the system."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    share = len(cpus) // count
    if share == 0:
        return None
    return [cpu_list(cpus[index * share:(index + 1) * share]) for index in range(count)]


def cpu_list(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{low}-{high}" if high > low else str(low) for low, high in runs)


def stop(processes, patience: float = STOP_SECONDS):
    """SIGTERM the process groups still running, then SIGKILL what is left after
    `patience` seconds."""
    running = [p for p in processes if p.popen.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + patience
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
    """While active, SIGINT, SIGTERM and SIGHUP to the launcher go to every worker's process
    group; `signum` is the first one received."""

    def __init__(self, workers):
        self.workers, self.signum, self._previous = workers, None, {}

    def _forward(self, signum, frame):
        leave_a_hung_up_terminal(signum)
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
        for signum in STOP_SIGNALS:
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
    # after a failure the others had their grace: a rank waiting in a collective for the
    # failed one cannot finish the step a SIGTERM asks it to finish
    stop(workers + helpers, patience=0.0 if failed is not None else STOP_SECONDS)
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


def launch(specs: List[RankSpec], grace: float = 10.0, timeout: float = 0.0,
           stop_timeout: float = 600.0) -> int:
    """Start `specs` (a scheduler first, if the job has one) and watch them (`watch`);
    returns the job's exit status."""
    processes, ranks = [], []
    scheduler = None
    if any(spec.on_device for spec in specs):
        print(f"launcher: pid {os.getpid()} (kill -TERM it to make every rank save a "
              f"checkpoint and stop)", flush=True)
    # the handlers stay while the job is stopped, so a Ctrl-C then cannot cut the cleanup
    # short and leave ranks running in their own sessions
    with ForwardedSignals(ranks) as signals:
        try:
            for spec in specs:
                processes.append(start(spec))
                if spec.rank is None:
                    scheduler = processes[-1]
                    continue
                ranks.append(processes[-1])
                where = (f"rank {spec.rank} on device {spec.device}" if spec.on_device
                         else f"rank {spec.rank}")
                print(f"{where}: pid {ranks[-1].popen.pid}, log {ranks[-1].log_path}",
                      flush=True)
            return watch(ranks, scheduler, grace, timeout, stop_timeout, signals)
        finally:
            stop(processes)


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
    ranks.add_argument("--workers", type=at_least(1),
                       help="number of ranks of a MindSpore dynamic cluster (CPU)")
    ranks.add_argument("--devices", type=device_list, metavar="DEVICE:RANK,...",
                       help="this server's devices and their ranks (Ascend, rank table)")
    parser.add_argument("--output-dir", required=True,
                        help="logs go to OUTPUT_DIR/rank_<i>/train.log and scheduler.log")
    parser.add_argument("--grace", type=at_least(0.0, float), default=10.0,
                        help="seconds the other ranks get after one fails (default 10)")
    parser.add_argument("--cluster-timeout", type=at_least(1), default=120,
                        help="seconds to wait for all ranks to join (default 120)")
    parser.add_argument("--timeout", type=at_least(0.0, float), default=0.0,
                        help="stop the job after this many seconds (default: no limit)")
    parser.add_argument("--stop-timeout", type=at_least(0.0, float), default=600.0,
                        help="seconds the ranks get to save a checkpoint and stop after a "
                             "signal (default 600)")
    parser.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    parser.add_argument("--env", action="append", type=variable, default=[],
                        metavar="NAME=VALUE", help="a variable every process gets (repeatable)")
    parser.add_argument("--bind-cores", action="store_true",
                        help="with --devices: each rank on its own equal range of cores")
    parser.add_argument("--rank-workdirs", action="store_true",
                        help="with --devices: each rank's CANN working folder and compile "
                             "cache in OUTPUT_DIR/rank_<i>/")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each rank's added environment and command; start nothing")
    parser.add_argument("--again", metavar="COMMAND",
                        help="the command that started this launch, printed with --resume "
                             "when the job stops before its end (default: this launch)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every process runs, after --")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    job_env = dict(args.env)
    if args.devices:
        specs = device_specs(command, args.devices, args.output_dir, job_env, args.bind_cores,
                             args.rank_workdirs)
    else:
        if args.workers < 1:
            parser.error("--workers must be >= 1")
        specs = worker_specs(command, args.workers, args.output_dir, args.port or free_port(),
                             args.cluster_timeout, job_env)
    if args.dry_run:
        print("\n".join(spec.line() for spec in specs), flush=True)
        return 0
    status = launch(specs, args.grace, args.timeout, args.stop_timeout)
    if "train" in command and status in (*STOPPED_STATUSES, 1):
        again = resume_command(args.again or shlex.join(["python3", "-m", "model_zoo.launch",
                                                          *argv]))
        reason = ("once the failure is mended, " if status == 1 else
                  "the ranks saved a checkpoint and stopped; ")
        print(f"{reason}continue the job with: {again}", flush=True)
    return status


def variable(text: str):
    """'NAME=VALUE' -> (NAME, VALUE)."""
    name, equals, value = text.partition("=")
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def resume_command(command: str) -> str:
    """`command` (a shell command line that starts the job) with --resume, which it gets once:
    every rank then continues from the newest checkpoint they all saved (the ranks' own
    resume lines are for one process: run alone, a rank finds fewer devices than its
    layout needs)."""
    return command if "--resume" in shlex.split(command) else f"{command} --resume"


if __name__ == "__main__":
    raise SystemExit(main())
