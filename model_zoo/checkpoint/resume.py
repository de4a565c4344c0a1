"""`--resume` of a sharded run on another layout (device count, dp, mp, pp, optimizer shard).

A sharded run's output holds one folder per rank, `RUN/rank_<i>/` with its config.yaml,
checkpoints/ and the strategy MindSpore saved. When a rank resumes and its checkpoints were
saved under another layout than its config now asks for, it:

1. makes sure a snapshot of the run exists at the newest step all the earlier layout's ranks
   saved: `RUN/earlier_layouts/step_<N>/`, a sliced directory as `model-zoo checkpoint
   collect` writes it (the earlier config, MindSpore's strategy, each rank's file
   hard-linked). Ranks may race to write it; the first whole one renamed into place serves
   all of them;
2. renames its own checkpoints of the earlier layout to `step_<N>.<layout>.ckpt`, so a
   rank's checkpoints/ folder never mixes layouts, even if this run stops before its first
   save (a later `--resume` then starts from the snapshot again);
3. once its step is compiled, cuts its slices of the new layout from the snapshot with
   MindSpore's transform_checkpoint_by_rank and loads them, optimizer state and step
   included (`restore_sliced`).

MindFormers' auto_trans_ckpt does the same on shared storage
(mindformers/tools/ckpt_transform/transform_checkpoint.py), with ranks waiting on each
other's marker files; here each rank cuts only its own slices, so none waits for another.
As there, a change of layout needs every rank folder visible to every rank (one server
or shared storage). A resume on the same layout does not: the ranks tell each other which
steps they hold (`gathered_steps`, one all-gather), so servers with their own local disks
resume from the newest step they all saved.
Only a cluster runs the sharded path; the tests run steps 1-3 on the files of a cluster run.
"""

import dataclasses
import math
import os

import mindspore as ms

from model_zoo.errors import CheckpointError, UserInputError
from model_zoo.checkpoint import layouts
from model_zoo.checkpoint.contents import needed_from_checkpoints
from model_zoo.checkpoint.files import (list_checkpoints, load_weights, read_checkpoint,
                                        remove_partial_checkpoints, saved_step)

SNAPSHOTS = "earlier_layouts"
RESUME_CANDIDATES = 64   # newest checkpoint steps each rank tells the others it holds


def log(message: str):
    """A line of this rank's log (every rank has its own, as in the training loop)."""
    print(message, flush=True)


@dataclasses.dataclass
class ResumePoint:
    """Where a rank of a sharded run resumes: its own checkpoint `path` of the step, or
    (`cut`) a sliced directory of another layout to cut its slices from."""

    step: int
    path: str
    cut: bool = False


def layout_tag(parallel) -> str:
    """A file-name form of a layout: 'dp2-mp2-pp2-os-8ranks'."""
    return (f"dp{parallel.data_parallel}-mp{parallel.model_parallel}-"
            f"pp{parallel.pipeline_stage}{'-os' if parallel.optimizer_shard else ''}-"
            f"{parallel.device_num}ranks")


def same_layout(a: layouts.SlicedLayout, b: layouts.SlicedLayout) -> bool:
    """True when both layouts give every parameter the same slices on the same ranks."""
    from model_zoo.parallel.strategy_file import strategy_map
    names = sorted(set(a.params) | set(b.params))
    return (a.device_num == b.device_num
            and strategy_map(a.params, a.parallel, names).SerializeToString()
            == strategy_map(b.params, b.parallel, names).SerializeToString())


def gathered_steps(own_steps, device_num: int) -> list:
    """The checkpoint steps each rank of the job holds (its newest RESUME_CANDIDATES), one
    set per rank, exchanged in one all-gather over all ranks: each rank reads only its own
    folder. Every rank must call it at the same point."""
    import numpy as np
    from model_zoo.parallel.context import gathered_rows
    offered = np.full(RESUME_CANDIDATES, -1, np.int64)   # -1: no step
    newest = sorted(own_steps)[-RESUME_CANDIDATES:]
    offered[:len(newest)] = newest
    if offered.max() >= 1 << 24:
        raise CheckpointError(f"--resume: step {offered.max()} is beyond the 2**24 steps the "
                              f"ranks can tell each other")
    return [{int(step) for step in row if step >= 0} for row in gathered_rows(offered,
                                                                              device_num)]


