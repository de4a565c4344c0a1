"""The launch scripts' layout step: lay a config out for the job's devices and, for Ascend,
check the layout with the plan before any rank starts.

    python3 -m model_zoo.plan.launch --device-num N --target Ascend|CPU CONFIG [train args]

Prints the arguments the launch adds to every rank's `model-zoo train` command, one a line
(none when the config already uses N devices); a layout made for fewer devices gets the
data-parallel replicas that fill them (`ParallelConfig.data_parallel_for`). A layout that
does not fit N devices, breaks one of MindSpore's rules or does not fit the device's memory
ends in one `error:` line and exit status 2.
"""

import argparse
import sys

from model_zoo.config import add_overrides_argument, load_config
from model_zoo.errors import UserInputError


def train_overrides(train_args) -> list:
    """The `--set` overrides among the arguments of `model-zoo train`; the others are the
    ranks' own to read."""
    parser = argparse.ArgumentParser(prog="model-zoo train", add_help=False,
                                     allow_abbrev=False)
    add_overrides_argument(parser)
    return parser.parse_known_args(train_args)[0].overrides


def launch_overrides(config_path: str, train_args, device_num: int, target: str) -> list:
    """The `--set` arguments that lay `config_path` (with the user's `train_args`) out over
    `device_num` devices; on Ascend the layout is checked with `model-zoo plan` first, against
    this server's chip and its memory (`server_chip`; the config's when it cannot be read).
    UserInputError (exit 2) naming what does not fit."""
    from model_zoo.cost.build import build_plan
    from model_zoo.parallel.context import server_chip
    from model_zoo.plan.report import failure_reasons

    overrides = train_overrides(train_args)
    config = load_config(config_path, overrides, layout_checked=False)
    config.parallel.validate()
    data_parallel = config.parallel.data_parallel_for(device_num)
    added = ([] if data_parallel == config.parallel.data_parallel
             else [f"parallel.data_parallel={data_parallel}"])
    if added:
        config = load_config(config_path, overrides + added, layout_checked=False)
    parallel = config.parallel
    layout = (f"data_parallel {parallel.data_parallel} x model_parallel "
              f"{parallel.model_parallel} x pipeline_stage {parallel.pipeline_stage}")
    chip = ""
    if target == "Ascend":
        server = server_chip()
        plan = build_plan(config, config_path, device_num,
                          device=server.profile if server else None,
                          device_memory=server.memory if server else 0)
        chip = (f" of this server's {server.name} ({server.memory / 2 ** 30:.0f} GB)"
                if server else f" of the config's {plan.profile.name} (this server's chip "
                               f"could not be read)")
        if not plan.ok:
            first = f"{plan.violations[0].message}" if plan.violations else ""
            more = f" (and {len(plan.violations) - 1} more)" if len(plan.violations) > 1 else ""
            raise UserInputError(
                f"the layout {layout} on {device_num} devices{chip} does not pass the plan: "
                + "; ".join(failure_reasons(plan, first + more))
                + f"; see `model-zoo plan {config_path} --device-num {device_num}"
                + "".join(f" --set {override}" for override in overrides + added) + "`")
    print(f"layout: {layout} on {device_num} devices{chip}"
          + (f" (the launch adds --set {added[0]})" if added else ""), file=sys.stderr)
    return [part for override in added for part in ("--set", override)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m model_zoo.plan.launch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-num", type=int, required=True)
    parser.add_argument("--target", choices=("Ascend", "CPU"), required=True)
    parser.add_argument("config")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        print("\n".join(launch_overrides(args.config, args.train_args, args.device_num,
                                         args.target)))
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
