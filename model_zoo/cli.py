"""The `model-zoo` command: train, eval, generate, fill-mask, translate, data, convert, rank-table.

Model-specific subcommands are served by the model folder named in the config (or on the
command line): `model-zoo eval CONFIG` calls the folder's `run_eval`, and so on, so a
copied folder brings its commands with it.
"""

import argparse
import json
import sys

from model_zoo.config import available_models, import_model, load_config
from model_zoo.errors import UserInputError
from model_zoo.parallel.plan import add_plan_arguments, run_plan_command
from model_zoo.parallel.rank_table import add_rank_table_arguments, run_rank_table_command


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
    train.add_argument("--data-url", "--data_url", dest="data_url",
                       help="cloud job: dataset location (copied in with moxing when it is "
                            "installed, else a path used as data.dataset_dir)")
    train.add_argument("--train-url", "--train_url", dest="train_url",
                       help="cloud job: output location (outputs copied out with moxing "
                            "after each checkpoint, else a path used as --output-dir)")

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on held-out data (JSON)")
    add_config_arguments(evaluate)
    evaluate.add_argument("--ckpt", required=True, help="checkpoint file")

    generate = commands.add_parser("generate", help="continue a prompt (language models)")
    add_config_arguments(generate)
    generate.add_argument("--ckpt", required=True, help="checkpoint file")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the dataset's tokenizer)")
    prompt.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 2 3"')
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--greedy", action="store_true", help="take the most likely token")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k most likely")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")

    fill_mask = commands.add_parser("fill-mask", help="predict masked tokens (masked LMs)")
    add_config_arguments(fill_mask)
    fill_mask.add_argument("--ckpt", required=True, help="checkpoint file")
    text = fill_mask.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="text with [MASK] tokens (needs the dataset's tokenizer)")
    text.add_argument("--ids", help='token ids including the mask id, e.g. "4 17 6 9 5"')
    fill_mask.add_argument("--mask-id", type=int, help="mask token id (default: the config's)")
    fill_mask.add_argument("--top-k", type=int, default=5, help="ids to print per mask")

    translate = commands.add_parser("translate", help="translate lines of text")
    add_config_arguments(translate)
    translate.add_argument("--ckpt", required=True, help="checkpoint file")
    translate.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    translate.add_argument("--beam", type=int, help="beam size (default: the config's; 1 = greedy)")

    for name, help_text, hook in (("data", "build a model's dataset from text files",
                                   "add_data_arguments"),
                                  ("convert", "import a Hugging Face checkpoint",
                                   "add_convert_arguments")):
        command = commands.add_parser(name, help=help_text)
        models = command.add_subparsers(dest="model", required=True, metavar="MODEL")
        for model in available_models():
            module = import_model(model)
            if hasattr(module, hook):
                getattr(module, hook)(models.add_parser(model, help=f"{name} for {model}"))

    add_rank_table_arguments(commands.add_parser(
        "rank-table", help="generate, validate and merge HCCL rank tables (no config needed)"))
    add_plan_arguments(commands.add_parser(
        "plan", help="check a parallel layout offline: every operator strategy, memory per "
                     "device, communication per step"))
    return parser


def add_config_arguments(parser):
    parser.add_argument("config", help="YAML config, e.g. model_zoo/gpt2/configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")


def model_command(module, name: str, command: str):
    function = getattr(module, name, None)
    if function is None:
        raise UserInputError(f"model {module.__name__.split('.')[-1]!r} has no `{command}` "
                             f"command")
    return function


def run(args) -> int:
    if args.command == "rank-table":
        return run_rank_table_command(args)
    if args.command == "plan":
        return run_plan_command(args)
    if args.command in ("data", "convert"):
        module = import_model(args.model)
        hook = "run_data_command" if args.command == "data" else "run_convert_command"
        model_command(module, hook, args.command)(args)
        return 0
    config = load_config(args.config, args.overrides)
    module = import_model(config.model.name)
    if args.command == "train":
        from model_zoo.train.cloud import CloudStorage
        from model_zoo.train.trainer import default_output_dir, train
        if args.train_url and args.output_dir:
            raise UserInputError("give --output-dir or --train-url, not both")
        storage = CloudStorage(args.data_url, args.train_url)
        output_dir = storage.prepare(config, args.output_dir or default_output_dir(args.config),
                                     args.resume)
        train(config, output_dir, resume=args.resume, on_save=storage.upload)
    elif args.command == "eval":
        print(json.dumps(model_command(module, "run_eval", "eval")(config, args.ckpt)))
    elif args.command == "generate":
        print(model_command(module, "run_generate", "generate")(config, args.ckpt, args))
    elif args.command == "translate":
        print(model_command(module, "run_translate", "translate")(config, args.ckpt, args))
    elif args.command == "fill-mask":
        print(model_command(module, "run_fill_mask", "fill-mask")(config, args.ckpt, args))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
