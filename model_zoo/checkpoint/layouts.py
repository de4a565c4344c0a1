"""Checkpoints that move between layouts: split a full checkpoint into per-rank slices,
merge slices back, re-slice for another layout, and say which rank holds what.

A sliced checkpoint directory holds what `ms.transform_checkpoints` reads and writes, plus
the config of its layout:

    DIR/config.yaml               the config whose parallel section is the layout
    DIR/strategy.ckpt             the layout's strategy file (`strategy_file.py`)
    DIR/rank_<i>/checkpoint_<i>.ckpt   rank i's slices (and the scalars every rank keeps)
    DIR/slices.json               each rank file's SHA-256, checked before any is read

The layouts come from the plan (`model-zoo plan`), so a layout is prepared and checked
without a cluster; the slicing itself is MindSpore's (`transform_checkpoints`), which the
tests hold against the plan's rank-to-slice mapping (`replication.device_piece`).
Results are written to a staging folder beside the output and renamed into place, so a
failed command leaves nothing behind.
"""

import contextlib
import dataclasses
import glob
import os
import shutil
import tempfile

from model_zoo.config import save_config
from model_zoo.errors import CheckpointError, UserInputError
from model_zoo.parallel.replication import device_piece, stage_of_rank
from model_zoo.parallel.strategy_file import (STRATEGY_FILE, laid_out_names, strategy_map,
                                             write_strategy_file)
from model_zoo.checkpoint.files import file_format_of, list_checkpoints, read_checkpoint
from model_zoo.files import read_json_or_none, sha256_of, write_json_atomically

CONFIG_FILE = "config.yaml"
PREFIX = "checkpoint_"
# In a directory `collect` made from a training run: its strategy.ckpt is the one MindSpore
# saved on the cluster, checked against the plan slice by slice instead of byte by byte
COLLECTED_FILE = "collected_from.txt"
# {rank file, relative to the directory: SHA-256}: MindSpore writes slices without its CRC
# and reads them without a check, so a flipped bit would merge or load silently
SLICES_FILE = "slices.json"


@dataclasses.dataclass
class SlicedLayout:
    """How a config's layout slices its checkpoints, as the plan derives it: the parallel
    section and, per parameter, its shape, split and stage (the plan's ParamInfo)."""

    config: object
    params: dict

    @property
    def parallel(self):
        return self.config.parallel

    @property
    def device_num(self) -> int:
        return self.parallel.device_num

    def describe(self) -> str:
        p = self.parallel
        return (f"dp{p.data_parallel} x mp{p.model_parallel} x pp{p.pipeline_stage}"
                + (" with optimizer shard" if p.optimizer_shard else ""))

    def slice_of(self, name: str, rank: int):
        """The index (tuple of slices) of checkpoint entry `name` that `rank` holds, None if
        the rank does not hold it, or () for an entry no strategy cuts (kept whole)."""
        base = laid_out_names(self.params, [name]).get(name)
        if base is None:
            return ()
        param = self.params[base]
        stage = stage_of_rank(rank, self.parallel)
        if stage != param.stage and stage not in param.used_on_stages:
            return None
        return device_piece(dataclasses.replace(param, stage=stage), self.parallel, rank)


def plan_layout(config) -> SlicedLayout:
    """The plan's layout of `config`; UserInputError naming the first rule it breaks."""
    from model_zoo.layout.network import usable_parameters
    return SlicedLayout(config, usable_parameters(config, "model-zoo checkpoint"))


def layout_config(path: str, overrides=()):
    """A config (from YAML plus `--set` overrides) whose layout is checked by the plan."""
    from model_zoo.config import load_config
    return load_config(path, list(overrides), layout_checked=False)


def rank_file(directory: str, rank: int) -> str:
    """Rank `rank`'s checkpoint in a sliced directory; CheckpointError if missing."""
    found = sorted(glob.glob(os.path.join(directory, f"rank_{rank}", "*.ckpt")))
    if not found:
        raise CheckpointError(f"{os.path.join(directory, f'rank_{rank}')}: no checkpoint of "
                              f"rank {rank}")
    return found[-1]   # the one transform_checkpoints reads (the last by name)


