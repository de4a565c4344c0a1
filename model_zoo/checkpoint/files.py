"""Checkpoints: atomic saves, keeping the last few, finding the newest, loading weights.

A training checkpoint holds every parameter of the train step (the model, the optimizer
moments, the loss scale and the step) but the buffers that are zeros between steps
(`contents.saved_in_checkpoints`), so `--resume` restarts exactly where a run stopped.
"""

import contextlib
import glob
import logging
import os
import re
import shutil

import mindspore as ms

from model_zoo.config import import_model
from model_zoo.checkpoint.contents import (STEP_COUNTER, needed_from_checkpoints,
                                           saved_in_checkpoints)
from model_zoo.errors import CheckpointError, DataError, DiskError
from model_zoo.files import check_file
from model_zoo.nn.layers import dtype_of

CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)\.(ckpt|safetensors)$")


def checkpoint_path(output_dir: str, step: int, file_format: str = "ckpt") -> str:
    return os.path.join(output_dir, "checkpoints", f"step_{step:08d}.{file_format}")


def file_format_of(path: str) -> str:
    """The MindSpore format of a checkpoint file, from its name (load_checkpoint needs it)."""
    return "safetensors" if str(path).endswith(".safetensors") else "ckpt"


def list_checkpoints(output_dir: str):
    """(step, path) of every complete checkpoint in a run's output dir, oldest first."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoints", "step_*")):
        match = CHECKPOINT_PATTERN.match(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(cell, output_dir: str, step: int, keep: int, sliced: bool = False,
                    file_format: str = "ckpt") -> str:
    """Save `cell`'s parameters for `step`: write a temporary file, then rename it into place.

    A crash mid-save leaves the previous checkpoints intact; only the newest `keep` are kept.
    A save that fails (a full disk) removes its partial files and raises DiskError.
    `sliced` (semi-auto parallel): each rank saves only its own slices, described by the
    run's strategy file, instead of gathering whole parameters on every rank (MindFormers'
    CheckpointMonitor turns integrated_save off for semi-auto runs the same way).
    `file_format`: "ckpt" or "safetensors" (train.checkpoint_format).
    """
    path = checkpoint_path(output_dir, step, file_format)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        # MindSpore writes step_N.tmp.tmp and renames it to step_N.tmp.ckpt (serialization.py
        # _exec_save); the final name appears only once the file is whole. A failure is
        # reported below as one line, without MindSpore's CRITICAL log of it
        with silent_logging():
            # crc_check: MindSpore's own checksum of the file, verified on every load
            ms.save_checkpoint(cell, partial_path(path), integrated_save=not sliced,
                               choice_func=saved_in_checkpoints, format=file_format,
                               crc_check=True)
        os.replace(partial_path(path), path)
    except OSError as err:
        remove_partial_checkpoints(output_dir)
        needed = sum(param.data.nbytes for param in cell.get_parameters())
        free = shutil.disk_usage(os.path.dirname(path)).free
        then = ("the older checkpoints are kept, free some space and continue with --resume"
                if list_checkpoints(output_dir) else
                "no checkpoint was saved before it, so free some space and start the run "
                "again (without --resume)")
        raise DiskError(f"cannot save the step {step} checkpoint in {os.path.dirname(path)}: "
                        f"{err.strerror or err} (it needs {megabytes(needed)}, "
                        f"{megabytes(free)} free); {then}") from None
    for _, old in list_checkpoints(output_dir)[:-keep]:
        os.remove(old)
    return path


@contextlib.contextmanager
def silent_logging():
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def partial_path(path: str) -> str:
    """Where `save_checkpoint` writes the checkpoint `path` before renaming it."""
    stem, extension = os.path.splitext(path)
    return stem + ".tmp" + extension


def remove_partial_checkpoints(output_dir: str) -> list:
    """Remove the temporary files of interrupted or failed saves; returns their paths."""
    leftovers = glob.glob(os.path.join(output_dir, "checkpoints", "step_*.tmp.*"))
    for leftover in leftovers:
        os.remove(leftover)
    return leftovers


def megabytes(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def read_checkpoint(path: str) -> dict:
    """Parameters of a checkpoint file; CheckpointError if it is missing, unreadable, or
    fails the checksum it was saved with (a file saved without one loads unchecked)."""
    check_file(path, "checkpoint", CheckpointError, empty_ok=False)
    try:
        with silent_logging():
            return ms.load_checkpoint(path, format=file_format_of(path), crc_check=True)
    except Exception as err:  # MindSpore raises ValueError/RuntimeError on bad files
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    try:   # whole but for its values: what a checksum catches and a parser does not
        with silent_logging():
            ms.load_checkpoint(path, format=file_format_of(path))
    except Exception:  # noqa: BLE001 - not even parsable: the first error says why
        if "permission" in first_line and os.access(path, os.R_OK):
            # MindSpore's guess for any unparsable file; this one can be read
            first_line = ("its content is not a checkpoint MindSpore can parse (damaged "
                          "bytes, or another kind of file)")
        raise CheckpointError(f"checkpoint {path!r} cannot be read: {first_line}") from None
    raise CheckpointError(f"checkpoint {path!r} fails the checksum it was saved with: its "
                          f"bytes changed since (a flipped bit, a damaged copy)") from None


def saved_step(path: str) -> int:
    """The train step a checkpoint was saved at, read without loading its weights."""
    check_file(path, "checkpoint", CheckpointError, empty_ok=False)
    try:
        with silent_logging():
            values = ms.load_checkpoint(path, choice_func=lambda name: name == STEP_COUNTER,
                                        format=file_format_of(path), crc_check=True)
        return int(values[STEP_COUNTER].asnumpy())
    except Exception as err:  # noqa: BLE001 - MindSpore's errors on bad files, a KeyError
        raise CheckpointError(f"checkpoint {path!r} holds no readable step counter "
                              f"({type(err).__name__})") from None


def load_weights(network, path: str, strict: bool = True) -> list:
    """Load a checkpoint's values into `network`; returns the names of the parameters the
    file lacked (empty when strict).

    Names and shapes must match the network's parameters. With `strict`, a parameter the
    file lacks is an error, and so is one the network lacks (the file is of a bigger model),
    training state (optimizer moments, loss scale, step counters) excepted; without it, at
    least one parameter must match and the rest is ignored.
    """
    values = read_checkpoint(path)
    # keyed like the file: by each parameter's own name, which is not its attribute path
    # for cells built with auto_prefix=False (the train step's optimizer and loss-scale state)
    expected = {param.name: param for param in network.get_parameters()
                if saved_in_checkpoints(param.name)}
    missing = [name for name in expected if name not in values and needed_from_checkpoints(name)]
    if strict and missing:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: it lacks "
                              f"{len(missing)} parameters, e.g. {missing[0]!r}")
    extra = [name for name in values
             if name not in expected and not is_training_state(name, values)]
    if strict and extra:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: it holds "
                              f"{len(extra)} parameters the model lacks, e.g. {extra[0]!r} (a "
                              f"checkpoint of a bigger model?)")
    for name, param in expected.items():
        if name in values and tuple(values[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"checkpoint {path!r} does not match the model: {name!r} has shape "
                f"{tuple(values[name].shape)} in the file and {tuple(param.shape)} in the model")
    if len(missing) == len(expected):
        raise CheckpointError(f"checkpoint {path!r} holds none of the model's parameters "
                              f"(e.g. {next(iter(expected))!r})")
    ms.load_param_into_net(network, {k: v for k, v in values.items() if k in expected},
                           strict_load=False)
    return missing


def is_training_state(name: str, values: dict) -> bool:
    """True for what a train step adds to a checkpoint: scalars without a dotted path
    (loss_scale, global_step) and an optimizer's per-parameter state, named `<state>.<name>`
    after a parameter `<name>` of the same file (adam_m.lm.head.weight)."""
    state, _, parameter = name.partition(".")
    return not parameter or parameter in values


def load_network(config, ckpt: str):
    """The training network of the config's model folder with the weights of checkpoint
    `ckpt`, in eval mode (what `eval` and the folders' verbs run)."""
    module = import_model(config.model.name)
    return load_for_evaluation(module.build_train_network(config, dtype_of(config.train.precision)),
                               ckpt)


def evaluate_checkpoint(config, ckpt: str) -> dict:
    """`model-zoo eval CONFIG --ckpt FILE`: the model folder's held-out metrics of `ckpt`."""
    module = import_model(config.model.name)
    if not module.dataset_ready(config):
        raise DataError(f"no held-out data in {config.data.dataset_dir}: train once, or build "
                        f"it with `model-zoo data {config.model.name}`")
    return module.evaluate(config, load_network(config, ckpt))


def load_for_evaluation(network, path: str):
    """`network` with the weights of checkpoint `path` (strict), in eval mode (no dropout)."""
    load_weights(network, path)
    network.set_train(False)
    return network
