"""The `model-zoo` command: train, eval, plan, dryrun, advise, checkpoint, rank-table, data,
convert, and the verbs the model folders add (generate, fill-mask, translate).

Commands that take a config are served by the model folder the config names: `model-zoo
eval CONFIG` runs that folder's `evaluate`, `model-zoo generate CONFIG` its
`run_generate`, so a copied folder brings its commands with it (model_zoo/models/base.py).
Building the parser imports only the folders' light `commands` modules; a model's code,
MindSpore and the plan are imported when a command that needs them runs, so
`model-zoo rank-table ...` (run by the launch scripts on every server) starts at once.
"""

import argparse
import json
import os
import signal
import sys
from typing import Optional

from model_zoo.config import (add_overrides_argument, available_models, import_model,
                              import_model_commands, load_config)
from model_zoo.errors import UserInputError
from model_zoo.launch.local import use_rank_workdirs
from model_zoo.launch.rank_table import add_rank_table_arguments, run_rank_table_command
from model_zoo.checkpoint.command import add_checkpoint_arguments
from model_zoo.dryrun.command import add_dryrun_arguments
from model_zoo.plan.command import add_advise_arguments, add_plan_arguments
from model_zoo.train.interrupt import Stopped, raise_dropped_stop, stop_at_once

MODEL_SUBCOMMANDS = {"data": "build a model's dataset from text files",
                     "convert": "import a Hugging Face checkpoint"}


class Commands:
    """What a model folder's `add_commands` adds to: verbs that take a config."""

    def __init__(self, subparsers):
        self.subparsers = subparsers
        self.verbs = {}   # name -> run(folder, config, args)

    def verb(self, name: str, help_text: str, run) -> Optional[argparse.ArgumentParser]:
        """`model-zoo NAME CONFIG ...`: for a config of this folder it prints `run(folder,
        config, args)`, `folder` being the folder's hooks (its tasks.py) and `run` calling
        the one it needs by name, e.g. `folder.run_generate(config, args.ckpt, args)`.
        Returns the parser to add the verb's arguments to, or None when another folder added
        the verb already: folders that share a verb (a copied folder and its original) take
        the same arguments."""
        if name in self.verbs:
            return None
        self.verbs[name] = run
        parser = self.subparsers.add_parser(name, help=help_text)
        add_config_arguments(parser)
        return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="model-zoo", description="Train and use the models of the MindSpore model zoo.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a model from a YAML config")
    add_config_arguments(train)
    train.add_argument("--output-dir", help="where checkpoints, metrics.jsonl, the resolved "
                                            "config and the loss curve go "
                                            "(default: outputs/<config name>)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in --output-dir")
    train.add_argument("--verify-data", action="store_true",
                       help="check every dataset file against the SHA-256 recorded when it "
                            "was built (sizes are always checked)")
    train.add_argument("--data-url", "--data_url", dest="data_url",
                       help="cloud job: dataset location (copied in with moxing when it is "
                            "installed, else a path used as data.dataset_dir)")
    train.add_argument("--train-url", "--train_url", dest="train_url",
                       help="cloud job: output location (outputs copied out with moxing "
                            "after each checkpoint, else a path used as --output-dir)")

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on held-out data (JSON)")
    add_config_arguments(evaluate)
    evaluate.add_argument("--ckpt", required=True, help="checkpoint file")

    export = commands.add_parser("export", help="a checkpoint as MindIR graphs for inference")
    add_config_arguments(export)
    export.add_argument("--ckpt", required=True, help="checkpoint file")
    export.add_argument("--batch-size", type=int, default=1,
                        help="the batch the graphs are compiled for (default 1)")
    export.add_argument("--output", default="",
                        help="the .mindir file (default: beside the checkpoint); a model with "
                             "several graphs writes <output stem>_<graph>.mindir each")

    registry = Commands(commands)
    subcommands = {}   # model -> the MODEL_SUBCOMMANDS its folder serves
    for model in available_models():
        try:   # a half-edited folder must not break the other commands (rank-table, plan)
            folder = import_model_commands(model)
            folder.add_commands(registry)
            subcommands[model] = folder.SUBCOMMANDS
        except Exception as err:  # noqa: BLE001 - reported, then the folder is skipped
            print(f"warning: model folder {model!r} is skipped: {type(err).__name__}: {err}",
                  file=sys.stderr)

    for name, help_text in MODEL_SUBCOMMANDS.items():
        serving = [model for model, served in subcommands.items() if name in served]
        command = commands.add_parser(
            name, help=help_text,
            description=f"{help_text}; `model-zoo {name} MODEL --help` lists the model's "
                        f"arguments")
        command.add_argument("model", choices=serving, metavar="MODEL",
                             help=f"one of: {', '.join(serving)}")
        command.add_argument("arguments", nargs=argparse.REMAINDER,
                             help="the model's own arguments")

    add_rank_table_arguments(commands.add_parser(
        "rank-table", help="generate, validate and merge HCCL rank tables (no config needed)"))
    add_checkpoint_arguments(commands.add_parser(
        "checkpoint", help="split, merge, transform and inspect checkpoints across parallel "
                           "layouts (no cluster needed)"))
    add_plan_arguments(commands.add_parser(
        "plan", help="check a parallel layout offline: every operator strategy, memory per "
                     "device, communication per step"))
    add_dryrun_arguments(commands.add_parser(
        "dryrun", help="compile a layout's train step with MindSpore's own semi-auto parallel "
                       "for chosen ranks (no Ascend needed) and hold it against the plan"))
    add_advise_arguments(commands.add_parser(
        "advise", help="rank every layout of a model on N devices by predicted throughput "
                       "(offline)"))
    return parser


