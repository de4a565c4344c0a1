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
As there, every rank folder must be visible to every rank (one server or shared storage).
Only a cluster runs the sharded path; the tests run steps 1-3 on the files of a cluster run.
"""

import dataclasses
import os

from model_zoo.errors import CheckpointError, UserInputError
from model_zoo.parallel import checkpoints
from model_zoo.train.checkpoint import list_checkpoints, saved_step

SNAPSHOTS = "earlier_layouts"


@dataclasses.dataclass
class ResumePoint:
    """Where a rank of a changed layout resumes: the sliced directory (of another layout)
    to cut its slices from, and its step."""

    step: int
    path: str


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


def resume_point(output_dir: str, config, log):
    """Where the rank whose folder is `output_dir` resumes a sharded run with `config`'s
    layout: None when its checkpoints are of that layout (resumed as they are), else a
    ResumePoint, after steps 1 and 2 of the module docstring.

    The layout the checkpoints were saved under is this rank's config.yaml, or, for a rank
    the earlier layout did not have, rank 0's (read before listing its checkpoints: rank 0
    rewrites it only after renaming its checkpoints, so a config of the new layout comes
    with an empty folder)."""
    run_dir = os.path.dirname(output_dir)
    own = list_checkpoints(output_dir)
    reference = output_dir if own else os.path.join(run_dir, "rank_0")
    config_path = os.path.join(reference, checkpoints.CONFIG_FILE)
    recorded = (checkpoints.layout_config(config_path) if os.path.isfile(config_path)
                else None)
    if recorded is None or not list_checkpoints(reference):
        return _from_newest_snapshot(run_dir, output_dir, log)
    current = checkpoints.plan_layout(config)
    earlier = checkpoints.plan_layout(recorded)
    if same_layout(earlier, current):
        if not own:
            raise CheckpointError(f"--resume: {output_dir}/checkpoints is empty, but rank 0 "
                                  f"has checkpoints of this layout; was the folder removed?")
        return None
    snapshot = _snapshot(run_dir, recorded, log)
    for step, path in own:
        os.replace(path, _set_aside_name(path, step, recorded.parallel))
    if own:
        log(f"renamed this rank's {len(own)} checkpoints of {earlier.describe()} to "
            f"step_N.{layout_tag(recorded.parallel)}.ckpt")
    log(f"the layout changed from {earlier.describe()} ({earlier.device_num} ranks) to "
        f"{current.describe()} ({current.device_num} ranks): this rank's slices are cut "
        f"from {snapshot} once the step is compiled")
    return ResumePoint(saved_step(checkpoints.rank_file(snapshot, 0)), snapshot)


def _set_aside_name(path: str, step: int, parallel) -> str:
    folder, extension = os.path.dirname(path), os.path.splitext(path)[1]
    name = os.path.join(folder, f"step_{step:08d}.{layout_tag(parallel)}{extension}")
    suffix = 1
    while os.path.exists(name):   # the same layout left aside twice: keep both
        name = os.path.join(folder, f"step_{step:08d}.{layout_tag(parallel)}.{suffix}"
                                    f"{extension}")
        suffix += 1
    return name


def _snapshot(run_dir: str, recorded, log) -> str:
    """The snapshot of the run's newest step all ranks of the `recorded` layout saved,
    written unless another rank's is already in place."""
    try:
        step = checkpoints.newest_common_step(run_dir, recorded.parallel.device_num)
    except CheckpointError:
        step = None   # another rank renamed its files already: its snapshot is in place
    if step is not None:
        target = os.path.join(run_dir, SNAPSHOTS, f"step_{step:08d}")
        if os.path.isdir(target):
            return target
        try:
            checkpoints.collect(run_dir, target, step, config=recorded)
            log(f"snapshot of step {step} of the earlier layout: {target}")
            return target
        except (OSError, UserInputError):   # lost the race, or files renamed under us
            pass
    newest = _newest_snapshot(run_dir)
    if newest is None:
        raise CheckpointError(f"--resume: cannot collect the checkpoints of {run_dir} "
                              f"for the new layout, and no {SNAPSHOTS}/ snapshot is there")
    return newest


def _newest_snapshot(run_dir: str):
    folder = os.path.join(run_dir, SNAPSHOTS)
    steps = sorted(name for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if name.startswith("step_") and name[5:].isdigit())
    return os.path.join(folder, steps[-1]) if steps else None


def _from_newest_snapshot(run_dir: str, output_dir: str, log) -> ResumePoint:
    snapshot = _newest_snapshot(run_dir)
    if snapshot is None:
        raise CheckpointError(f"--resume: no checkpoint in {output_dir}/checkpoints, none in "
                              f"rank 0's and no {SNAPSHOTS}/ snapshot in {run_dir}")
    log(f"this rank has no checkpoint of the current layout: its slices are cut from "
        f"{snapshot} once the step is compiled")
    return ResumePoint(saved_step(checkpoints.rank_file(snapshot, 0)), snapshot)
