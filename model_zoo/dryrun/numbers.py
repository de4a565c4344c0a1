"""`model-zoo dryrun CONFIG --check-numbers [--steps K]`: the partitioned train step's
numbers against one device's.

Every rank of the layout is compiled by MindSpore from one checkpoint of whole initial
values and exported (`run.run_dryrun`); K steps of those compiled graphs run on CPU ranks
with real collectives (`cpu_ranks`), each rank fed its slice of the same K random batches
(the model folder's `random_batch`); the same train step runs the same K batches on one
device, without MindSpore's parallel pass, over the same micro batches. With dropout off
(the command sets it) and in fp32 (unless the config asks for fp16: the loss-scaled graph,
its first batch planted to overflow: `overflowing_batch`),
compared are each step's loss, gradient norm, overflow decision and loss scale on every
rank, and after the last step every parameter and AdamW moment slice a rank holds against
the same slice of one device's value (`replication.device_piece`). A figure agrees when
|partitioned - one device| <= t x max(1, |one device|), t = 1e-5 (fp16: 1e-3); the
decisions and scales must be equal.

What this cannot show: the kernels are the CPU's (the arithmetic of Ascend's differs in
the last bits), and collectives the CPU backend lacks run as all-reduces of the same
data (`cpu_collectives.as_all_reduces`).
"""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

from model_zoo.dryrun.cpu_ranks import MAILBOX
from model_zoo.errors import UserInputError

TOLERANCE = 1e-5
# fp16's 11-bit significand: 1e-3 is a few units in its last place (the loss scale and the
# overflow decisions are compared exactly)
TOLERANCES = {"fp32": TOLERANCE, "fp16": 1e-3}
DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout")
# what one CPU rank costs beyond its share of the model: MindSpore, the graph, the kernels
RANK_PROCESS_BYTES = 1 << 30
MAX_CPU_RANKS = 16


def numbers_overrides(config) -> List[str]:
    """The `--set` overrides of a numbers check: every dropout of the model 0, and fp32
    unless the config asks for fp16 (the loss-scaled graph)."""
    precision = [] if config.train.precision == "fp16" else ["train.precision=fp32"]
    return precision + [f"model.{key}=0.0" for key in DROPOUT_KEYS
                        if hasattr(config.model, key)]


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable, else all of it)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_runs_here(config, plan):
    """UserInputError unless the layout's ranks can run on this machine's CPU: the model
    folder makes random batches, at most MAX_CPU_RANKS ranks, and the ranks plus one device
    fit in the memory free now (the plan's fp32 memory per device and a process each, and
    the whole model on one device)."""
    from model_zoo.config import import_model
    parallel = config.parallel
    if not hasattr(import_model(config.model.name), "random_batch"):
        raise UserInputError(f"--check-numbers: model {config.model.name!r} has no "
                             f"random_batch hook to make its batches")
    if parallel.device_num > MAX_CPU_RANKS:
        raise UserInputError(f"--check-numbers: {parallel.device_num} ranks are too many for "
                             f"CPU ranks here (at most {MAX_CPU_RANKS}); lay the model out on "
                             f"fewer devices with --set")
    if plan.recording is None or not plan.memory:
        raise UserInputError(f"--check-numbers: the layout cannot be built: "
                             f"{plan.violations[0].message if plan.violations else '?'}")
    # the ranks as the plan costs them, and one device holding the whole model in fp32
    # (weights, gradients, two moments) with every rank's activations
    one_device = (16 * plan.parameter_count + parallel.device_num * max(
        stage.activations for stage in plan.memory) + RANK_PROCESS_BYTES)
    needed = parallel.device_num * (plan.worst_stage.total + RANK_PROCESS_BYTES) + one_device
    available = available_memory()
    if needed > available:
        raise UserInputError(f"--check-numbers: this layout is too big for CPU ranks here: "
                             f"its {parallel.device_num} rank(s) and one device need about "
                             f"{needed / 2 ** 30:.1f} GiB, {available / 2 ** 30:.1f} GiB is "
                             f"available; try a smaller model with --set")


def overflowing_batch(batch) -> list:
    """A batch planted to overflow the fp16 graph's gradients at a loss scale its random
    batches do not: every column filled with its first value (one token repeated, whose
    embedding and output rows take the gradient of every position). GPT-2 tiny's random
    batches overflow from a loss scale of about 2^19, this one from at most 2^16: with
    `train.loss_scale=131072` (2^17) the first step is skipped on every rank and the next
    ones, at 2^16, are applied; at a scale too small for it the report says no step
    overflowed."""
    import numpy as np
    return [np.full_like(column, column.flat[0]) for column in batch]


