"""The Transformer's part of the command line (argument definitions only: imported for
`--help`)."""

SUBCOMMANDS = ("data",)   # `model-zoo data transformer`, served by tasks.py


def add_commands(commands):
    """`model-zoo translate CONFIG --ckpt FILE`, served by the folder's `run_translate`."""
    translate = commands.verb(
        "translate", "translate lines of text",
        lambda folder, config, args: folder.run_translate(config, args.ckpt, args))
    if translate is None:
        return
    translate.add_argument("--ckpt", required=True, help="checkpoint file")
    translate.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    translate.add_argument("--beam", type=int,
                           help="beam size (default: the config's; 1 = greedy)")
