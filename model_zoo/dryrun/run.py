"""`model-zoo dryrun`: MindSpore's own semi-auto-parallel compiler on a layout, on a laptop.

`model-zoo plan` re-derives MindSpore's strategy rules; this asks MindSpore itself. Each
chosen rank of the layout is compiled in a process of its own (`dryrun.rank`) through
MindSpore's dry run: simulation level 0 (`MS_SIMULATION_LEVEL=0`, dummy collectives of
`RANK_SIZE` ranks) on the wheel's GPU plugin, loaded against stand-in CUDA libraries
(`cuda_stubs`), since the parallel pass refuses the CPU target. That runs the whole
frontend an Ascend job runs before its first step: strategy checks, tensor
redistribution, the collectives it inserts, pipeline split, optimizer shard and the
strategy file. It is not an Ascend compile: kernels are never selected or launched (an
operator without an Ascend kernel still compiles), and memory is not simulated.

Per rank it reports whether the train step compiled, MindSpore's error in one line,
compile seconds, peak host memory, the megabytes the compiled step holds as constants (device
memory the plan does not count), the inserted collectives by kind and group size, the
strategy file, and every parameter whose layout differs from the plan's, with the
gradient-norm weight the train step gives it.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from model_zoo.config import shipped_config
from model_zoo.errors import UserInputError
from model_zoo.parallel.compiled_layouts import compare_layouts, short_view

DEFAULT_TIMEOUT = 3600


@dataclass
class RankResult:
    """What the dry run of one rank found."""

    rank: int
    stage: int
    compiled: bool = False
    compile_s: Optional[float] = None
    sink_size: int = 0   # steps a call of the sunk step compiled (0: the step fed from the host)
    eval_compile_s: Optional[float] = None   # the held-out evaluation network's compile
    eval_collectives: dict = field(default_factory=dict)    # and its collectives
    eval_error: Optional[str] = None         # MindSpore's refusal of it, in one line
    peak_rss_mb: Optional[int] = None
    collectives: dict = field(default_factory=dict)         # kind -> count
    collective_groups: dict = field(default_factory=dict)   # kind -> {group size: count}
    layout_mismatches: list = field(default_factory=list)
    float_status_ops: int = 0   # the 910's overflow check in the compiled step
    constant_mb: Optional[float] = None   # tensors the compiled step holds as constants
    norm_weights_error: Optional[str] = None   # the trainer's check before step 1
    error: Optional[str] = None
    strategy_file: Optional[str] = None
    log: Optional[str] = None


@dataclass
class DryRun:
    """A dry run of a layout: one RankResult per compiled rank, and the plan's verdict."""

    config_path: str
    device_num: int
    ranks: List[RankResult]
    plan_violations: List[str]

    @property
    def ok(self) -> bool:
        return all(r.compiled and not r.error and not r.layout_mismatches
                   and not r.norm_weights_error for r in self.ranks)

    def to_dict(self) -> dict:
        ranks = []
        for result in self.ranks:
            entry = asdict(result)
            if not entry["log"]:
                entry.pop("log")
            ranks.append(entry)
        return {"ok": self.ok, "config": self.config_path, "device_num": self.device_num,
                "plan_violations": self.plan_violations, "ranks": ranks}


def blocks_overrides(parallel, blocks: List[int]) -> List[str]:
    """The `--set` overrides that compile a layout with `blocks[k]` blocks on stage k (fewer
    than the config's, to compile fast): the model's depth, and the config's per-stage
    `stage_blocks` and `recompute_blocks` cut to them."""
    overrides = [f"model.num_layers={sum(blocks)}"]
    if parallel.stage_blocks is not None:
        overrides.append(f"parallel.stage_blocks={list(blocks)}")
    if parallel.recompute_blocks is not None:
        overrides.append(f"parallel.recompute_blocks="
                         f"{[min(n, held) for n, held in zip(parallel.recompute_blocks, blocks)]}")
    return overrides


def select_ranks(spec: str, parallel) -> List[int]:
    """The ranks `--ranks` names: "stages" (the first rank of every pipeline stage), "all",
    or a comma-separated list."""
    device_num = parallel.device_num
    if spec == "stages":
        return [stage * parallel.devices_per_stage for stage in range(parallel.pipeline_stage)]
    if spec == "all":
        return list(range(device_num))
    try:
        ranks = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise UserInputError(f"--ranks {spec!r}: give stages, all, or ranks such as 0,4")
    bad = [rank for rank in ranks if not 0 <= rank < device_num]
    if not ranks or bad:
        raise UserInputError(f"--ranks {spec!r}: the layout has ranks 0-{device_num - 1}")
    return sorted(set(ranks))