def micro_batch_count(parallel, accumulation: int) -> int:
    """Micro batches a step of the layout runs, each a consecutive cut of the global batch
    (as MindSpore's Pipeline and GradAccumulation cells cut the graph's global view): a
    pipeline's times the accumulation. One device cuts the same ones, so that a loss that
    is not a mean over rows (the experts' load-balancing loss) is the same."""
    return (parallel.micro_batch_num if parallel.pipeline_stage > 1 else 1) * accumulation


def one_device_steps(config, batches, checkpoint: str):
    """The layout's train step on one device (the operators a cluster runs, no parallel
    pass) over the layout's micro batches (`micro_batch_count`): its initial state saved to
    `checkpoint`, then one step per batch. Returns ([(loss, applied, gradient norm, loss
    scale) per step], {parameter name: value after them})."""
    import copy
    import mindspore as ms
    from model_zoo.config import import_model
    from model_zoo.parallel.context import RunContext
    from model_zoo.train.trainer import build_model
    parallel, train = config.parallel, config.train
    one_device = copy.deepcopy(config)
    one_device.train.grad_accumulation = micro_batch_count(parallel, train.grad_accumulation)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(train.seed)
    _, step = build_model(import_model(config.model.name), one_device, RunContext("Ascend"))
    ms.save_checkpoint(step, checkpoint)
    step.set_train(True)
    outputs = []
    for batch in batches:
        loss, applied, scale, norm, _, _, _ = step(*[ms.Tensor(column) for column in batch])
        outputs.append((float(loss.asnumpy()), bool(applied.asnumpy()), float(norm.asnumpy()),
                        float(scale.asnumpy())))
    return outputs, {name: value.asnumpy() for name, value in step.parameters_dict().items()}


def run_cpu_ranks(work: Path, device_num: int, batch_files, timeout: float):
    """The exported steps of `work/rank_<r>/` run on `device_num` CPU ranks by the local
    launcher: (its exit status, its output). A failed job is a finding, not an error."""
    # an earlier run's tensors that no Receive took would be read as this run's
    shutil.rmtree(work / MAILBOX, ignore_errors=True)
    job = subprocess.run(
        [sys.executable, "-m", "model_zoo.launch", "--workers", str(device_num),
         "--output-dir", str(work / "cpu_job"), "--timeout", str(int(timeout)), "--",
         sys.executable, "-m", "model_zoo.dryrun.cpu_ranks", str(work),
         *map(str, batch_files)],
        capture_output=True, text=True, env=dict(os.environ, GLOG_v="3"))
    return job.returncode, (job.stdout + job.stderr).strip()


def reordered_sends(work: Path, device_num: int) -> list:
    """The Sends the CPU ranks ran ahead of a blocking operator their rank's compiled graph
    had first (`cpu_ranks.in_graph_order`), each {"rank", "send", "ahead_of",
    "possible_hang"}. A possible hang: the rank the Send goes to joins that operator (the
    same collective, or its own Send that the operator receives) only after its Receive of
    this Send; if Ascend issues the Send only once that operator has finished, as the
    exported graph orders them (its topological order, not necessarily the backend's
    execution order), the two wait for each other until HCCL_EXEC_TIMEOUT."""
    import json
    from model_zoo.dryrun.cpu_ranks import describe_event
    orders, found = {}, []
    for rank in range(device_num):
        report = json.loads((work / f"rank_{rank}" / "communication.json").read_text())
        orders[rank] = report["order"]
        found += [(rank, move) for move in report["moved"]]
    listed = []
    for rank, move in found:
        send, blocking = move["send"], move["ahead_of"]
        peer = send["destination"]
        receive = {**send, "op": "Receive"}
        if "tag" in blocking:   # this rank's Receive: the peer's Send it waits for
            counterpart = {**blocking, "op": "Send"} if blocking["source"] == peer else None
        else:                   # a collective the peer is in
            counterpart = blocking if not blocking["group"] or peer in blocking["group"] \
                else None
        order = orders[peer]
        hang = (counterpart in order and receive in order
                and order.index(receive) < order.index(counterpart))
        listed.append({"rank": rank, "send": describe_event(send),
                       "ahead_of": describe_event(blocking), "possible_hang": hang})
    return listed


