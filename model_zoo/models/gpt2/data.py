"""GPT-2 dataset: a tokenizer and packed token samples in MindRecord files.

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
    describe_sources,
    install_tokenizer,
    load_tokenizer_file,
    tokenizer_from_flag,
    train_tokenizer,
    write_manifest,
)
from model_zoo.data.corpus import DEFAULT_JSON_KEY, input_entries
from model_zoo.data.manifest import sha256_of
from model_zoo.data.mindrecord import TokenPacker, write_mindrecord_unless_empty
from model_zoo.data.streaming import (
    DEFAULT_SHARD_MB,
    DEFAULT_TOKENIZER_SENTENCES,
    build_pieces,
    clear_build,
    clear_build_notes,
    count_progress,
    default_workers,
    input_signature,
    load_plan,
    piece_documents,
    plan_pieces,
    plan_rule,
    save_plan,
    scan_corpus,
    shard_name,
    finished_piece,
    train_documents,
)
from model_zoo.errors import DataError

SPLITS = ("train", "heldout")
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}
ENCODE_BATCH_BYTES = 1 << 20   # text a worker encodes and packs at a time


def build_dataset(output_dir, sources, *, vocab_size, seq_length, heldout_fraction=0.05, seed=1,
                  json_key=DEFAULT_JSON_KEY, tokenizer=None, workers=None,
                  shard_size=DEFAULT_SHARD_MB, num_files=None,
                  tokenizer_sentences=DEFAULT_TOKENIZER_SENTENCES, source=None):
    """Build a GPT-2 dataset from `sources` (files, folders, globs, built-in corpora) into
    `output_dir` and return its dataset.json.

    The tokenizer is trained on (a sample of `tokenizer_sentences` lines of) the train split
    only, unless `tokenizer` (what `tokenizer_from_flag` found) gives one; its vocabulary
    size must then be `vocab_size` (None takes it). The corpus is built in pieces of about
    `shard_size` MB of input (or `num_files` pieces) by `workers` processes (default: the
    cores). An unfinished earlier build with the same settings and inputs is resumed; the
    files of another are replaced; a complete dataset is never overwritten.
    """
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    check_positive("seq_length", seq_length)
    workers = default_workers() if workers is None else workers
    check_positive("workers", workers)
    if num_files is not None:
        check_positive("num_files", num_files)
    elif not shard_size > 0:
        raise DataError(f"shard_size must be a positive number of MB, got {shard_size!r}")
    if tokenizer is None:
        check_positive("vocab_size", vocab_size)
    entries = input_entries(sources)
    settings = {"inputs": input_signature(entries), "json_key": json_key,
                "vocab_size": vocab_size, "seq_length": seq_length,
                "heldout_fraction": heldout_fraction, "seed": seed,
                "tokenizer": str(tokenizer) if tokenizer else None,
                "tokenizer_sentences": tokenizer_sentences,
                "pieces": {"num_files": num_files} if num_files else {"shard_mb": shard_size}}
    plan = load_plan(output_dir, settings)
    if plan is None:
        clear_build(output_dir, SPLITS)
        started = time.perf_counter()
        plan = dict(scan_corpus(entries, json_key, heldout_fraction=heldout_fraction, seed=seed,
                                piece_bytes=int(shard_size * 1e6), num_files=num_files),
                    settings=settings)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_plan(output_dir, plan)
        print(f"scanned {plan['documents']:,} documents, {plan['bytes'] / 1e6:,.1f} MB, in "
              f"{time.perf_counter() - started:.1f} s: {len(plan['pieces'])} piece(s)",
              flush=True)
    else:
        print(f"resuming the unfinished build in {output_dir}", flush=True)
    rule = plan_rule(plan)

    if tokenizer is None:
        tokenizer = _trained_tokenizer(output_dir, plan, entries, json_key, rule)
    else:
        tokenizer = install_tokenizer(tokenizer, output_dir)
        if vocab_size not in (None, tokenizer.vocab_size):
            raise DataError(f"--vocab-size {vocab_size} differs from the {tokenizer.vocab_size} "
                            f"tokens of the tokenizer {tokenizer.model_path}; leave it out")
        vocab_size = tokenizer.vocab_size
    if tokenizer.eos_id < 0:
        raise DataError(f"{tokenizer.model_path}: the tokenizer has no end-of-text token "
                        f"to separate documents")

    pieces = plan_pieces(plan)
    tokenizer_sha256 = sha256_of(tokenizer.model_path)
    records = {piece.index: record for piece in pieces
               if (record := finished_piece(output_dir, piece, tokenizer_sha256))}
    todo = [piece for piece in pieces if piece.index not in records]
    job = {"entries": entries, "json_key": json_key, "rule": rule,
           "tokenizer": str(tokenizer.model_path), "tokenizer_sha256": tokenizer_sha256,
           "length": seq_length + 1, "output_dir": str(output_dir), "pieces": len(pieces)}
    records.update(build_pieces(build_piece, job, todo, workers, label="gpt2 data",
                                total_bytes=sum(piece.bytes for piece in todo)))
    summary = _split_summary([records[piece.index] for piece in pieces])
    for split in SPLITS:
        if summary[split]["samples"] == 0:
            raise DataError(f"the {split} split has {summary[split]['tokens']} tokens, fewer "
                            f"than seq_length + 1 = {seq_length + 1} needed for one sample in "
                            f"any piece; give more text, a smaller seq_length, a larger "
                            f"heldout fraction or larger pieces")
    manifest = {
        "source": source or describe_sources([str(source) for source in sources]),
        "vocab_size": vocab_size,
        "seq_length": seq_length,
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        "tokenizer": tokenizer.model_path.name,
        "splits": summary,
        "build": {"documents": plan["documents"], "input_bytes": plan["bytes"],
                  "pieces": len(pieces), **settings["pieces"],
                  "tokenizer_sentences": tokenizer_sentences},
    }
    known = {name: info for record in records.values() for name, info in record["files"].items()}
    written = write_manifest(output_dir, manifest, [str(source) for source in sources],
                             known_files=known)
    clear_build_notes(output_dir)
    return written


def _trained_tokenizer(output_dir: Path, plan: dict, entries, json_key, rule):
    """The tokenizer trained on the train split, or the one an earlier run of this build
    trained (recorded in its plan)."""
    path = output_dir / TOKENIZER_FILE
    if plan.get("tokenizer_sha256") and path.is_file() \
            and sha256_of(path) == plan["tokenizer_sha256"]:
        return load_tokenizer_file(path)
    settings = plan["settings"]
    started = time.perf_counter()
    tokenizer = train_tokenizer(train_documents(entries, json_key, rule), path,
                                settings["vocab_size"], sentences=settings["tokenizer_sentences"],
                                seed=settings["seed"])
    print(f"trained the tokenizer ({tokenizer.vocab_size} pieces) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    save_plan(output_dir, dict(plan, tokenizer_sha256=sha256_of(path)))
    return tokenizer


_TOKENIZERS = {}   # a worker's tokenizer, loaded once for all its pieces


def build_piece(job: dict, piece) -> dict:
    """Tokenize and pack one piece of the corpus into its train and heldout files (a worker's
    task; see `model_zoo.data.streaming.build_pieces`)."""
    tokenizer = _TOKENIZERS.get(job["tokenizer"])
    if tokenizer is None:
        tokenizer = _TOKENIZERS[job["tokenizer"]] = load_tokenizer_file(job["tokenizer"])
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
    return {"file_names": [file for split in SPLITS if samples[split]
                           for file in (names[split], names[split] + ".db")],
            "splits": {split: {"files": [names[split]] if samples[split] else [],
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


def _split_summary(records: list) -> dict:
    """Each split's files (in piece order) and totals over the pieces' records."""
    summary = {}
    for split in SPLITS:
        parts = [record["splits"][split] for record in records]
        summary[split] = {"files": [file for part in parts for file in part["files"]],
                          **{key: sum(part[key] for part in parts)
                             for key in ("documents", "tokens", "samples", "dropped_tokens")}}
    return summary


def split_files(dataset_dir, split: str) -> list:
    """The MindRecord files of a split of a built dataset, in order."""
    from model_zoo.data import read_manifest
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
    manifest = read_manifest(dataset_dir) or {}
    recorded = manifest.get("splits", {}).get(split, {})
    names = recorded.get("files") or [recorded.get("file", f"{split}.mindrecord")]
    return [str(Path(dataset_dir) / name) for name in names]


def lm_dataset_ready(output_dir, vocab_size, seq_length) -> bool:
    """True if `output_dir` holds a complete dataset built for this vocab_size and seq_length
    (`manifest.dataset_ready`)."""
    return dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length},
                         lambda manifest: [manifest.get("tokenizer", TOKENIZER_FILE),
                                           *(Path(path).name for split in SPLITS
                                             for path in split_files(output_dir, split))])


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
                        help="seed of the train/heldout split and of the tokenizer's sample "
                             "(default 1)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="processes that tokenize and write pieces of the corpus "
                             "(default: the cores of this machine)")
    parser.add_argument("--shard-size", type=float, default=DEFAULT_SHARD_MB, metavar="MB",
                        help=f"MB of input text per piece, each written as its own files "
                             f"(default {DEFAULT_SHARD_MB})")
    parser.add_argument("--num-files", type=int, default=None, metavar="N",
                        help="cut the corpus in about N pieces of equal size instead")
    parser.add_argument("--tokenizer-sentences", type=int, default=DEFAULT_TOKENIZER_SENTENCES,
                        metavar="N",
                        help=f"lines of the train split that the tokenizer is trained on, a "
                             f"shuffled sample; 0 for all (default {DEFAULT_TOKENIZER_SENTENCES:,})")


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print a one-line summary."""
    check_no_dataset(Path(args.output_dir))
    if args.tokenizer is None and args.vocab_size is None:
        raise DataError("give --vocab-size for the tokenizer trained here, or --tokenizer")
    tokenizer = tokenizer_from_flag(args.tokenizer) if args.tokenizer else None
    started = time.perf_counter()
    manifest = build_dataset(args.output_dir, args.input, vocab_size=args.vocab_size,
                             seq_length=args.seq_length, heldout_fraction=args.heldout_fraction,
                             seed=args.seed, json_key=args.json_key, tokenizer=tokenizer,
                             workers=args.workers, shard_size=args.shard_size,
                             num_files=args.num_files,
                             tokenizer_sentences=args.tokenizer_sentences)
    print(describe_build(manifest, args.output_dir, time.perf_counter() - started))


def describe_build(manifest: dict, output_dir, seconds: float) -> str:
    """The one-line summary of a built dataset."""
    splits, build = manifest["splits"], manifest["build"]
    tokens = sum(split["tokens"] for split in splits.values())
    dropped = sum(split["dropped_tokens"] for split in splits.values())
    files = sum(len(split["files"]) for split in splits.values())
    return (f"gpt2 dataset: {build['documents']:,} documents, {tokens:,} tokens, "
            f"{splits['train']['samples']:,} train / {splits['heldout']['samples']:,} heldout "
            f"samples of {manifest['seq_length'] + 1} tokens (vocabulary "
            f"{manifest['vocab_size']}), {files} file(s), {dropped / max(tokens, 1):.2%} of "
            f"tokens dropped at piece ends, in {output_dir} ({seconds:.1f} s, "
            f"{build['input_bytes'] / 1e6 / max(seconds, 1e-9):.2f} MB/s)")