def run_dryrun(config, config_path: str, overrides, ranks: List[int],
               output_dir: Optional[str] = None, jobs: int = 2,
               timeout: float = DEFAULT_TIMEOUT, progress=None, plan=None,
               load: Optional[str] = None, export: bool = False,
               evaluation=True, as_device: Optional[str] = None) -> DryRun:
    """Compile `ranks` of `config`'s layout, `jobs` processes at a time, and hold their
    parameter layouts against the plan's (`plan`, built here unless given: its recording
    patches MindSpore's primitives, so plans are built one at a time, never from two
    threads). `progress(message)` hears each rank finish. `load`: a checkpoint of whole
    values the compiled step starts from; `export`: write each rank's compiled step as
    `rank_<r>/step.mindir` under `output_dir` (what `tests/test_dryrun.py` runs on CPU
    ranks); `evaluation`: also compile the held-out evaluation network (True: on every
    rank; or a collection of the ranks that do); `as_device`:
    build the step as that chip's run does ("ascend910": the float-status overflow check;
    "ascend910b": flash attention and bf16 allowed), ConfigError if the config asks what
    the chip cannot run."""
    from model_zoo.parallel.replication import stage_of_rank
    from model_zoo.dryrun import cuda_stubs
    from model_zoo.cost.build import build_plan

    if as_device:
        check_chip(config, as_device)
    cuda_home = cuda_stubs.fake_cuda_home()     # before any work: the one machine check
    parallel = config.parallel
    if plan is None:
        plan = build_plan(config, config_path)
    plan_params = plan.recording.params if plan.recording is not None else {}
    work = (Path(output_dir) if output_dir else
            Path(tempfile.mkdtemp(prefix="model-zoo-dryrun-"))).resolve()
    running = []
    try:
        pending = [(rank, _request(work, config_path, overrides, rank, load, export,
                                   evaluation is True or (evaluation is not False
                                                          and rank in evaluation),
                                   as_device))
                   for rank in ranks]
        results = {}
        while pending or running:
            while pending and len(running) < max(1, jobs):
                rank, request = pending.pop(0)
                running.append((rank, request, _start(request, rank, parallel.device_num,
                                                      cuda_home), time.monotonic()))
            time.sleep(0.2)
            for item in list(running):
                rank, request, process, started = item
                timed_out = False
                if process.poll() is None:
                    if time.monotonic() - started <= timeout:
                        continue
                    timed_out = True
                    process.kill()
                    process.wait()
                running.remove(item)
                result, layouts = _collect(request, rank, stage_of_rank(rank, parallel),
                                           process, timeout if timed_out else None,
                                           keep=bool(output_dir))
                # one device: a stand-alone compile, no layout to compare
                if result.compiled and plan_params and parallel.device_num > 1:
                    result.layout_mismatches = compare_layouts(layouts, plan_params,
                                                               parallel, result.stage)
                results[rank] = result
                if progress is not None:
                    progress(rank_line(result))
        violations = [f"{v.rule}: {v.message}" for v in plan.violations]
        return DryRun(config_path, parallel.device_num, [results[r] for r in ranks],
                      violations)
    finally:   # an error or Ctrl-C here leaves no compile running
        for _, _, process, _ in running:
            if process.poll() is None:
                process.kill()
                process.wait()
        if not output_dir:
            shutil.rmtree(work, ignore_errors=True)


def check_chip(config, chip: str):
    """ConfigError naming the key when `config` asks what `chip` cannot run."""
    from model_zoo.nn.attention import check_flash_attention_device
    from model_zoo.nn.layers import check_precision_device
    if getattr(config.model, "flash_attention", False):
        check_flash_attention_device("Ascend", chip == "ascend910b")
    check_precision_device(config.train.precision, "Ascend", chip == "ascend910b")


def _request(work: Path, config_path: str, overrides, rank: int, load=None,
             export=False, evaluation=True, as_device=None) -> Path:
    folder = work / f"rank_{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "error.txt", "strategy.ckpt", "step.mindir"):
        (folder / stale).unlink(missing_ok=True)
    request = folder / "request.json"
    request.write_text(json.dumps({"config": os.path.abspath(shipped_config(config_path)),
                                   "overrides": list(overrides or []), "rank": rank,
                                   "cwd": os.getcwd(),
                                   "load": os.path.abspath(load) if load else None,
                                   "export": export, "evaluation": evaluation,
                                   "as_device": as_device}))
    return request


