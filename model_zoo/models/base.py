"""The model-folder contract: what `model_zoo/models/<name>/` provides.

The trainer, the plan and the command line reach a model through two modules of its folder,
found by the folder's name, so a copy of a folder under a new name is a new model, with
nothing to register:
- `commands.py`, the folder's part of the command line (`FolderCommands`): argument
  definitions only, imported to build the parser, so `model-zoo --help` imports neither
  MindSpore nor a model's code;
- `tasks.py`, its hooks (`ModelFolder`, and `OPTIONAL_HOOKS` when present): plain names,
  defined there or bound there from shared code (`evaluate = tasks.evaluate`), imported
  when a command needs the model (`config.import_model`), and called by name
  (`folder.build_train_network(...)`, `folder.run_generate(...)`).
The folder's `__init__.py` holds only its docstring. `tests/test_models.py` checks every
folder against the contract.
"""

import inspect
from typing import Protocol


class FolderCommands(Protocol):
    """A folder's `commands.py`: what it adds to the command line."""

    # which of `model-zoo data <name>` ("data": the hooks add_data_arguments and
    # run_data_command) and `model-zoo convert <name>` ("convert": add_convert_arguments and
    # run_convert_command) the folder serves
    SUBCOMMANDS: tuple

    def add_commands(self, commands) -> None:
        """Add the folder's verbs, the commands that take a config, to `commands` (a
        cli.Commands): `commands.verb(name, help, run)`, whose `run(folder, config, args)`
        calls the folder's hook by name, e.g. `folder.run_generate(config, args.ckpt,
        args)`, and returns the text to print."""


class ModelFolder(Protocol):
    """The hooks every model folder's `tasks.py` provides (`REQUIRED_HOOKS`)."""

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
    "add_data_arguments": "add_data_arguments(parser): the arguments of `model-zoo data "
                          "<name>`, when commands.SUBCOMMANDS has \"data\"",
    "run_data_command": "run_data_command(args): `model-zoo data <name>`",
    "add_convert_arguments": "add_convert_arguments(parser): the arguments of `model-zoo "
                             "convert <name>`, when commands.SUBCOMMANDS has \"convert\"",
    "run_convert_command": "run_convert_command(args): `model-zoo convert <name>`",
    "run_<verb>": "run_<verb>(config, ckpt, args) -> str: what a verb of add_commands calls "
                  "(run_generate, run_fill_mask, run_translate)",
}


def folder_name(module_name: str) -> str:
    """The model folder a module belongs to: `model_zoo.models.<name>.x` -> `<name>`, so a
    copied folder names itself (configs written by its converter, its default model.name)."""
    parts = module_name.split(".")
    return parts[parts.index("models") + 1]
