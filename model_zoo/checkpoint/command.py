"""`model-zoo checkpoint`: split, merge, transform, collect and inspect checkpoints across
layouts.

Light to import (the CLI builds its parser from it); `layouts.py` does the work.
"""

import time

from model_zoo.config import add_overrides_argument


def add_checkpoint_arguments(parser):
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    split = verbs.add_parser("split", help="a full checkpoint -> per-rank slices for the "
                                           "config's layout")
    split.add_argument("config", help="YAML config whose parallel section is the layout")
    split.add_argument("--ckpt", required=True, help="full checkpoint (one file)")
    split.add_argument("--output-dir", required=True,
                       help="new directory: rank_<i>/checkpoint_<i>.ckpt, strategy.ckpt, "
                            "config.yaml")
    add_overrides_argument(split)
    merge = verbs.add_parser("merge", help="per-rank slices -> one full checkpoint")
    merge.add_argument("directory", help="a directory written by split or transform")
    merge.add_argument("--output", required=True, help="the full checkpoint to write")
    transform = verbs.add_parser("transform", help="re-slice for another layout")
    transform.add_argument("directory", help="a directory written by split or transform")
    transform.add_argument("--output-dir", required=True, help="new directory for the layout "
                                                               "the --set overrides give")
    add_overrides_argument(transform)
    collect = verbs.add_parser("collect", help="a sliced directory from a sharded training "
                                               "run's rank folders (to merge or transform)")
    collect.add_argument("run_dir", help="the run's --output-dir (with rank_<i>/ folders)")
    collect.add_argument("--step", type=int, default=0,
                         help="the checkpoint step (default: the newest all ranks have)")
    collect.add_argument("--output-dir", required=True, help="the new sliced directory")
    inspect = verbs.add_parser("inspect", help="entries, shapes, dtypes and which rank "
                                               "holds which slice")
    inspect.add_argument("path", help="a checkpoint file or a sliced directory")


def run_checkpoint_command(args) -> int:
    from model_zoo.checkpoint import layouts
    started = time.perf_counter()
    if args.verb == "split":
        config = layouts.layout_config(args.config, args.overrides)
        layout = layouts.split(config, args.ckpt, args.output_dir)
        done = f"split {args.ckpt} for {layout.describe()} into {args.output_dir}"
    elif args.verb == "merge":
        layout = layouts.merge(args.directory, args.output)
        done = f"merged the {layout.device_num} ranks of {args.directory} into {args.output}"
    elif args.verb == "transform":
        source, target = layouts.transform(args.directory, args.output_dir, args.overrides)
        done = (f"transformed {args.directory} ({source.describe()}) into {args.output_dir} "
                f"({target.describe()}, {target.device_num} ranks)")
    elif args.verb == "collect":
        layout = layouts.collect(args.run_dir, args.output_dir, args.step)
        done = (f"collected the {layout.device_num} ranks of {args.run_dir} "
                f"({layout.describe()}) into {args.output_dir}")
    else:
        print("\n".join(layouts.inspect(args.path)))
        return 0
    print(f"{done} in {time.perf_counter() - started:.1f} s")
    return 0