def resume_point(output_dir: str, config, log, saved=None) -> ResumePoint:
    """Where the rank whose folder is `output_dir` resumes a sharded run with `config`'s
    layout, after steps 1 and 2 of the module docstring when the layout changed. Every rank
    comes to the same step by the same rules:

    - checkpoints no newer than the newest snapshot are of a layout left behind (a folder a
      smaller layout did not use keeps its earlier files) and are not considered;
    - the layout the rest were saved under is this rank's config.yaml, or, for a rank
      without checkpoints, rank 0's (read before listing rank 0's checkpoints: rank 0
      rewrites it only after setting its own aside, so a config of the new layout comes
      with an empty folder);
    - on the same layout, the newest step every rank saved (`saved`: each rank's steps,
      from `gathered_steps`; default: read from the rank folders); if the ranks share none
      (one was stopped before its first save), the newest snapshot."""
    run_dir = os.path.dirname(output_dir)
    snapshot = _newest_snapshot(run_dir)
    after = snapshot[0] if snapshot else -1
    own = [(step, path) for step, path in list_checkpoints(output_dir) if step > after]
    reference = output_dir if own else os.path.join(run_dir, "rank_0")
    config_path = os.path.join(reference, layouts.CONFIG_FILE)
    recorded = (layouts.layout_config(config_path) if os.path.isfile(config_path)
                else None)
    listed = [step for step, _ in list_checkpoints(reference) if step > after]
    if recorded is None or not listed:
        return _from_snapshot(snapshot, output_dir, log)
    current, earlier = layouts.plan_layout(config), layouts.plan_layout(recorded)
    if same_layout(earlier, current):
        try:
            step = layouts.newest_common_step(run_dir, current.device_num, after, saved)
        except CheckpointError as err:
            if snapshot is None:
                raise CheckpointError(f"--resume: {err}") from None
            log(f"warning: {err}; every rank resumes from the newest snapshot")
            return _from_snapshot(snapshot, output_dir, log)
        if step < own[-1][0]:
            log(f"resuming from step {step}, the newest step every rank saved")
        return ResumePoint(step, dict(own)[step])
    path = _snapshot(run_dir, recorded, listed, after, log)
    _set_aside(output_dir, None, log)
    log(f"the layout changed from {earlier.describe()} ({earlier.device_num} ranks) to "
        f"{current.describe()} ({current.device_num} ranks): this rank's slices are cut "
        f"from {path} once the step is compiled")
    return ResumePoint(saved_step(layouts.rank_file(path, 0)), path, cut=True)


def _set_aside(output_dir: str, upto, log):
    """Rename this rank's checkpoints (up to step `upto`, or all) to `step_N.<layout>.ckpt`,
    the layout of its config.yaml (this rank writes it only once it resumed), so they are
    kept but never resumed from again."""
    config_path = os.path.join(output_dir, layouts.CONFIG_FILE)
    tag = (layout_tag(layouts.layout_config(config_path).parallel)
           if os.path.isfile(config_path) else "earlier-layout")
    moved = 0
    for step, path in list_checkpoints(output_dir):
        if upto is not None and step > upto:
            continue
        folder, extension = os.path.dirname(path), os.path.splitext(path)[1]
        name, suffix = os.path.join(folder, f"step_{step:08d}.{tag}{extension}"), 1
        while os.path.exists(name):   # the same layout set aside twice: keep both
            name = os.path.join(folder, f"step_{step:08d}.{tag}.{suffix}{extension}")
            suffix += 1
        os.replace(path, name)
        moved += 1
    if moved:
        log(f"renamed this rank's {moved} checkpoints of its earlier layout to "
            f"step_N.{tag}.ckpt")


