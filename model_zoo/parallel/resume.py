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
   included (`trainer.restore_sliced`).

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
import os

from model_zoo.errors import CheckpointError, UserInputError
from model_zoo.parallel import checkpoints
from model_zoo.train.checkpoint import list_checkpoints, saved_step

SNAPSHOTS = "earlier_layouts"
RESUME_CANDIDATES = 64   # newest checkpoint steps each rank tells the others it holds


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


def same_layout(a: checkpoints.Layout, b: checkpoints.Layout) -> bool:
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
    from mindspore import Tensor, ops
    offered = np.full(RESUME_CANDIDATES, -1, np.int32)   # -1: no step
    newest = sorted(own_steps)[-RESUME_CANDIDATES:]
    offered[:len(newest)] = newest
    rows = ops.AllGather()(Tensor(offered)).asnumpy().reshape(device_num, RESUME_CANDIDATES)
    return [{int(step) for step in row if step >= 0} for row in rows]


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
    config_path = os.path.join(reference, checkpoints.CONFIG_FILE)
    recorded = (checkpoints.layout_config(config_path) if os.path.isfile(config_path)
                else None)
    listed = [step for step, _ in list_checkpoints(reference) if step > after]
    if recorded is None or not listed:
        return _from_snapshot(snapshot, output_dir, log)
    current, earlier = checkpoints.plan_layout(config), checkpoints.plan_layout(recorded)
    if same_layout(earlier, current):
        try:
            step = checkpoints.newest_common_step(run_dir, current.device_num, after, saved)
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
    return ResumePoint(saved_step(checkpoints.rank_file(path, 0)), path, cut=True)


def _set_aside(output_dir: str, upto, log):
    """Rename this rank's checkpoints (up to step `upto`, or all) to `step_N.<layout>.ckpt`,
    the layout of its config.yaml (this rank writes it only once it resumed), so they are
    kept but never resumed from again."""
    config_path = os.path.join(output_dir, checkpoints.CONFIG_FILE)
    tag = (layout_tag(checkpoints.layout_config(config_path).parallel)
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
        step = checkpoints.newest_common_step(run_dir, recorded.parallel.device_num, after)
    except CheckpointError as err:
        found = _newest_snapshot(run_dir)
        if found is not None and found[0] in listed:   # set aside after its snapshot
            return found[1]
        raise CheckpointError(f"--resume: the layout changed, and {err}") from None
    target = os.path.join(run_dir, SNAPSHOTS, f"step_{step:08d}")
    if not os.path.isdir(target):
        try:
            checkpoints.collect(run_dir, target, step, config=recorded)
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
