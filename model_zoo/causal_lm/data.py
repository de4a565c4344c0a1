"""The decoder-only language models' dataset (GPT-2, LLaMA): a tokenizer and packed token
samples in MindRecord files.

A built dataset directory holds:
    tokenizer.model                       SentencePiece model trained on a sample of the train
                                          split's lines, or the one given with --tokenizer
                                          (tokenizer.json for a Hugging Face tokenizer)
    train.mindrecord (+ .db)              rows of seq_length + 1 token ids, column `input_ids`;
                                          `train-00000-of-00004.mindrecord` ... when the corpus
                                          is built in several pieces (--shard-size, --num-files)
    heldout.mindrecord (+ .db)            the same for the held-out documents
    dataset.json                          what was built; written last, it marks a complete dataset

The build streams (`model_zoo.data.streaming`): each piece of the corpus is tokenized and
packed on its own, by one of `--workers` processes, and the tokens left over at its end
(fewer than seq_length + 1) are dropped. dataset.json records the source, vocab_size,
seq_length, split seed and, per split, its files and the numbers of documents, tokens
(counting the eos that ends each document), samples and dropped tokens.
"""

import time
from pathlib import Path

from model_zoo.data import (
    HF_TOKENIZER_FILE,
    TOKENIZER_FILE,
    add_input_arguments,
    check_no_dataset,
    check_positive,
    dataset_ready,
    install_tokenizer,
    split_paths,
    load_tokenizer_file,
    tokenizer_from_flag,
    train_tokenizer,
)
from model_zoo.data.mindrecord import TokenPacker, write_mindrecord_unless_empty
from model_zoo.data.streaming import (
    BuildOptions,
    add_build_arguments,
    build_summary,
    count_progress,
    finish_build,
    piece_documents,
    piece_tokenizer,
    planned_tokenizer,
    shard_name,
    split_totals,
    streaming_build,
    train_documents,
)
from model_zoo.errors import DataError

SPLITS = ("train", "heldout")
SPLIT_FILES = {split: shard_name(split, 0, 1) for split in SPLITS}   # a one-piece build's
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}
ENCODE_BATCH_BYTES = 1 << 20   # text a worker encodes and packs at a time


def build_dataset(output_dir, sources, *, vocab_size, seq_length, tokenizer=None,
                  options=BuildOptions(), source=None, record_sources=True):
    """Build a language-model dataset from `sources` (files, folders, globs, built-in
    corpora) into `output_dir` and return its dataset.json.

    The tokenizer is trained on (a sample of `options.tokenizer_sentences` lines of) the
    train split only, unless `tokenizer` (what `tokenizer_from_flag` found) gives one; its
    vocabulary size must then be `vocab_size` (None takes it). The corpus is built in pieces
    (`options`: their size, the workers, the split; see `model_zoo.data.streaming`). An
    unfinished earlier build with the same settings and inputs is resumed; the files of
    another are replaced; a complete dataset is never overwritten. `sources` are recorded
    for `data.sources` checks unless `record_sources` is False.
    """
    output_dir = Path(output_dir)
    check_positive("seq_length", seq_length)
    if tokenizer is None:
        check_positive("vocab_size", vocab_size)

    def tokenizer_for(plan, rule, entries):
        if tokenizer is None:
            return planned_tokenizer(output_dir, plan, output_dir / TOKENIZER_FILE, lambda: (
                train_tokenizer(train_documents(entries, options.json_key, rule),
                                output_dir / TOKENIZER_FILE, vocab_size,
                                sentences=options.tokenizer_sentences, seed=options.seed)))
        given = install_tokenizer(tokenizer, output_dir)
        if vocab_size not in (None, given.vocab_size):
            raise DataError(f"--vocab-size {vocab_size} differs from the {given.vocab_size} "
                            f"tokens of the tokenizer {given.model_path}; leave it out")
        if given.eos_id < 0:
            raise DataError(f"{given.model_path}: the tokenizer has no end-of-text token "
                            f"to separate documents")
        return given

    settings = {"vocab_size": vocab_size, "seq_length": seq_length,
                "tokenizer": str(tokenizer) if tokenizer else None}
    plan, records, used = streaming_build(
        output_dir, sources, options, settings=settings, splits=SPLITS, label="causal LM data",
        tokenizer_for=tokenizer_for, build_piece=build_piece, job={"length": seq_length + 1})
    summary = split_totals(records, SPLITS, ("documents", "tokens", "samples", "dropped_tokens"))
    for split in SPLITS:
        if summary[split]["samples"] == 0:
            raise DataError(f"the {split} split has {summary[split]['tokens']} tokens, fewer "
                            f"than seq_length + 1 = {seq_length + 1} needed for one sample in "
                            f"any piece; give more text, a smaller seq_length, a larger "
                            f"heldout fraction or larger pieces")
    manifest = {
        "source": source,
        "vocab_size": used.vocab_size,
        "seq_length": seq_length,
        "heldout_fraction": options.heldout_fraction,
        "seed": options.seed,
        "tokenizer": used.model_path.name,
        "splits": summary,
        "build": build_summary(plan),
    }
    return finish_build(output_dir, manifest, sources, records, record_sources)


