"""`model-zoo data bert`: build the pretraining set or the classification set."""

from pathlib import Path

from model_zoo.data import add_input_arguments, check_no_dataset
from model_zoo.data.streaming import BuildOptions, add_build_arguments
from model_zoo.errors import UserInputError

from .classification import build_classification_dataset
from .data import build_pretraining_dataset

def add_data_arguments(parser):
    """Arguments of `model-zoo data bert`."""
    parser.add_argument("--task", choices=("pretrain", "classify"), default="pretrain",
                        help="pretrain: masked-LM + next-sentence examples from --input "
                             "(default); classify: the docstring topic classification set, "
                             "tokenized with --tokenizer")
    add_input_arguments(parser, required=False, note="pretrain: ")
    parser.add_argument("--output-dir", required=True, help="directory to build the dataset in")
    parser.add_argument("--vocab-size", type=int, help="pretrain: tokenizer vocabulary size")
    parser.add_argument("--seq-length", type=int, required=True, help="tokens per example")
    parser.add_argument("--max-predictions-per-seq", type=int, default=20,
                        help="pretrain: masked tokens per example at most (default 20)")
    parser.add_argument("--masked-lm-prob", type=float, default=0.15,
                        help="pretrain: fraction of tokens masked (default 0.15)")
    parser.add_argument("--whole-word-mask", action="store_true",
                        help="pretrain: mask all pieces of a word together")
    parser.add_argument("--dupe-factor", type=int, default=2,
                        help="pretrain: passes over the train documents with other masks "
                             "(default 2)")
    parser.add_argument("--short-seq-prob", type=float, default=0.1,
                        help="pretrain: probability of a shorter target length (default 0.1)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="classify: the pretraining dataset's tokenizer.model")
    add_build_arguments(parser)


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print a one-line summary."""
    output_dir = Path(args.output_dir)
    check_no_dataset(output_dir)
    if args.task == "classify":
        if not args.tokenizer:
            raise UserInputError("--task classify needs --tokenizer PATH (the pretraining "
                                 "dataset's tokenizer.model)")
        manifest = build_classification_dataset(output_dir, args.tokenizer,
                                                 seq_length=args.seq_length, seed=args.seed)
        splits, baseline = manifest["splits"], manifest["majority_baseline"]
        print(f"bert classification dataset: {len(manifest['labels'])} docstring topics, "
              f"{splits['train']['examples']} train / {splits['dev']['examples']} dev examples "
              f"of {args.seq_length} tokens, dev majority baseline "
              f"{baseline['dev_accuracy']:.3f} ({baseline['label']}) in {output_dir}")
        return
    missing = [flag for flag, value in (("--input", args.input), ("--vocab-size", args.vocab_size))
               if value is None]
    if missing:
        raise UserInputError(f"--task pretrain needs {' and '.join(missing)}")
    manifest = build_pretraining_dataset(
        output_dir, args.input, vocab_size=args.vocab_size, seq_length=args.seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq, masked_lm_prob=args.masked_lm_prob,
        whole_word_mask=args.whole_word_mask, dupe_factor=args.dupe_factor,
        short_seq_prob=args.short_seq_prob, options=BuildOptions.from_args(args))
    splits = manifest["splits"]
    print(f"bert dataset: {manifest['build']['documents']} documents, "
          f"{splits['train']['sentences'] + splits['heldout']['sentences']} sentences, "
          f"{splits['train']['examples']} train / {splits['heldout']['examples']} heldout "
          f"examples of {args.seq_length} tokens (at most {args.max_predictions_per_seq} "
          f"masked) in {output_dir}")