def record_slices(directory: str, device_num: int):
    """Write the SHA-256 of every rank file of a sliced directory (`SLICES_FILE`)."""
    files = [rank_file(directory, rank) for rank in range(device_num)]
    write_json_atomically(os.path.join(directory, SLICES_FILE), {
        os.path.relpath(path, directory): sha256_of(path) for path in files})


def check_slice_digests(directory: str, files):
    """CheckpointError naming the first of `files` (rank files of a sliced directory) whose
    bytes differ from the SHA-256 recorded when it was written. A directory written before
    the digests were recorded is read unchecked."""
    recorded = read_json_or_none(os.path.join(directory, SLICES_FILE))
    if recorded is None:
        return
    for path in files:
        expected = recorded.get(os.path.relpath(path, directory))
        if expected is not None and sha256_of(path) != expected:
            raise CheckpointError(f"{path}: its SHA-256 differs from the one recorded in "
                                  f"{os.path.join(directory, SLICES_FILE)} when it was "
                                  f"written: its bytes changed since (a flipped bit, a "
                                  f"damaged copy)")


def read_shapes(path: str) -> dict:
    """{name: shape} of a checkpoint file (its values are read, then dropped)."""
    return {name: tuple(value.shape) for name, value in read_checkpoint(path).items()}


def as_ckpt_file(path: str, ckpt_path: str) -> str:
    """`path` itself if it is a .ckpt file, else (safetensors) its entries written to
    `ckpt_path` as .ckpt: MindSpore's per-rank transform reads only that format."""
    if file_format_of(path) == "ckpt":
        return path
    import mindspore as ms
    ms.save_checkpoint(read_checkpoint(path), ckpt_path)
    return ckpt_path


def check_full_checkpoint(shapes: dict, layout: SlicedLayout, path: str):
    """CheckpointError unless the full checkpoint (`shapes`: its {name: shape}) holds every
    parameter of the layout's model with its shape."""
    for name, param in layout.params.items():
        if name not in shapes:
            raise CheckpointError(f"checkpoint {path!r} does not match the config's model: "
                                  f"it lacks {name!r}")
        if shapes[name] != tuple(param.shape):
            raise CheckpointError(f"checkpoint {path!r} does not match the config's model: "
                                  f"{name!r} has shape {shapes[name]}, the model "
                                  f"{tuple(param.shape)}")


def check_sliced(directory: str, layout: SlicedLayout) -> tuple:
    """Check a sliced directory against its layout before MindSpore reads it: a file for
    every rank, each readable, each slice of the shape the layout gives that rank. Returns
    the rank files and the names of every entry they hold (in rank order)."""
    files = [rank_file(directory, rank) for rank in range(layout.device_num)]
    check_slice_digests(directory, files)
    names = {}
    for rank, path in enumerate(files):
        shapes = read_shapes(path)
        names.update(dict.fromkeys(shapes))
        for name, shape in shapes.items():
            index = layout.slice_of(name, rank)
            if index is None or index == ():
                continue
            base = laid_out_names(layout.params, [name])[name]
            expected = tuple(len(range(*s.indices(n)))
                             for s, n in zip(index, layout.params[base].shape))
            if shape != expected:
                raise CheckpointError(
                    f"{path}: {name!r} has shape {shape}, but the layout in "
                    f"{os.path.join(directory, STRATEGY_FILE)} ({layout.describe()}) gives rank "
                    f"{rank} a slice of {expected}; the strategy does not match the checkpoints")
    return files, list(names)


