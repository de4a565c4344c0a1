"""BERT's part of the command line (argument definitions only: imported for `--help`)."""

SUBCOMMANDS = ("data", "convert")   # `model-zoo data|convert bert`, served by tasks.py


def add_commands(commands):
    """`model-zoo fill-mask CONFIG --ckpt FILE`, served by the folder's `run_fill_mask`."""
    fill_mask = commands.verb(
        "fill-mask", "predict masked tokens (masked LMs)",
        lambda folder, config, args: folder.run_fill_mask(config, args.ckpt, args))
    if fill_mask is None:
        return
    fill_mask.add_argument("--ckpt", required=True, help="checkpoint file")
    text = fill_mask.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="text with [MASK] tokens (needs the dataset's tokenizer)")
    text.add_argument("--ids", help='token ids including the mask id, e.g. "4 17 6 9 5"')
    fill_mask.add_argument("--mask-id", type=int, help="mask token id (default: the config's)")
    fill_mask.add_argument("--top-k", type=int, default=5, help="ids to print per mask")