def relative_gap(found: float, expected: float) -> float:
    """|found - expected| in units of max(1, |expected|): what TOLERANCE bounds. Two equal
    non-finite values (a skipped step's norm) agree; a NaN against anything else is an
    infinite gap."""
    import math
    if not (math.isfinite(found) and math.isfinite(expected)):
        same = (math.isnan(found) and math.isnan(expected)) or found == expected
        return 0.0 if same else math.inf
    return abs(found - expected) / max(1.0, abs(expected))


def compare(config, params, expected, after, work: Path, steps: int) -> dict:
    """The numbers of every rank (`work/rank_<r>/cpu_step.npz`) against one device's."""
    import numpy as np
    from model_zoo.parallel.replication import device_piece
    from model_zoo.parallel.strategy_file import laid_out_names
    tolerance = TOLERANCES.get(config.train.precision, TOLERANCE)
    diff = {"loss": 0.0, "grad_norm": 0.0, "parameters": 0.0, "moments": 0.0}
    worst = {"parameters": 0.0, "moments": 0.0}
    losses, problems = [], []
    for rank in range(config.parallel.device_num):
        found = np.load(work / f"rank_{rank}" / "cpu_step.npz")
        # a rank's stage owns its parameters; a copy of one another stage owns (GPT-2's tied
        # embedding on the last stage) is sent by the owner every step before use, and is
        # not compared
        stage = rank // config.parallel.devices_per_stage
        owned = {name for name, param in params.items() if param.stage == stage}
        missing = [prefix + name for name in sorted(owned) if params[name].requires_grad
                   for prefix in ("", "adam_m.", "adam_v.") if prefix + name not in found.files]
        if missing:
            problems.append(f"rank {rank} holds no {missing[0]}")
        rank_losses = []
        for index, (loss, finite, norm, scale) in enumerate(expected):
            rank_losses.append(float(found[f"loss_{index}"]))
            found_norm = float(found[f"grad_norm_{index}"])
            for kind, value, reference in (("loss", rank_losses[-1], loss),
                                           ("grad_norm", found_norm, norm)):
                both_finite = math.isfinite(value) and math.isfinite(reference)
                diff[kind] = max(diff[kind], abs(value - reference) if both_finite
                                 else relative_gap(value, reference))
            if bool(found[f"finite_{index}"]) != finite:
                problems.append(f"rank {rank}, step {index + 1}: overflow decision "
                                f"{not bool(found[f'finite_{index}'])}, one device {not finite}")
            if float(found[f"scale_{index}"]) != scale:
                problems.append(f"rank {rank}, step {index + 1}: loss scale "
                                f"{float(found[f'scale_{index}']):g}, one device {scale:g}")
            if not (relative_gap(rank_losses[-1], loss) <= tolerance
                    and relative_gap(found_norm, norm) <= tolerance):
                problems.append(f"rank {rank}, step {index + 1}: loss {rank_losses[-1]:.7g} "
                                f"grad norm {float(found[f'grad_norm_{index}']):.7g}, one "
                                f"device {loss:.7g} and {norm:.7g}")
        if rank == 0:
            losses = rank_losses
        sliced = laid_out_names(params, found.files)
        for name, value in after.items():
            if name not in found.files or value.dtype.kind != "f" or (
                    sliced.get(name) in params and sliced[name] not in owned):
                continue
            piece = device_piece(params[sliced[name]], config.parallel, rank) \
                if name in sliced else ...
            gap = np.abs(found[name].astype(np.float64) - value[piece])
            gap = np.where(np.isnan(gap), np.inf, gap)   # a NaN is never agreement
            kind = "moments" if name.startswith(("adam_m.", "adam_v.")) else "parameters"
            diff[kind] = max(diff[kind], float(gap.max(initial=0.0)))
            scaled = float((gap / np.maximum(1.0, np.abs(value[piece]))).max(initial=0.0))
            if scaled > worst[kind]:
                worst[kind] = scaled
                if scaled > tolerance:
                    problems.append(f"rank {rank}: {name} differs by {gap.max():.3g}")
    return {"ok": not problems, "steps": steps, "loss": losses,
            "one_device_loss": [loss for loss, _, _, _ in expected],
            "loss_scale": [scale for _, _, _, scale in expected],
            "skipped": [not applied for _, applied, _, _ in expected],
            "precision": config.train.precision, "max_abs_diff": diff,
            "tolerance": tolerance, "problems": problems[:20]}


