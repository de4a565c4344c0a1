"""The `generate` verb of decoder-only models (argument definitions only: imported for `--help`)."""


def add_commands(commands):
    """`model-zoo generate CONFIG --ckpt FILE`, served by the folder's `run_generate`."""
    generate = commands.verb(
        "generate", "continue a prompt (language models)",
        lambda folder, config, args: folder.run_generate(config, args.ckpt, args))
    if generate is None:
        return
    generate.add_argument("--ckpt", required=True, help="checkpoint file")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the dataset's tokenizer)")
    prompt.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 2 3"')
    prompt.add_argument("--input", metavar="FILE",
                        help="prompts as text, one a line (needs the dataset's tokenizer)")
    prompt.add_argument("--prompt-ids-file", metavar="FILE",
                        help="prompts as token ids separated by spaces, one a line")
    generate.add_argument("--batch-size", type=int, default=8,
                          help="prompts generated together (default 8)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="divide a seen token's positive logit by it (1: off)")
    generate.add_argument("--greedy", action="store_true", help="take the most likely token")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k most likely")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
