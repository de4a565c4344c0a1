"""`model-zoo dryrun`: its arguments and its run.

Light to import (the CLI builds its parser from it); the dry run itself (`run`) is
imported when the command runs."""

import argparse
import json
import os

from model_zoo.config import add_overrides_argument
from model_zoo.errors import UserInputError


def add_dryrun_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("config", help="YAML config whose layout MindSpore compiles")
    add_overrides_argument(parser)
    parser.add_argument("--ranks", default=None,
                        help="ranks to compile: stages (the first rank of every pipeline "
                             "stage, the default), all, or a list such as 0,4")
    parser.add_argument("--as-device", choices=("ascend910", "ascend910b"), default=None,
                        help="compile the step as that chip's run builds it: ascend910 with "
                             "its float-status overflow check, ascend910b with flash "
                             "attention and bf16 where the config asks (default: the chip "
                             "the config needs, without the 910's float-status operators)")
    parser.add_argument("--check-numbers", action="store_true",
                        help="also run the compiled steps of every rank on CPU ranks and "
                             "compare loss, gradient norm, overflow decision and every "
                             "parameter and optimizer-moment slice with one device (fp32, "
                             "dropout 0)")
    parser.add_argument("--steps", type=int, default=2,
                        help="with --check-numbers: steps to run (default 2)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="keep each rank's MindSpore strategy file and compile log in "
                             "DIR/rank_<r>/ (default: a temporary folder, removed)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="ranks compiled at a time, one process each (default 2)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up on a rank's compile after this long (default 3600)")
    parser.epilog = ("Exit status: 0 when every rank compiled and every layout agrees with "
                     "`model-zoo plan` (and with --check-numbers every figure with one "
                     "device), 1 otherwise, 2 for bad input, a layout too big for CPU ranks "
                     "here or a machine that cannot run the dry run.")


def run_dryrun_command(args) -> int:
    import sys
    from model_zoo.config import load_config
    from model_zoo.dryrun.run import DEFAULT_TIMEOUT, format_dryrun, run_dryrun, select_ranks
    if args.jobs < 1:
        raise UserInputError(f"--jobs must be >= 1, got {args.jobs}")
    if args.timeout is not None and args.timeout <= 0:
        raise UserInputError(f"--timeout must be > 0, got {args.timeout}")
    if args.check_numbers and args.ranks not in (None, "all"):
        raise UserInputError("--check-numbers compiles every rank: leave out --ranks")
    if args.steps != 2 and not args.check_numbers:
        raise UserInputError("--steps goes with --check-numbers")
    if args.as_device and args.check_numbers:
        raise UserInputError("--as-device compiles for a chip; --check-numbers runs on CPU "
                             "ranks: give one of them")
    config = load_config(args.config, args.overrides, layout_checked=False)
    config.parallel.validate()
    ranks = select_ranks(args.ranks or "stages", config.parallel)
    if args.output_dir:
        check_output_folder(args.output_dir)
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    timeout = args.timeout or DEFAULT_TIMEOUT
    numbers = None
    if args.check_numbers:
        result, numbers = checked_numbers(args, timeout, progress)
    else:
        result = run_dryrun(config, args.config, args.overrides, ranks, args.output_dir,
                            jobs=args.jobs, timeout=timeout, progress=progress,
                            as_device=args.as_device)
    if args.json:
        print(json.dumps({**result.to_dict(), **({"numbers": numbers} if numbers else {})},
                         indent=2))
    else:
        print(format_dryrun(result))
        if numbers:
            from model_zoo.dryrun.numbers import format_numbers
            print(format_numbers(numbers))
    return 0 if result.ok and (numbers is None or numbers["ok"]) else 1


def checked_numbers(args, timeout: float, progress):
    """`--check-numbers` in `--output-dir` (kept) or a temporary folder (removed)."""
    import shutil
    import tempfile
    from pathlib import Path
    from model_zoo.dryrun.numbers import check_numbers
    work = Path(args.output_dir or tempfile.mkdtemp(prefix="model-zoo-numbers-")).resolve()
    try:
        return check_numbers(args.config, args.overrides, args.steps, work, args.jobs,
                             timeout, progress)
    finally:
        if not args.output_dir:
            shutil.rmtree(work, ignore_errors=True)


def check_output_folder(path: str):
    """Refuse an --output-dir that is a file or cannot be written, before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"--output-dir {path!r} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise UserInputError(f"--output-dir {path!r} cannot be made: {err.strerror}")
    if not os.access(path, os.W_OK):
        raise UserInputError(f"--output-dir {path!r} is not writable")
