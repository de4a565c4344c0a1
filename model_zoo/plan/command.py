"""`model-zoo plan` and `model-zoo advise`: their arguments, their runs, and the docs `plan`
generates.

Light to import (the CLI builds its parser from it); the plan itself is imported when the
command runs."""

import argparse
import json
import os

from model_zoo.config import add_overrides_argument
from model_zoo.errors import UserInputError, at_least
from model_zoo.files import check_output_file
from model_zoo.cost.devices import DEVICE_KEYS

# the guide in a source checkout (an editable install's repository; a wheel has no docs/)
DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "parallelism.md")

# --- the command ------------------------------------------------------------------------------

def add_plan_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("config", nargs="?", help="YAML config, e.g. "
                        "model_zoo/models/gpt2/configs/plan/gpt2-1024-d2m2p4.yaml")
    add_overrides_argument(parser)
    parser.add_argument("--device-num", type=at_least(1), default=None,
                        help="devices the job will have (default: dp x mp x pp of the config)")
    parser.add_argument("--device", choices=DEVICE_KEYS,
                        help="device profile (model_zoo/cost/device_profiles/) whose memory "
                             "the estimate is held against and whose speeds time the step "
                             "(ascend910: 32 GiB, ascend910b: 64 GiB, a100: 40 GiB; default: "
                             "ascend910b for a config with flash attention or bf16, else "
                             "ascend910)")
    parser.add_argument("--devices-per-server", type=at_least(1), default=0, metavar="K",
                        help="devices per server, which decides the links a collective "
                             "crosses (default: the profile's, 8)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--save-strategy", metavar="FILE",
                        help="also write the layout's strategy file in MindSpore's format "
                             "(what `model-zoo checkpoint` and transform_checkpoints read)")
    docs = parser.add_mutually_exclusive_group()
    docs.add_argument("--update-docs", nargs="?", const=DOC_PATH, metavar="DOC",
                      help="instead of a plan: rewrite the generated sections of DOC "
                           "(default: docs/parallelism.md of this source checkout)")
    docs.add_argument("--strategy-table", action="store_true",
                      help="instead of a plan: print every sharded layer's operators and "
                           "strategies (markdown)")
    docs.add_argument("--layout-table", action="store_true",
                      help="instead of a plan: print the shipped layouts with their memory "
                           "(markdown)")
    parser.epilog = ("Exit status: 0 when every rule holds and the worst stage fits in the "
                     "device's memory, 1 otherwise, 2 for a bad config or argument.")


def run_plan_command(args) -> int:
    from model_zoo.plan.docs import layout_table, strategy_table
    from model_zoo.config import load_config
    from model_zoo.cost.build import build_plan
    from model_zoo.plan.report import format_report
    docs_option = args.update_docs or args.strategy_table or args.layout_table
    if docs_option and args.config:
        raise UserInputError("--update-docs, --strategy-table and --layout-table take no CONFIG")
    if args.update_docs and args.update_docs.endswith((".yaml", ".yml")):
        raise UserInputError(f"--update-docs takes the guide to rewrite (default {DOC_PATH}), "
                             f"not a config: {args.update_docs!r}")
    if args.strategy_table:
        print(strategy_table())
        return 0
    if args.layout_table:
        print(layout_table())
        return 0
    if args.update_docs:
        return update_docs(args.update_docs)
    if not args.config:
        raise UserInputError("model-zoo plan needs a CONFIG (or --update-docs, "
                             "--strategy-table, --layout-table)")
    config = load_config(args.config, args.overrides, layout_checked=False)
    if args.save_strategy:
        check_output_file(args.save_strategy, "--save-strategy")
    plan = build_plan(config, args.config, args.device_num, args.device,
                      devices_per_server=args.devices_per_server)
    if args.save_strategy:
        save_strategy(plan, args.save_strategy)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_report(plan))
    return 0 if plan.ok else 1


def save_strategy(plan, path: str):
    """Write the strategy file of a plan whose layout breaks no rule."""
    from model_zoo.parallel.strategy_file import training_state_names, write_strategy_file
    from model_zoo.layout.network import usable_recording
    params = usable_recording(plan.recording, plan.violations, "--save-strategy").params
    parallel = plan.config.parallel
    write_strategy_file(path, params, parallel,
                        training_state_names(params, parallel, plan.config.train.grad_accumulation))


def update_docs(path: str) -> int:
    """Rewrite the generated sections of the parallelism guide at `path`."""
    from model_zoo.plan.docs import generated_sections, render_doc
    if not os.path.isfile(path):
        raise UserInputError(f"--update-docs: {path!r} does not exist (an installed package "
                             f"has no docs/: give the guide's path in a source checkout)")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    text = render_doc(text, generated_sections(), path)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    print(f"updated {path}")
    return 0


# --- `model-zoo advise` -------------------------------------------------------------------------

def add_advise_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("config", help="YAML config whose model and global batch to lay out")
    add_overrides_argument(parser)
    parser.add_argument("--device-num", type=at_least(1), required=True,
                        help="devices of the job")
    parser.add_argument("--device", choices=DEVICE_KEYS,
                        help="device profile (model_zoo/cost/device_profiles/; default: as "
                             "`model-zoo plan` picks it)")
    parser.add_argument("--devices-per-server", type=at_least(1), default=0, metavar="K",
                        help="devices per server (default: the profile's)")
    parser.add_argument("--top", type=at_least(1), default=5,
                        help="layouts to show (default 5)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--write", metavar="FILE",
                        help="write the config with the best layout to FILE (YAML)")
    parser.epilog = "Exit status: 0 when a layout fits, 1 when none does, 2 for bad input."


def run_advise_command(args) -> int:
    from model_zoo.config import save_config
    from model_zoo.cost.advisor import advise, format_advice
    from model_zoo.config import load_config
    config = load_config(args.config, args.overrides, layout_checked=False)
    if args.write:
        check_output_file(args.write, "--write")
    advice = advise(config, args.device_num, args.device, args.devices_per_server, args.top)
    if args.write and advice.best:
        save_config(advice.best[0].layout.apply(config), args.write)
    if args.json:
        print(json.dumps(advice.to_dict(), indent=2))
    else:
        print(format_advice(advice, args.config))
        if args.write and advice.best:
            print(f"wrote {args.write}")
    return 0 if advice.best else 1