def add_config_arguments(parser):
    parser.add_argument("config", help="YAML config, e.g. model_zoo/models/gpt2/configs/tiny.yaml")
    add_overrides_argument(parser)


def folder_verbs(model: str) -> dict:
    """The verbs model folder `model` adds: name -> run (`Commands.verb`)."""
    registry = Commands(argparse.ArgumentParser().add_subparsers())
    import_model_commands(model).add_commands(registry)
    return registry.verbs


def run_model_subcommand(command: str, model: str, arguments) -> int:
    """`model-zoo data|convert MODEL ...`: the model folder parses its own arguments."""
    folder = import_model(model)
    parser = argparse.ArgumentParser(prog=f"model-zoo {command} {model}",
                                     description=MODEL_SUBCOMMANDS[command])
    if command == "convert":
        folder.add_convert_arguments(parser)
        folder.run_convert_command(parser.parse_args(arguments))
        return 0
    folder.add_data_arguments(parser)
    parsed = parser.parse_args(arguments)
    if getattr(parsed, "output_dir", None):
        # one build per directory at a time, as training's own builds
        from model_zoo.data.manifest import building
        with building(parsed.output_dir):
            folder.run_data_command(parsed)
    else:
        folder.run_data_command(parsed)
    return 0


def run(args) -> int:
    if args.command == "rank-table":
        return run_rank_table_command(args)
    if args.command == "plan":
        from model_zoo.plan.command import run_plan_command
        return run_plan_command(args)
    if args.command == "dryrun":
        from model_zoo.dryrun.command import run_dryrun_command
        return run_dryrun_command(args)
    if args.command == "advise":
        from model_zoo.plan.command import run_advise_command
        return run_advise_command(args)
    if args.command == "checkpoint":
        from model_zoo.checkpoint.command import run_checkpoint_command
        return run_checkpoint_command(args)
    if args.command in MODEL_SUBCOMMANDS:
        return run_model_subcommand(args.command, args.model, args.arguments)
    config = load_config(args.config, args.overrides)
    if args.command != "train":   # training sets it with its parallel context
        from model_zoo.parallel.context import set_run_context
        set_run_context(config.train.device_target)
    if args.command == "train":
        from model_zoo.train.cloud import CloudStorage
        from model_zoo.train.trainer import default_output_dir, train
        if args.train_url and args.output_dir:
            raise UserInputError("give --output-dir or --train-url, not both")
        from model_zoo.parallel.context import launched_ranks
        from model_zoo.train.interrupt import TooManyBadSteps, TrainingInterrupted
        storage = CloudStorage(args.data_url, args.train_url)
        output_dir = storage.prepare(config, args.output_dir or default_output_dir(args.config),
                                     args.resume)
        try:
            train(config, output_dir, resume=args.resume, on_save=storage.upload,
                  verify_data=args.verify_data)
        except TrainingInterrupted as stopped:
            if stopped.agreed and launched_ranks() > 1:
                from model_zoo.parallel.context import wait_for_every_rank
                wait_for_every_rank(launched_ranks())
            overrides = "".join(f" --set {override}" for override in args.overrides)
            failed = isinstance(stopped, TooManyBadSteps)
            again = (f"model-zoo train {args.config}{overrides} --output-dir {output_dir} "
                     f"--resume" if launched_ranks() == 1 else
                     "the launch command again with --resume (the launcher prints it)")
            print(f"{'error: ' if failed else ''}{stopped}; continue with: {again}",
                  file=sys.stderr if failed else sys.stdout, flush=True)
            return stopped.exit_status
    elif args.command == "export":
        from model_zoo.train.export import export_checkpoint
        for name, path in export_checkpoint(config, args.ckpt, args.batch_size,
                                            args.output).items():
            print(f"{name}: {path}")
    elif args.command == "eval":
        from model_zoo.checkpoint.files import evaluate_checkpoint
        print(json.dumps(evaluate_checkpoint(config, args.ckpt)))
    else:   # a verb of the model folders: run by the config's folder
        verbs = folder_verbs(config.model.name)
        if args.command not in verbs:
            raise UserInputError(f"model {config.model.name!r} has no `{args.command}` "
                                 f"command")
        print(verbs[args.command](import_model(config.model.name), config, args))
    return 0


def main(argv=None) -> int:
    use_rank_workdirs()   # an msrun worker's own CANN folders, before MindSpore loads
    args = build_parser().parse_args(argv)
    stop_at_once()   # until the training loop installs its own handlers
    try:
        status = run(args)
        raise_dropped_stop()
        return status
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MemoryError as err:   # numpy's, building weights far too large for this machine
        print(f"error: out of memory: {err}; a smaller model, batch or sequence would fit "
              f"(`model-zoo plan CONFIG` estimates what a layout needs)", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as stop:
        exit_stopped(getattr(stop, "signum", signal.SIGINT))
    except Exception as err:   # noqa: BLE001 - a stop inside a C extension's import
        stop = stop_behind(err)
        if stop is None:
            raise
        exit_stopped(stop.signum)


def stop_behind(err: BaseException) -> Optional[Stopped]:
    """The Stopped an exception was raised from, if any: a signal while a C extension
    module initialises (MindSpore's dataset engine) comes back as its ImportError."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, Stopped):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def exit_stopped(signum: int):
    """The one line of a command stopped by a signal, then exit 128 + the signal at once:
    the cleanups ran on the way here, and a signal that stopped an import of MindSpore
    leaves modules half made, whose exit hooks would fail after the line (tracebacks,
    "Fatal Python error", SIGABRT)."""
    print(f"error: stopped by {signal.Signals(signum).name}; nothing was saved beyond "
          f"what was already written (a dataset build resumes where it stopped)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)