@contextlib.contextmanager
def staged_output(path: str):
    """A staging folder beside `path`, renamed to `path` when the block succeeds and removed
    when it fails; `path` must not exist yet."""
    if os.path.exists(path):
        raise UserInputError(f"{path} already exists; choose another output or delete it")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_sliced(source_dir: str, source_strategy, layout: SlicedLayout, names,
                 output_dir: str):
    """Slice the checkpoints of `source_dir` (rank folders; `source_strategy` None for one
    full checkpoint in rank_0) for `layout` into a new sliced directory `output_dir`."""
    import mindspore as ms
    with staged_output(output_dir) as staging:
        strategy = write_strategy_file(os.path.join(staging, STRATEGY_FILE), layout.params,
                                       layout.parallel, names)
        save_config(layout.config, os.path.join(staging, CONFIG_FILE))
        ms.transform_checkpoints(source_dir, staging, PREFIX, source_strategy, strategy)
        record_slices(staging, layout.device_num)


def split(config, ckpt: str, output_dir: str) -> SlicedLayout:
    """`model-zoo checkpoint split`: a full checkpoint -> per-rank slices for config's layout."""
    layout = plan_layout(config)
    shapes = read_shapes(ckpt)
    check_full_checkpoint(shapes, layout, ckpt)
    with tempfile.TemporaryDirectory() as source:
        os.makedirs(os.path.join(source, "rank_0"))
        full = os.path.join(source, "rank_0", "full.ckpt")
        if as_ckpt_file(ckpt, full) == ckpt:
            os.symlink(os.path.abspath(ckpt), full)
        write_sliced(source, None, layout, list(shapes), output_dir)
    return layout


def sliced_layout(directory: str) -> SlicedLayout:
    """The layout of a sliced directory (its config.yaml), its strategy file checked."""
    for needed in (CONFIG_FILE, STRATEGY_FILE):
        if not os.path.isfile(os.path.join(directory, needed)):
            raise CheckpointError(f"{directory} is not a sliced checkpoint directory: "
                                  f"{needed} is missing (write one with `model-zoo checkpoint "
                                  f"split`)")
    layout = plan_layout(layout_config(os.path.join(directory, CONFIG_FILE)))
    if not os.path.isfile(os.path.join(directory, COLLECTED_FILE)):
        check_strategy_file(os.path.join(directory, STRATEGY_FILE), layout)
    return layout


def check_strategy_file(path: str, layout: SlicedLayout):
    """CheckpointError unless the strategy file at `path` is the one the layout gives for
    the entries it lists (a strategy of another model or layout would mis-slice)."""
    recorded = read_strategy(path)
    names = dict.fromkeys(_unstaged(item.param_name) for item in recorded.parallel_layout_item)
    expected = strategy_map(layout.params, layout.parallel, names)   # in the file's order
    if recorded.SerializeToString() != expected.SerializeToString():
        raise CheckpointError(f"{path} does not match the layout of "
                              f"{os.path.dirname(path) or '.'}/{CONFIG_FILE} "
                              f"({layout.describe()}): a strategy of another model or layout")


def transform(directory: str, output_dir: str, overrides=()) -> tuple:
    """`model-zoo checkpoint transform`: re-slice a sliced directory for the layout its
    config gets with `overrides`. Returns (source layout, target layout)."""
    source = sliced_layout(directory)
    target = plan_layout(layout_config(os.path.join(directory, CONFIG_FILE), overrides))
    if target.config.model != source.config.model:
        raise UserInputError("--set changed the model, not only the layout: a checkpoint "
                             "moves between layouts of one model")
    _, names = check_sliced(directory, source)
    write_sliced(directory, os.path.join(directory, STRATEGY_FILE), target, names, output_dir)
    return source, target


def merge(directory: str, output: str) -> SlicedLayout:
    """`model-zoo checkpoint merge`: a sliced directory -> one full checkpoint `output`."""
    import mindspore as ms
    layout = sliced_layout(directory)
    check_sliced(directory, layout)
    if os.path.exists(output):
        raise UserInputError(f"{output} already exists; choose another --output or delete it")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(output))) as work:
        ms.transform_checkpoints(directory, work, PREFIX,
                                 os.path.join(directory, STRATEGY_FILE), None)
        os.replace(rank_file(work, 0), output)
    return layout