def _start(request: Path, rank: int, device_num: int, cuda_home: Path) -> subprocess.Popen:
    """The rank's compile process, with the dry run's environment."""
    project = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env.update({
        "CUDA_HOME": str(cuda_home),
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(cuda_home / "lib"),
                                                         env.get("LD_LIBRARY_PATH")])),
        "MS_SIMULATION_LEVEL": "0",      # compile only, with dummy collectives
        "RANK_SIZE": str(device_num), "RANK_ID": str(rank),
        # off Ascend, MindSpore's collective manager wants a host launcher before it reaches
        # its simulation branch: these make it take the OpenMPI one
        "OMPI_COMMAND": "model-zoo-dryrun", "PMIX_RANK": str(rank),
        "GLOG_v": env.get("GLOG_v", "3"),
        "PYTHONPATH": os.pathsep.join(filter(None, [project, env.get("PYTHONPATH")])),
    })
    for variable in ("MS_WORKER_NUM", "MS_ROLE", "RANK_TABLE_FILE", "DEVICE_ID"):
        env.pop(variable, None)          # a launcher's variables would make it a real rank
    log = open(request.parent / "dryrun.log", "w", encoding="utf-8")
    with log:
        return subprocess.Popen([sys.executable, "-m", "model_zoo.dryrun.rank",
                                 str(request)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=str(request.parent))


def _collect(request: Path, rank: int, stage: int, process, timed_out: Optional[float],
             keep: bool):
    """(RankResult, MindSpore's layouts by name) of a finished or stopped compile."""
    folder = request.parent
    result = RankResult(rank=rank, stage=stage)
    if keep:
        result.log = str(folder / "dryrun.log")
    path = folder / "result.json"
    if timed_out:
        result.error = f"the compile did not finish within {timed_out:g} s (--timeout)"
        return result, {}
    if not path.is_file():
        how = (f"was killed by signal {-process.returncode}" if process.returncode < 0
               else f"exited with status {process.returncode}")
        tail = _log_tail(folder / "dryrun.log")
        result.error = f"the compile process {how}" + (f": {tail}" if tail else "")
        return result, {}
    found = json.loads(path.read_text())
    for key in ("compiled", "compile_s", "sink_size", "eval_compile_s", "eval_collectives",
                "eval_error",
                "peak_rss_mb", "collectives", "collective_groups", "float_status_ops",
                "constant_mb", "norm_weights_error", "error"):
        setattr(result, key, found[key])
    strategy = folder / "strategy.ckpt"
    if keep and strategy.is_file():
        result.strategy_file = str(strategy)
    return result, found["layouts"]


def _log_tail(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


# --- the report -------------------------------------------------------------------------------

def rank_line(result: RankResult) -> str:
    head = f"rank {result.rank} (stage {result.stage}): "
    if not result.compiled:
        return head + f"FAILED: {result.error}"
    comm = ", ".join(f"{kind} {count}" for kind, count in sorted(result.collectives.items()))
    held_out = ("evaluation network FAILED" if result.eval_error is not None else
                "evaluation network not compiled" if result.eval_compile_s is None else
                f"evaluation network {result.eval_compile_s:.1f} s")
    sunk = f" (sunk, {result.sink_size} steps a call)" if result.sink_size else ""
    if result.float_status_ops:
        sunk += f" with {result.float_status_ops} float-status operators"
    line = (head + f"compiled{sunk} in {result.compile_s:.1f} s ({held_out}), peak "
            f"{result.peak_rss_mb} MB, constants {result.constant_mb} MB; "
            f"collectives: {comm or 'none'}")
    if result.eval_error is not None:
        line += f"\n      evaluation network: {result.eval_error}"
    if result.layout_mismatches:
        line += f"; {len(result.layout_mismatches)} layouts differ from the plan"
    if result.norm_weights_error:
        line += f"\n      the trainer would stop: {result.norm_weights_error}"
    return line


def format_dryrun(run: DryRun, max_mismatches: int = 10) -> str:
    lines = [f"MindSpore dry run of {run.config_path}: {run.device_num} devices, "
             f"{len(run.ranks)} rank(s) compiled with MindSpore's semi-auto parallel"]
    for result in run.ranks:
        lines.append("  " + rank_line(result))
        for kind, sizes in sorted(result.collective_groups.items()):
            groups = ", ".join(f"{count} over {size}" for size, count in
                               sorted(sizes.items(), key=lambda item: int(item[0])))
            lines.append(f"      {kind}: {groups} devices")
        for mismatch in result.layout_mismatches[:max_mismatches]:
            lines.append(f"      differs ({mismatch['problem']}): {mismatch['parameter']}: "
                         f"MindSpore {short_view(mismatch['mindspore'])}, plan "
                         f"{short_view(mismatch['plan'])}" + _weights(mismatch))
        if len(result.layout_mismatches) > max_mismatches:
            lines.append(f"      ... and {len(result.layout_mismatches) - max_mismatches} more "
                         f"(--json lists all)")
        if result.strategy_file:
            lines.append(f"      strategy file: {result.strategy_file}")
    if run.plan_violations:
        lines.append(f"model-zoo plan finds {len(run.plan_violations)} problem(s) with this "
                     f"layout; the first: {run.plan_violations[0]}")
    lines.append("ok: every rank compiled and agrees with the plan" if run.ok else
                 "NOT OK: a rank did not compile or a layout differs from the plan")
    return "\n".join(lines)


def _weights(mismatch: dict) -> str:
    if "norm_weight" not in mismatch:
        return ""
    return (f"; gradient-norm weight {mismatch['norm_weight']:g} (MindSpore's layout "
            f"implies {mismatch['norm_weight_mindspore']:g})")