def build_piece(job: dict, piece) -> dict:
    """Tokenize and pack one piece of the corpus into its train and heldout files (a worker's
    task; see `model_zoo.data.streaming.build_pieces`)."""
    tokenizer = piece_tokenizer(job, load_tokenizer_file)
    output_dir = Path(job["output_dir"])
    packers = {split: TokenPacker(job["length"], tokenizer.eos_id) for split in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    heldout_rows = []

    def train_rows():
        for batch in _batches(piece_documents(job["entries"], job["json_key"], job["rule"],
                                              piece)):
            ids = tokenizer.encode_batch([text for _, text, _, _ in batch])
            by_split = {split: [] for split in SPLITS}
            for (_, _, heldout, _), document_ids in zip(batch, ids):
                by_split["heldout" if heldout else "train"].append(document_ids)
            for split in SPLITS:
                documents[split] += len(by_split[split])
            count_progress(len(batch), sum(len(document_ids) + 1 for document_ids in ids),
                           sum(size for *_, size in batch))
            heldout_rows.append(packers["heldout"].add(by_split["heldout"]))
            for row in packers["train"].add(by_split["train"]):
                yield {"input_ids": row}

    names = {split: shard_name(split, piece.index, job["pieces"]) for split in SPLITS}
    samples = {"train": write_mindrecord_unless_empty(
        output_dir / names["train"], SCHEMA, train_rows(),
        description=f"train samples of {job['length']} token ids")}
    samples["heldout"] = write_mindrecord_unless_empty(
        output_dir / names["heldout"], SCHEMA,
        ({"input_ids": row} for rows in heldout_rows for row in rows),
        description=f"heldout samples of {job['length']} token ids")
    return {"splits": {split: {"files": [names[split]] if samples[split] else [],
                               "documents": documents[split],
                               "tokens": packers[split].tokens, "samples": samples[split],
                               "dropped_tokens": packers[split].dropped}
                       for split in SPLITS}}


def _batches(documents):
    """Lists of documents of about ENCODE_BATCH_BYTES of input."""
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += document[3]
        if size >= ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def split_files(dataset_dir, split: str) -> list:
    """The MindRecord files of a split of a built dataset, in order."""
    return split_paths(dataset_dir, SPLIT_FILES, split)


def lm_dataset_ready(output_dir, vocab_size, seq_length) -> bool:
    """True if `output_dir` holds a complete dataset built for this vocab_size and seq_length
    (`manifest.dataset_ready`)."""
    return dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length},
                         lambda manifest: [manifest.get("tokenizer", TOKENIZER_FILE),
                                           *(Path(path).name for split in SPLITS
                                             for path in split_files(output_dir, split))])


def add_data_arguments(parser):
    """Arguments of `model-zoo data gpt2` (or any decoder-only model's)."""
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
    add_build_arguments(parser)


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print a one-line summary."""
    check_no_dataset(Path(args.output_dir))
    if args.tokenizer is None and args.vocab_size is None:
        raise DataError("give --vocab-size for the tokenizer trained here, or --tokenizer")
    tokenizer = tokenizer_from_flag(args.tokenizer) if args.tokenizer else None
    started = time.perf_counter()
    manifest = build_dataset(args.output_dir, args.input, vocab_size=args.vocab_size,
                             seq_length=args.seq_length, tokenizer=tokenizer,
                             options=BuildOptions.from_args(args))
    print(describe_build(manifest, args.output_dir, time.perf_counter() - started))


def describe_build(manifest: dict, output_dir, seconds: float) -> str:
    """The one-line summary of a built dataset."""
    splits, build = manifest["splits"], manifest["build"]
    tokens = sum(split["tokens"] for split in splits.values())
    dropped = sum(split["dropped_tokens"] for split in splits.values())
    files = sum(len(split["files"]) for split in splits.values())
    return (f"causal LM dataset: {build['documents']:,} documents, {tokens:,} tokens, "
            f"{splits['train']['samples']:,} train / {splits['heldout']['samples']:,} heldout "
            f"samples of {manifest['seq_length'] + 1} tokens (vocabulary "
            f"{manifest['vocab_size']}), {files} file(s), {dropped / max(tokens, 1):.2%} of "
            f"tokens dropped at piece ends, in {output_dir} ({seconds:.1f} s, "
            f"{build['input_bytes'] / 1e6 / max(seconds, 1e-9):.2f} MB/s)")