def collect(run_dir: str, output_dir: str, step: int = 0, config=None) -> SlicedLayout:
    """`model-zoo checkpoint collect`: a sliced directory from a sharded training run's
    folders (`RUN/rank_<i>/checkpoints/step_N.ckpt`, the newest common step unless `step`):
    the run's config (`config`, or the one in rank_0), the strategy MindSpore saved there
    (with pipeline stages, the first rank of each stage's, merged by MindSpore's
    merge_pipeline_strategys) and each rank's checkpoint, hard-linked where the file system
    allows (safetensors files are rewritten as .ckpt, the format MindSpore's per-rank
    transform reads). The slices are then checked against the plan's layout of the run's
    config (`check_sliced`)."""
    import mindspore as ms
    if config is None:
        config_path = os.path.join(run_dir, "rank_0", CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{run_dir} is not the output of a sharded run: "
                                  f"{config_path} is missing")
        config = layout_config(config_path)
    layout = plan_layout(config)
    ranks = [os.path.join(run_dir, f"rank_{rank}") for rank in range(layout.device_num)]
    steps = [{found: path for found, path in list_checkpoints(rank)} for rank in ranks]
    step = step or newest_common_step(run_dir, layout.device_num)
    for rank, found in zip(ranks, steps):
        if step not in found:
            raise CheckpointError(f"{rank}/checkpoints: no checkpoint of step {step}")
    with staged_output(output_dir) as staging:
        save_config(config, os.path.join(staging, CONFIG_FILE))
        strategies = os.path.join(staging, ".strategies")
        os.makedirs(strategies)
        for stage in range(layout.parallel.pipeline_stage):
            first = ranks[stage * layout.parallel.devices_per_stage]
            source = os.path.join(first, "strategy", "param_strategy.ckpt")
            if not os.path.isfile(source):
                raise CheckpointError(f"{source} is missing: the strategy MindSpore saved "
                                      f"for stage {stage}")
            shutil.copy(source, os.path.join(strategies, f"stage_{stage}.ckpt"))
        if layout.parallel.pipeline_stage > 1:
            ms.merge_pipeline_strategys(strategies, os.path.join(staging, STRATEGY_FILE))
        else:
            shutil.copy(os.path.join(strategies, "stage_0.ckpt"),
                        os.path.join(staging, STRATEGY_FILE))
        shutil.rmtree(strategies)
        for rank, found in enumerate(steps):
            target = os.path.join(staging, f"rank_{rank}", f"{PREFIX}{rank}.ckpt")
            os.makedirs(os.path.dirname(target))
            if as_ckpt_file(found[step], target) == target:
                continue
            try:
                os.link(found[step], target)
            except OSError:
                shutil.copy(found[step], target)
        with open(os.path.join(staging, COLLECTED_FILE), "w", encoding="utf-8") as handle:
            handle.write(f"{os.path.abspath(run_dir)} step {step}\n")
        check_sliced(staging, layout)   # the training run's files pass their CRC
        record_slices(staging, layout.device_num)
    return layout


def steps_in_folders(run_dir: str, device_num: int) -> list:
    """The checkpoint steps in each of the rank folders 0..device_num-1 of a run (all
    visible here: one server or shared storage), one set per rank."""
    return [{step for step, _ in list_checkpoints(os.path.join(run_dir, f"rank_{rank}"))}
            for rank in range(device_num)]


def newest_common_step(run_dir: str, device_num: int, after: int = -1, saved=None) -> int:
    """The newest checkpoint step after `after` that ranks 0..device_num-1 of a run all
    saved; `saved`: the steps of each rank (default: read from their folders)."""
    if saved is None:
        saved = steps_in_folders(run_dir, device_num)
    common = set.intersection(*({step for step in steps if step > after} for steps in saved))
    if not common:
        raise CheckpointError(f"the {device_num} rank folders of {run_dir} share no "
                              f"checkpoint step")
    return max(common)