def _snapshot(run_dir: str, recorded, listed: list, after: int, log) -> str:
    """The snapshot of the newest step all ranks of the `recorded` layout saved, written
    unless another rank's is already in place. `listed`: the steps this rank saw in its
    reference folder (after another rank set its files aside, only a snapshot of one of
    them will do)."""
    try:
        step = layouts.newest_common_step(run_dir, recorded.parallel.device_num, after)
    except CheckpointError as err:
        found = _newest_snapshot(run_dir)
        if found is not None and found[0] in listed:   # set aside after its snapshot
            return found[1]
        raise CheckpointError(f"--resume: the layout changed, and {err}") from None
    target = os.path.join(run_dir, SNAPSHOTS, f"step_{step:08d}")
    if not os.path.isdir(target):
        try:
            layouts.collect(run_dir, target, step, config=recorded)
            log(f"snapshot of step {step} of the earlier layout: {target}")
        except (OSError, UserInputError):
            if not os.path.isdir(target):   # not a race another rank won: a real error
                raise
    return target


def _newest_snapshot(run_dir: str):
    """(step, path) of the newest snapshot in the run, or None."""
    folder = os.path.join(run_dir, SNAPSHOTS)
    steps = sorted(int(name[5:]) for name in (os.listdir(folder) if os.path.isdir(folder)
                                              else [])
                   if name.startswith("step_") and name[5:].isdigit())
    return (steps[-1], os.path.join(folder, f"step_{steps[-1]:08d}")) if steps else None


def _from_snapshot(snapshot, output_dir: str, log) -> ResumePoint:
    if snapshot is None:
        raise CheckpointError(f"--resume: no checkpoint in {output_dir}/checkpoints, none in "
                              f"rank 0's and no {SNAPSHOTS}/ snapshot beside them")
    _set_aside(output_dir, snapshot[0], log)
    log(f"this rank resumes from the snapshot {snapshot[1]}: its slices are cut from it "
        f"once the step is compiled")
    return ResumePoint(snapshot[0], snapshot[1], cut=True)


def resumable_checkpoints(output_dir: str, context) -> list:
    """(step, path) of the checkpoints this rank may resume from, oldest first (sharded
    runs: `resume_point`). With several ranks, only up to the newest step every rank
    that saved any has: a kill or a full disk between two ranks' saves leaves them a step
    apart, and ranks that resumed apart would wait for each other forever. The ranks tell
    each other their steps (`gathered_steps`), so each reads only its own folder, and
    servers with local disks agree too. A data-parallel rank the run did not have yet
    resumes from another rank's checkpoints (data-parallel ranks hold the same state),
    which it must see: one server or shared storage."""
    own = list_checkpoints(output_dir)
    if not context.distributed:
        return own
    saved = [steps for steps in gathered_steps([step for step, _ in own], context.device_num)
             if steps]
    if not saved:
        raise CheckpointError(f"--resume: none of the {context.device_num} ranks has a "
                              f"checkpoint (this rank's folder: {output_dir})")
    common = set.intersection(*saved)
    if not common:
        raise CheckpointError(f"--resume: the {len(saved)} ranks that saved checkpoints "
                              f"share no checkpoint step")
    if not own:
        parent = os.path.dirname(output_dir)
        lenders = [rank for rank in range(context.device_num) if list_checkpoints(
            os.path.join(parent, f"rank_{rank}"))]
        if not lenders:
            raise CheckpointError(f"--resume: this rank has no checkpoint of its own and sees "
                                  f"no other rank's in {parent}: a resume on more ranks needs "
                                  f"the run's rank folders on one server or shared storage")
        own = list_checkpoints(os.path.join(parent, f"rank_{lenders[0]}"))
        log(f"this rank has no checkpoint of its own (the run had {len(saved)} ranks): it "
            f"resumes from rank {lenders[0]}'s, as data-parallel ranks hold the same state")
    if max(common) < own[-1][0]:
        log(f"resuming from step {max(common)}, the newest step every rank saved")
    return [(step, path) for step, path in own if step <= max(common)]


def resume_from_checkpoint(step_cell, output_dir: str, context) -> int:
    """Load the newest readable checkpoint of the run into `step_cell`; returns its step.
    Newer unreadable ones are renamed to `*.unreadable`, and only once an older one loaded."""
    for leftover in remove_partial_checkpoints(output_dir):
        log(f"removed {leftover}, left by an interrupted save")
    unreadable = []
    for _, path in reversed(resumable_checkpoints(output_dir, context)):
        try:
            load_weights(step_cell, path)
        except CheckpointError as err:
            unreadable.append((path, err))
            continue
        for bad, err in unreadable:
            if os.path.dirname(os.path.dirname(bad)) != output_dir:   # another rank's
                log(f"warning: {err}")
                continue
            os.replace(bad, bad + ".unreadable")
            log(f"warning: {err}; renamed it to {os.path.basename(bad)}.unreadable")
        step = int(step_cell.step.asnumpy())
        log(f"resuming from {path} (step {step})")
        return step
    raise CheckpointError(f"--resume: no readable checkpoint in {output_dir}/checkpoints; "
                          f"{unreadable[0][1]}")


