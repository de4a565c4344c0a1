"""GPT-2 dataset: a tokenizer and packed token samples in MindRecord files.

A built dataset directory holds:
    tokenizer.model                       SentencePiece model trained on the train split, or
                                          the one given with --tokenizer (tokenizer.json for
                                          a Hugging Face tokenizer, `--tokenizer hf:DIR`)
    train.mindrecord (+ .db)              rows of seq_length + 1 token ids, column `input_ids`
    heldout.mindrecord (+ .db)            the same for the held-out documents
    dataset.json                          what was built; written last, it marks a complete dataset

dataset.json records the source, vocab_size, seq_length, split seed and, per split, the
numbers of documents, tokens (counting the eos that ends each document) and samples.
"""

from pathlib import Path

from model_zoo.data import (
    HF_TOKENIZER_FILE,
    TOKENIZER_FILE,
    add_input_arguments,
    check_no_dataset,
    check_positive,
    dataset_ready,
    describe_sources,
    install_tokenizer,
    load_documents,
    pack_token_stream,
    split_documents,
    tokenizer_from_flag,
    train_tokenizer,
    write_manifest,
    write_mindrecord,
)
from model_zoo.errors import DataError

SPLIT_FILES = {"train": "train.mindrecord", "heldout": "heldout.mindrecord"}
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}


def build_dataset(output_dir, documents, *, vocab_size, seq_length, heldout_fraction=0.05, seed=1,
                  source="documents", sources=None, tokenizer=None):
    """Build a GPT-2 dataset from text documents into `output_dir` and return its dataset.json.

    The tokenizer is trained on the train split only, unless `tokenizer` (what
    `tokenizer_from_flag` found) gives one; its vocabulary size must then be `vocab_size`
    (None takes it). Files of an incomplete earlier build (no dataset.json) are replaced; a
    complete dataset is never overwritten. `sources`: the files or built-in names the
    documents came from, recorded for `data.sources` checks.
    """
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    check_positive("seq_length", seq_length)
    splits = dict(zip(("train", "heldout"), split_documents(documents, heldout_fraction, seed)))

    if tokenizer is None:
        check_positive("vocab_size", vocab_size)
        tokenizer = train_tokenizer(splits["train"], output_dir / TOKENIZER_FILE, vocab_size)
    else:
        tokenizer = install_tokenizer(tokenizer, output_dir)
        if vocab_size not in (None, tokenizer.vocab_size):
            raise DataError(f"--vocab-size {vocab_size} differs from the {tokenizer.vocab_size} "
                            f"tokens of the tokenizer {tokenizer.model_path}; leave it out")
        if tokenizer.eos_id < 0:
            raise DataError(f"{tokenizer.model_path}: the tokenizer has no end-of-text token "
                            f"to separate documents")
        vocab_size = tokenizer.vocab_size
    packed = {}
    summary = {}
    for split, split_docs in splits.items():
        documents_ids = [tokenizer.encode(document) for document in split_docs]
        tokens = sum(len(ids) + 1 for ids in documents_ids)
        samples = pack_token_stream(documents_ids, seq_length + 1, tokenizer.eos_id)
        if len(samples) == 0:
            raise DataError(f"the {split} split has {tokens} tokens, fewer than seq_length + 1 = "
                            f"{seq_length + 1} needed for one sample; give more text, a smaller "
                            f"seq_length or a larger heldout fraction")
        packed[split] = samples
        summary[split] = {"file": SPLIT_FILES[split], "documents": len(split_docs),
                          "tokens": tokens, "samples": len(samples)}

    for split, samples in packed.items():
        write_mindrecord(output_dir / SPLIT_FILES[split], SCHEMA,
                         ({"input_ids": row} for row in samples),
                         description=f"{split} samples of {seq_length + 1} token ids",
                         overwrite=True)
    manifest = {
        "source": source,
        "vocab_size": vocab_size,
        "seq_length": seq_length,
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        "tokenizer": tokenizer.model_path.name,
        "splits": summary,
    }
    return write_manifest(output_dir, manifest, sources)


def lm_dataset_ready(output_dir, vocab_size, seq_length) -> bool:
    """True if `output_dir` holds a complete dataset built for this vocab_size and seq_length
    (`manifest.dataset_ready`)."""
    return dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length},
                         lambda manifest: [manifest.get("tokenizer", TOKENIZER_FILE),
                                           *SPLIT_FILES.values()])


def add_data_arguments(parser):
    """Arguments of `model-zoo data gpt2`."""
    add_input_arguments(parser, required=True)
    parser.add_argument("--output-dir", required=True, help="directory to build the dataset in")
    parser.add_argument("--vocab-size", type=int,
                        help="vocabulary size of the tokenizer trained here (required without "
                             "--tokenizer)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help=f"tokenize with this tokenizer instead of training one: a "
                             f"SentencePiece .model, or hf:DIR for a Hugging Face folder "
                             f"({HF_TOKENIZER_FILE}, or vocab.json + merges.txt), e.g. the "
                             f"dataset folder `model-zoo convert` wrote")
    parser.add_argument("--seq-length", type=int, required=True,
                        help="tokens per training sequence")
    parser.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="fraction of documents held out for evaluation (default 0.05)")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the train/heldout split (default 1)")


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print a one-line summary."""
    check_no_dataset(Path(args.output_dir))
    if args.tokenizer is None and args.vocab_size is None:
        raise DataError("give --vocab-size for the tokenizer trained here, or --tokenizer")
    tokenizer = tokenizer_from_flag(args.tokenizer) if args.tokenizer else None
    documents = load_documents(args.input, args.json_key)
    manifest = build_dataset(args.output_dir, documents, vocab_size=args.vocab_size,
                             seq_length=args.seq_length, heldout_fraction=args.heldout_fraction,
                             seed=args.seed, source=describe_sources(args.input),
                             sources=args.input, tokenizer=tokenizer)
    splits = manifest["splits"]
    print(f"gpt2 dataset: {len(documents)} documents, "
          f"{splits['train']['tokens'] + splits['heldout']['tokens']} tokens, "
          f"{splits['train']['samples']} train / {splits['heldout']['samples']} heldout samples "
          f"of {args.seq_length + 1} tokens (vocabulary {manifest['vocab_size']}) in "
          f"{args.output_dir}")