def read_strategy(path: str):
    """A strategy file as MindSpore's ParallelStrategyMap; CheckpointError if unreadable."""
    from mindspore.train import node_strategy_pb2
    strategy = node_strategy_pb2.ParallelStrategyMap()
    try:
        with open(path, "rb") as handle:
            strategy.ParseFromString(handle.read())
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and OSError
        raise CheckpointError(f"{path}: not a readable strategy file ({err})") from None
    return strategy


def _unstaged(name: str) -> str:
    """An entry's name without the "<stage>-" merge_pipeline_strategys puts before it."""
    return name.split("-", 1)[-1]


def strategy_names(path: str) -> set:
    """The entries a strategy file lays out (without the "<stage>-" of merged files)."""
    return {_unstaged(item.param_name) for item in read_strategy(path).parallel_layout_item}


def stage_strategy(strategy_file: str, parallel, output: str) -> str:
    """The strategy file a rank saved, in the form the transforms read: with pipeline
    stages MindSpore saves each stage's entries without their stage, and its transforms
    file those under stage 0, so the file is put through merge_pipeline_strategys (which
    names them "<stage>-<parameter>"). Without stages, the file as it is."""
    if parallel.pipeline_stage == 1:
        return strategy_file
    import mindspore as ms   # the transform then also passes other stages' entries whole:
    # load only the names the rank's file lists (`strategy_names`)
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(strategy_file, os.path.join(folder, "rank.ckpt"))
        ms.merge_pipeline_strategys(folder, output)
    return output


def rank_slices(source: str, rank: int, target_strategy: str, output: str) -> str:
    """Write to `output` rank `rank`'s slices, in the layout of `target_strategy`, of
    `source`: a full checkpoint file, or a sliced directory of any layout (written by split
    or transform). This is MindSpore's transform_checkpoint_by_rank, reading only the source
    ranks that hold pieces of this rank's slices (rank_list_for_transform); a semi-auto run
    loads the result once its step is compiled, as MindFormers' auto_trans_ckpt does."""
    import mindspore as ms
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    converted = os.path.splitext(output)[0] + ".source.ckpt"
    if os.path.isfile(source):
        files, source_strategy = {0: as_ckpt_file(source, converted)}, None
    else:
        sliced_layout(source)   # a sliced directory, its strategy matching its config
        source_strategy = os.path.join(source, STRATEGY_FILE)
        files = {r: rank_file(source, r)
                 for r in ms.rank_list_for_transform(rank, source_strategy, target_strategy)}
        check_slice_digests(source, files.values())
    ms.transform_checkpoint_by_rank(rank, files, output, source_strategy, target_strategy)
    if os.path.exists(converted):
        os.remove(converted)
    return output


def inspect(path: str) -> list:
    """`model-zoo checkpoint inspect`: one line per entry of a checkpoint file, or of a
    sliced directory (with the full shape and which ranks hold which slice)."""
    if os.path.isfile(path):
        return [f"{name}  {tuple(value.shape)}  {value.dtype}"
                for name, value in read_checkpoint(path).items()]
    layout = sliced_layout(path)
    holders = {}
    for rank, rank_path in enumerate(check_sliced(path, layout)[0]):
        for name, value in read_checkpoint(rank_path).items():
            index = layout.slice_of(name, rank)
            if index is None:
                continue
            entry = holders.setdefault(name, {"dtype": value.dtype, "ranks": {}})
            where = "whole" if index == () else "[" + ", ".join(
                f"{s.start}:{s.stop}" for s in index) + "]"
            entry["ranks"].setdefault(where, []).append(rank)
    lines = [f"{path}: {layout.describe()}, {layout.device_num} ranks"]
    for name, entry in holders.items():
        base = laid_out_names(layout.params, [name]).get(name)
        shape = tuple(layout.params[base].shape) if base else "scalar"
        pieces = "; ".join(f"{where} on ranks {_ranges(ranks)}"
                           for where, ranks in entry["ranks"].items())
        lines.append(f"{name}  {shape}  {entry['dtype']}  {pieces}")
    return lines


def _ranges(ranks: list) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(f"{start}-{rank}" if rank > start else f"{start}")
            start = None
    return ",".join(parts)