def check_numbers(config_path: str, overrides, steps: int, work: Path, jobs: int,
                  timeout: float, progress=None):
    """Compile every rank, run `steps` steps on CPU ranks and on one device, compare.
    Returns (the dry run, the numbers as `model-zoo dryrun --json` gives them)."""
    import numpy as np
    from model_zoo.config import import_model, load_config
    from model_zoo.cost.build import build_plan
    from model_zoo.dryrun.run import run_dryrun
    if steps < 1:
        raise UserInputError(f"--steps must be >= 1, got {steps}")
    config = load_config(config_path, overrides, layout_checked=False)
    overrides = list(overrides) + numbers_overrides(config)
    config = load_config(config_path, overrides, layout_checked=False)
    config.validate()
    plan = build_plan(config, config_path)
    check_runs_here(config, plan)
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(config.train.seed)
    module = import_model(config.model.name)
    batches = [module.random_batch(config, config.train.global_batch_size, rng)
               for _ in range(steps)]
    if config.train.precision == "fp16":
        batches[0] = overflowing_batch(batches[0])
    files = []
    for index, batch in enumerate(batches):
        files.append(work / f"batch_{index}.npz")
        np.savez(files[-1], *batch)
    say = progress or (lambda line: None)
    say(f"one device: {steps} step(s)")
    expected, after = one_device_steps(config, batches, str(work / "init.ckpt"))
    ranks = list(range(config.parallel.device_num))
    dry = run_dryrun(config, config_path, overrides, ranks, output_dir=str(work), jobs=jobs,
                     timeout=timeout, progress=progress, plan=plan,
                     load=str(work / "init.ckpt"), export=True, evaluation=False)
    if not all(rank.compiled for rank in dry.ranks):
        return dry, {"ok": False, "steps": steps, "problems": ["a rank did not compile"]}
    say(f"{len(ranks)} CPU ranks: {steps} step(s) of the compiled graphs")
    status, log = run_cpu_ranks(work, len(ranks), files, timeout)
    if status != 0:
        return dry, {"ok": False, "steps": steps,
                     "problems": [f"the CPU ranks failed (status {status}): "
                                  f"{log.splitlines()[-1] if log else ''}"]}
    numbers = compare(config, plan.recording.params, expected, after, work, steps)
    # not a difference in the numbers: what only a server can settle (docs/ascend.md)
    numbers["reordered_sends"] = reordered_sends(work, len(ranks))
    return dry, numbers


def format_numbers(numbers: dict) -> str:
    lines = [f"numbers of {numbers['steps']} step(s) against one device:"]
    if "max_abs_diff" in numbers:
        losses = ", ".join(f"{a:.6f} / {b:.6f}" for a, b in
                           zip(numbers["loss"], numbers["one_device_loss"]))
        lines.append(f"  loss (rank 0 / one device): {losses}")
        lines.append("  largest difference: " + ", ".join(
            f"{kind.replace('_', ' ')} {value:.2g}"
            for kind, value in numbers["max_abs_diff"].items()))
    for send in numbers.get("reordered_sends", []):
        lines.append(f"  rank {send['rank']}: the CPU ranks ran {send['send']} ahead of "
                     f"{send['ahead_of']}, which the exported graph has first"
                     + ("; its peer joins that only after receiving the Send: a hang if "
                        "Ascend issues the Send only after it (scripts/ascend_first_run.sh "
                        "asks a server)" if send["possible_hang"] else ""))
    if numbers.get("skipped") is not None and numbers.get("precision") == "fp16" \
            and not any(numbers["skipped"]):
        lines.append(f"  no step overflowed: the planted batch does not overflow at loss "
                     f"scale {numbers['loss_scale'][0]:g} (GPT-2 tiny's does from 2^17)")
    lines += [f"  {problem}" for problem in numbers["problems"]]
    if any(numbers.get("skipped", [])):
        lines.append("  steps skipped for an overflow (one device): " + ", ".join(
            f"{index + 1} (loss scale {scale:g})" for index, (skipped, scale) in
            enumerate(zip(numbers["skipped"], numbers["loss_scale"])) if skipped))
    lines.append(f"numbers agree within {numbers.get('tolerance', TOLERANCE):g}"
                 if numbers["ok"] else
                 "NUMBERS DIFFER from one device")
    return "\n".join(lines)
