"""The model-folder contract: what `model_zoo/models/<name>/__init__.py` provides.

The trainer, the plan and the command line reach a model only through these names, so a
copy of a folder under a new name is a new model, with nothing to register. A folder's
`__init__.py` imports nothing heavy: its `HOOKS` dict maps each name to the submodule that
defines it (`lazy_hooks`), so `model-zoo --help` lists every folder's commands without importing
MindSpore, and a model's code is imported when one of its commands runs.

Required hooks are the members of `ModelFolder`; `OPTIONAL_HOOKS` are used when present.
`tests/test_models.py` checks every folder against both.
"""

import importlib
import inspect
import sys
from typing import Protocol


class ModelFolder(Protocol):
    """The hooks every model folder provides (`REQUIRED_HOOKS`)."""

    ModelConfig: type   # the `model` section: a model_zoo.config.ModelConfig subclass
    DataConfig: type    # the `data` section: a model_zoo.config.DataConfig subclass

    def build_train_network(self, config, compute_dtype):
        """The cell the trainer optimises: one batch (the dataset's columns) -> mean loss."""

    def create_train_dataset(self, config, shard, skip_batches: int = 0):
        """This rank's training batches (`shard`: a parallel.context.DataShard), resumable
        `skip_batches` in."""

    def prepare_data(self, config):
        """Build the dataset in `config.data.dataset_dir` unless it is already there."""

    def evaluate(self, config, network) -> dict:
        """Held-out metrics of a trained network (JSON-serialisable)."""

    def dataset_ready(self, config) -> bool:
        """Whether `config.data.dataset_dir` holds the dataset this config trains and
        evaluates on (False: none yet; DataError: one built with other settings)."""

    def plan_inputs(self, config, batch_size: int):
        """The training network's inputs for one micro batch as [(shape, dtype), ...], for
        `model-zoo plan`."""

    def add_commands(self, commands) -> None:
        """Add the folder's command-line verbs to `commands` (a cli.Commands): shared verbs
        that take a config (served by `run_<verb>`), and `model-zoo data|convert <name>`
        (served by `run_data_command` / `run_convert_command`). Argument definitions only:
        the module must import nothing heavy."""


REQUIRED_HOOKS = ("ModelConfig", "DataConfig") + tuple(
    name for name, value in vars(ModelFolder).items()
    if inspect.isfunction(value) and not name.startswith("_"))

OPTIONAL_HOOKS = {
    "batch_tokens": "batch_tokens(batch) -> int: real (unpadded) tokens of a batch, for the "
                    "throughput line (default: every position)",
    "sample_text": "sample_text(config, network) -> str: a sample printed after training",
    "create_heldout_dataset": "create_heldout_dataset(config, shard): this rank's held-out "
                              "batches in the training network's inputs, whole batches once; "
                              "a sharded run's evaluation (its held-out loss)",
    "inference_graphs": "inference_graphs(config, network, batch_size) -> {name: (cell, "
                        "example inputs)}: what `model-zoo export` writes as MindIR",
    "random_batch": "random_batch(config, batch_size, rng) -> [numpy arrays]: a valid batch "
                    "of random values in plan_inputs' columns, for `model-zoo dryrun "
                    "--check-numbers`",
    "run_data_command": "run_data_command(args): `model-zoo data <name>`",
    "run_convert_command": "run_convert_command(args): `model-zoo convert <name>`",
    "run_<verb>": "run_<verb>(config, ckpt, args) -> str: each shared verb add_commands adds",
}


# The user paths a folder keeps in its tasks.py: its HOOKS may declare them all at once as
# `dict.fromkeys(TASK_HOOKS, "tasks")`
TASK_HOOKS = ("build_train_network", "create_train_dataset", "prepare_data", "dataset_ready",
              "evaluate", "plan_inputs", "sample_text", "inference_graphs",
              "create_heldout_dataset", "random_batch")


def lazy_hooks(package: str, hooks: dict):
    """`__getattr__` and `__dir__` for a model folder's `__init__.py` (PEP 562).

    `hooks` declares every hook the folder provides: name -> "submodule" (the same name
    there) or "submodule:attribute", relative to `package`; the submodule is imported on the
    name's first use. Nothing is read or imported to list them, so a hook may be defined
    anywhere its submodule imports it from.
    """
    hooks = dict(hooks)

    def __getattr__(name):
        target = hooks.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        value = getattr(importlib.import_module(f".{module}", package), attribute or name)
        setattr(sys.modules[package], name, value)   # later uses skip __getattr__
        return value

    def __dir__():
        return sorted(hooks)

    return __getattr__, __dir__


def folder_name(module_name: str) -> str:
    """The model folder a module belongs to: `model_zoo.models.<name>.x` -> `<name>`, so a
    copied folder names itself (configs written by its converter, its default model.name)."""
    parts = module_name.split(".")
    return parts[parts.index("models") + 1]