def sharded_resume(output_dir: str, config, device_num: int) -> tuple:
    """(own checkpoint, snapshot to cut slices from, step) a semi-auto rank resumes from:
    its own checkpoint on the same layout (the snapshot None), else the run's snapshot of
    the earlier layout (its own checkpoint None). Loaded once the step is compiled
    (`restore_sliced`)."""
    saved = gathered_steps([step for step, _ in list_checkpoints(output_dir)], device_num)
    point = resume_point(output_dir, config, log, saved)
    if point.cut:
        return None, point.path, point.step
    return point.path, None, sharded_saved_step(point.path, point.step)


def sharded_saved_step(path: str, step: int) -> int:
    """The step of a sharded run's checkpoint. Its ranks must all resume from one step, so
    an unreadable file is not skipped on one rank alone (as `resume_from_checkpoint` does):
    the error says how to make every rank take the step before."""
    try:
        return saved_step(path)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; every rank resumes from the same step, so rename "
                              f"step_{step:08d}.* to *.unreadable in every rank folder's "
                              f"checkpoints/ and resume again from the step before") from None


def restore_sliced(compile_step, step_cell, network, config, rank: int, output_dir: str,
                   strategy_file: str, resume_path=None, resharded_from=None):
    """Semi-auto runs: parameters are cut into this rank's slices only when the step is
    compiled, so the step is compiled first (`compile_step()`, which writes the layout's
    strategy file) and the slices are loaded then, as MindFormers does (build the model,
    then load). Three sources:
    - --resume on the same layout (`resume_path`): the rank's own checkpoint;
    - --resume on another layout (`resharded_from`, `resume_point`): this rank's slices
      cut from a snapshot of the run, training state and step included;
    - train.init_checkpoint, a full checkpoint or a sliced directory of any layout: the
      model's weights only (not its optimizer state or step).
    Slices are cut by MindSpore's transform_checkpoint_by_rank (`layouts.rank_slices`).
    A rank holds, and must find, only the entries MindSpore laid out on it (with pipeline
    stages, its stage's). Only a cluster runs this path: MindSpore refuses semi-auto
    parallel on CPU."""
    compile_step()
    held = layouts.strategy_names(strategy_file)
    if resume_path:
        path, target, values = resume_path, step_cell, read_checkpoint(resume_path)
    else:
        source = resharded_from or config.train.init_checkpoint
        work = os.path.join(output_dir, "strategy")
        target_strategy = layouts.stage_strategy(strategy_file, config.parallel,
                                                 os.path.join(work, "merged_strategy.ckpt"))
        path = layouts.rank_slices(source, rank, target_strategy,
                                   os.path.join(work, "cut_slices.ckpt"))
        log(f"cut {source} into this rank's slices: {path}")
        values = read_checkpoint(path)
        if resharded_from:   # drop only the other stages' entries, passed whole
            target = step_cell
            laid_out = layouts.strategy_names(os.path.join(source, layouts.STRATEGY_FILE))
            values = {name: value for name, value in values.items()
                      if name in held or name not in laid_out}
        else:
            target = network
            values = {name: value for name, value in values.items() if name in held}
    not_loaded, _ = ms.load_param_into_net(target, values, strict_load=False)
    # scalars (the step, the loss scale) are in no strategy file, yet every rank has them
    parameters = target.parameters_dict()
    missing = [name for name in not_loaded if needed_from_checkpoints(name)
               and (name in held or math.prod(parameters[name].shape) <= 1)]
    if target is step_cell and missing:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: it lacks "
                              f"{len(missing)} parameters of this rank, e.g. {missing[0]!r}")
    log(f"loaded {path}" + (f"; left at their initialisation: {', '.join(missing)}"
                            if missing else ""))
