"""Translation dataset: sentence pairs (`pairs`), a leak-free split, a joint SentencePiece
vocabulary and length-bucketed MindRecord files, built as a stream in pieces.

A built dataset directory holds:
    tokenizer.model              joint SentencePiece model of both languages, trained on (a
                                 sample of) the train split (pad=0, unk=1, bos=2, eos=3)
    train.mindrecord (+ .db)     one row per sentence pair (columns below);
                                 `train-00003-of-00016.mindrecord` ... when the inputs are
                                 built in several pieces (--shard-size, --num-files)
    dev.mindrecord (+ .db)
    test.mindrecord (+ .db)
    dev.en dev.de test.en test.de  the dev/test pairs as plain text, one per line: line i is
                                 the row with index i (references for sacreBLEU)
    dataset.json                 what was built; written last, it marks a complete dataset

MindRecord columns (RECORD_SCHEMA), one row per pair; each file's rows are sorted by
bucket (then by index), and dataset.json counts each file's rows per bucket, so a reader
knows every row's bucket without reading the files:
    source_ids  int32 [n]      source tokens + eos                       (n <= seq_length)
    target_ids  int32 [m + 2]  bos + target tokens + eos                 (m + 1 <= seq_length)
    bucket      int32          padded length of the pair: the smallest bucket boundary
                               >= max(n, m + 1)
    index       int32          dev/test: the pair's position in its split (line in dev.en);
                               train: its position in the inputs

Batches (`create_translation_dataset`): each batch holds `batch_size` *sentences* of one
bucket, padded with pad=0 to that bucket's length L; columns in this order (BATCH_COLUMNS),
all int32 of shape (batch_size, L):
    source_ids         source tokens + eos, padded
    source_mask        1 on real source tokens, 0 on padding
    decoder_input_ids  bos + target tokens (teacher forcing input), padded
    decoder_mask       1 on real decoder positions, 0 on padding (also masks the labels)
    label_ids          target tokens + eos (decoder_input_ids shifted left), padded
With `with_index=True` a sixth column `index` (int32, (batch_size,)) gives each row's index.
Source and target share the bucket length, so a GRAPH-mode network compiles once per bucket.
The batch size is chosen when reading, not when building: the trainer's per-rank batch
(train.global_batch_size / data shards), counted in sentences.
"""

import hashlib
import heapq
import re
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import mindspore.dataset as ms_dataset

from model_zoo.data.buckets import (DEFAULT_BUCKETS, BucketedBatches, assign_buckets,
                                    bucket_boundaries, bucket_counts, bucketed_dataset,
                                    padding_ratio)
from model_zoo.data.corpus import input_bytes
from model_zoo.data.manifest import (built_manifest, check_no_dataset, check_positive,
                                     dataset_ready)
from model_zoo.data.mindrecord import read_mindrecord, write_mindrecord_unless_empty
from model_zoo.data.streaming import (BuildOptions, Piece, PieceCutter, add_piece_arguments,
                                      build_summary, chosen_piece_bytes, count_progress,
                                      finish_build, heldout_draw, input_signature, piece_units,
                                      piece_tokenizer, planned_tokenizer, shard_name,
                                      streaming_build)
from model_zoo.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, UNK_ID,
                                      load_tokenizer_file, train_tokenizer)
from model_zoo.errors import DataError
from model_zoo.files import write_atomically

from .pairs import (BUILTIN_LOCALE_DE, CATALOG, CATALOG_ROOT, MAX_WORDS, MIN_WORDS, PairStart,
                    iter_pairs, pair_entries)

SPLITS = ("train", "dev", "test")
SPLIT_FILES = {split: shard_name(split, 0, 1) for split in SPLITS}   # a one-piece build's
TEXT_SPLITS = ("dev", "test")
DEFAULT_DEV_SIZE = 1000
DEFAULT_TEST_SIZE = 1000
CANDIDATE_FACTOR = 4   # the scan keeps the lowest-drawn groups holding 4 x (dev + test) pairs
ENCODE_BATCH = 10_000  # pairs a worker encodes at a time
RECORD_SCHEMA = {
    "source_ids": {"type": "int32", "shape": [-1]},
    "target_ids": {"type": "int32", "shape": [-1]},
    "bucket": {"type": "int32"},
    "index": {"type": "int32"},
}
READ_COLUMNS = ["source_ids", "target_ids", "index"]
BATCH_COLUMNS = ("source_ids", "source_mask", "decoder_input_ids", "decoder_mask", "label_ids")
INDEX_COLUMN = "index"
NOT_WORD = re.compile(r"[\W_]+")


# ---------------------------------------------------------------------------------------------
# Split

def normalised_source(text):
    """The leakage key of a sentence: lower case, punctuation and spacing ignored."""
    return " ".join(NOT_WORD.sub(" ", text.casefold()).split())


def group_key(source: str) -> int:
    """A 64-bit key of a source sentence's leakage group (its `normalised_source`)."""
    digest = hashlib.blake2b(normalised_source(source).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class HeldOutGroups:
    """Chooses the dev and test groups while the pairs stream past, in bounded memory.

    Each group draws a number from (seed, its key) alone; groups are taken by increasing
    draw and fill dev, then test, with whole groups up to `dev` and `test` pairs (exactly
    those sizes unless large groups are in the way). While counting, only the groups of
    lowest draw holding CANDIDATE_FACTOR x (dev + test) pairs are kept (a group whose draw
    lies above them all can no longer be chosen), and a group grown larger than both dev and
    test is dropped for good: the choice is that of sorting every group whenever the kept
    groups fill both splits.
    """

    def __init__(self, dev: int, test: int, seed: int):
        for name, size in (("dev", dev), ("test", test)):
            if not isinstance(size, int) or size < 0:
                raise DataError(f"{name} size must be a non-negative integer, got {size!r}")
        self.dev, self.test, self.seed = dev, test, seed
        self.limit = CANDIDATE_FACTOR * (dev + test)
        self.groups = {}      # key -> [draw, pairs], the groups that may still be chosen
        self.highest = []     # heap of (-draw, key): the kept group of highest draw first
        self.too_large = set()  # groups of more pairs than dev and test can hold
        self.kept_pairs = 0
        self.pairs = 0
        self.threshold = 1.0  # draws at or above it are out

    def add(self, key: int):
        """Count one pair of group `key`."""
        self.pairs += 1
        if self.limit == 0 or key in self.too_large:
            return
        group = self.groups.get(key)
        if group is None:
            draw = heldout_draw(self.seed, key)
            if draw >= self.threshold:
                return
            group = self.groups[key] = [draw, 0]
            heapq.heappush(self.highest, (-draw, key))
        group[1] += 1
        self.kept_pairs += 1
        if group[1] > max(self.dev, self.test):
            self.too_large.add(key)
            self.kept_pairs -= self.groups.pop(key)[1]
        while self.highest:
            draw, top = self.highest[0]
            if top not in self.groups:   # dropped as too large
                heapq.heappop(self.highest)
            elif self.kept_pairs - self.groups[top][1] >= self.limit:
                heapq.heappop(self.highest)
                self.kept_pairs -= self.groups.pop(top)[1]
                self.threshold = -draw
            else:
                break

    def choose(self) -> dict:
        """{"dev": keys, "test": keys} (sorted) once every pair was added."""
        if self.pairs - self.dev - self.test < 1:
            raise DataError(f"{self.pairs} pairs cannot give {self.dev} dev and {self.test} test "
                            f"pairs and still leave training pairs; use smaller dev/test "
                            f"sizes or more data")
        chosen = {"dev": [], "test": []}
        room = {"dev": self.dev, "test": self.test}
        for key, (_, pairs) in sorted(self.groups.items(), key=lambda item: item[1][0]):
            split = next((name for name in chosen if pairs <= room[name]), None)
            if split is not None:
                chosen[split].append(key)
                room[split] -= pairs
            if not any(room.values()):
                break
        return {split: sorted(keys) for split, keys in chosen.items()}


class PairSplit:
    """Which split a pair belongs to: dev and test hold the chosen groups, train the rest."""

    def __init__(self, chosen: dict):
        self.dev, self.test = set(chosen["dev"]), set(chosen["test"])

    def __call__(self, source: str) -> str:
        key = group_key(source)
        return "dev" if key in self.dev else "test" if key in self.test else "train"


def split_pairs(pairs, dev=DEFAULT_DEV_SIZE, test=DEFAULT_TEST_SIZE, seed=1):
    """Split a list of pairs into {"train", "dev", "test"} as a build does (`HeldOutGroups`):
    pairs whose sources are equal up to case, punctuation and spacing never straddle two
    splits. Each split keeps the input order."""
    pairs = list(pairs)
    groups = HeldOutGroups(dev, test, seed)
    for source, _ in pairs:
        groups.add(group_key(source))
    split_of = PairSplit(groups.choose())
    splits = {name: [] for name in SPLITS}
    for pair in pairs:
        splits[split_of(pair[0])].append(pair)
    return splits


# ---------------------------------------------------------------------------------------------
# Building the dataset

class Examples(NamedTuple):
    """Tokenized pairs: per pair its source ids (+eos), target ids (bos...eos), bucket length
    and index."""

    source_ids: list
    target_ids: list
    buckets: np.ndarray
    indices: np.ndarray


def encode_pairs(tokenizer, pairs, seq_length, boundaries, indices=None):
    """Tokenize pairs into Examples, dropping those longer than `seq_length` on either side
    (source + eos, or bos + target). `indices` (default 0, 1, ... over the kept pairs) are
    the pairs' indices. Returns (examples, kept pairs, dropped count)."""
    pairs = list(pairs)
    sources = tokenizer.encode([source for source, _ in pairs]) if pairs else []  # batch encode
    targets = tokenizer.encode([target for _, target in pairs]) if pairs else []
    source_ids, target_ids, lengths, kept, kept_indices = [], [], [], [], []
    for number, (pair, source, target) in enumerate(zip(pairs, sources, targets)):
        source = np.array(source + [EOS_ID], dtype=np.int32)
        target = np.array([BOS_ID] + target + [EOS_ID], dtype=np.int32)
        length = max(len(source), len(target) - 1)
        if length > seq_length:
            continue
        source_ids.append(source)
        target_ids.append(target)
        lengths.append(length)
        kept.append(pair)
        kept_indices.append(len(kept) - 1 if indices is None else indices[number])
    buckets = assign_buckets(lengths, boundaries) if lengths else np.zeros(0, np.int32)
    examples = Examples(source_ids, target_ids, buckets, np.array(kept_indices, dtype=np.int32))
    return examples, kept, len(pairs) - len(kept)


def concatenate_examples(parts) -> Examples:
    return Examples([ids for part in parts for ids in part.source_ids],
                    [ids for part in parts for ids in part.target_ids],
                    np.concatenate([part.buckets for part in parts] or [np.zeros(0, np.int32)]),
                    np.concatenate([part.indices for part in parts] or [np.zeros(0, np.int32)]))


def token_counts(examples, seq_length):
    """(real tokens, tokens when padded to buckets, tokens when padded to seq_length), counting
    the source and the decoder side (bos + target) of every pair."""
    real = sum(len(s) + len(t) - 1 for s, t in zip(examples.source_ids, examples.target_ids))
    bucketed = 2 * int(np.sum(examples.buckets, dtype=np.int64))
    return real, bucketed, 2 * seq_length * len(examples.source_ids)


class PairCorpus:
    """The sentence pairs of a build's sources as `streaming_build` reads them: scanned by
    `scan_pairs`, split by `PairSplit`."""

    unit = "sentence pairs"
    start_type = PairStart

    def __init__(self, sources, languages, dev_size, test_size, seed):
        self.entries = pair_entries(sources, languages)
        self.dev_size, self.test_size, self.seed = dev_size, test_size, seed

    def signature(self) -> list:
        """The inputs' kinds, keys and files (a catalog's .mo files) with sizes and times."""
        signature = []
        for entry in self.entries:
            files = entry.files() or sorted(
                Path(CATALOG_ROOT, entry.paths[0], "LC_MESSAGES").glob("*.mo"))
            signature.append([entry.kind, *entry.paths, *entry.languages,
                              *input_signature(files)])
        return signature

    def scan(self, options: BuildOptions) -> dict:
        return scan_pairs(self.entries, dev_size=self.dev_size, test_size=self.test_size,
                          seed=self.seed, piece_bytes=options.piece_bytes(),
                          num_files=options.num_files)

    def rule(self, plan: dict):
        return plan["held_out_groups"]


def scan_pairs(entries, *, dev_size, test_size, seed, piece_bytes=None, num_files=None) -> dict:
    """Pass 1 of a build: the pieces of the inputs (as `model_zoo.data.streaming.scan_corpus`
    cuts documents; a gzipped file only where it starts), the dev and test groups
    (`HeldOutGroups`) and each input's counts, as a JSON-ready dict."""
    total = sum(_entry_bytes(entry) for entry in entries)
    cutter = PieceCutter(chosen_piece_bytes(total, piece_bytes, num_files))
    groups = HeldOutGroups(dev_size, test_size, seed)
    gzipped = [any(path.suffix == ".gz" for path in entry.files()) for entry in entries]
    stats, entry = {}, None
    for index, pair in enumerate(iter_pairs(entries, stats=stats)):
        # a gzipped input is cut only where it starts (see scan_corpus)
        first_of_entry, entry = pair.start.entry != entry, pair.start.entry
        cutter.add(index, pair.start, pair.size, cuttable=first_of_entry or not gzipped[entry])
        groups.add(group_key(pair.source))
    return dict(cutter.plan(), held_out_groups=groups.choose(), source_stats=stats)


def _entry_bytes(entry) -> int:
    if entry.kind == CATALOG:
        return sum(pair.size for pair in iter_pairs([entry]))
    return sum(input_bytes(path) for path in entry.files())


def train_lines(entries, split_of):
    """Both sides of every train pair (pass 2: the tokenizer's input)."""
    for pair in iter_pairs(entries):
        if split_of(pair.source) == "train":
            yield pair.source
            yield pair.target


def build_translation_dataset(output_dir, sources, *, vocab_size, seq_length,
                              dev_size=DEFAULT_DEV_SIZE, test_size=DEFAULT_TEST_SIZE, seed=1,
                              buckets=DEFAULT_BUCKETS, languages=("en", "de"),
                              options=BuildOptions(), source=None, batch_size=None,
                              record_sources=True):
    """Build a translation dataset from `sources` (`pairs.pair_entries`) into `output_dir`
    and return its dataset.json.

    The build streams (`model_zoo.data.streaming`): a scan chooses the dev and test groups
    (`HeldOutGroups`) and cuts the inputs into pieces; the joint tokenizer is trained on (a
    sample of `options.tokenizer_sentences` lines of) the train split; `options.workers`
    processes encode the pieces' train pairs into their own files, each dropping pairs
    longer than `seq_length` tokens on either side and sorting its rows by bucket; the dev
    and test pairs the pieces found are written last, with their text files. An unfinished
    earlier build with the same settings and inputs is resumed; a complete dataset is never
    overwritten. `sources` are recorded for `data.sources` checks unless `record_sources` is
    False.

    Batches are formed when reading (`create_translation_dataset`), so the files serve any
    batch size and number of ranks. `batch_size` (optional, sentences per global step) only
    adds the number of full train batches per epoch at that size to the manifest.
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    check_positive("vocab_size", vocab_size)
    check_positive("seq_length", seq_length)
    if batch_size is not None:
        check_positive("batch_size", batch_size)
    boundaries = bucket_boundaries(seq_length, buckets)
    corpus = PairCorpus(sources, languages, dev_size, test_size, seed)

    def tokenizer_for(plan, chosen, entries):
        return planned_tokenizer(output_dir, plan, output_dir / TOKENIZER_FILE, lambda: (
            train_tokenizer(train_lines(entries, PairSplit(chosen)), output_dir / TOKENIZER_FILE,
                            vocab_size, sentences=options.tokenizer_sentences, seed=seed)))

    settings = {"vocab_size": vocab_size, "seq_length": seq_length, "buckets": list(boundaries),
                "dev_size": dev_size, "test_size": test_size, "split_seed": seed}
    plan, records, tokenizer = streaming_build(
        output_dir, sources, options, settings=settings, splits=SPLITS,
        label="transformer data", tokenizer_for=tokenizer_for,
        build_piece=build_translation_piece, corpus=corpus,
        job={"seq_length": seq_length, "boundaries": list(boundaries)})

    summary = {"train": _train_summary(records, boundaries, seq_length)}
    if summary["train"]["kept"] == 0:
        raise DataError(f"no training pair fits seq_length={seq_length}")
    for split in TEXT_SPLITS:
        found = [pair for record in records for pair in record["held_out"][split]]
        summary[split] = _write_held_out(output_dir, split, found, tokenizer, seq_length,
                                         boundaries, languages)
    kept_total = sum(part["kept"] for part in summary.values())
    found_total = sum(part["pairs"] for part in summary.values())
    manifest = {
        "source": source,
        "languages": {"source": languages[0], "target": languages[1]},
        "pairs": {"found": found_total, "kept": kept_total,
                  "dropped_too_long": found_total - kept_total},
        "vocab_size": vocab_size,
        "seq_length": seq_length,
        "buckets": list(boundaries),
        "seed": seed,
        "dev_size": dev_size,
        "test_size": test_size,
        "tokenizer": TOKENIZER_FILE,
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "record_columns": list(RECORD_SCHEMA),
        "batch_columns": list(BATCH_COLUMNS),
        "batch_size_unit": "sentences",
        "padding_ratio": summary["train"]["padding_ratio"],
        "splits": summary,
        "source_stats": plan["source_stats"],
        "build": dict(build_summary(plan), seconds=round(time.perf_counter() - started, 1)),
    }
    manifest["build"]["pairs"] = manifest["build"].pop("documents")
    if batch_size is not None:
        manifest["train_batches_per_epoch"] = {
            "batch_size": batch_size,
            "batches": sum(count // batch_size for count
                           in summary["train"]["examples_per_bucket"].values())}
    return finish_build(output_dir, manifest, sources, records, record_sources)


def build_translation_piece(job: dict, piece: Piece) -> dict:
    """Encode one piece's train pairs into its train file, rows sorted by bucket, and return
    its record with the dev and test pairs it holds (a worker's task; see
    `model_zoo.data.streaming.build_pieces`)."""
    tokenizer = piece_tokenizer(job, load_tokenizer_file)
    split_of = PairSplit(job["rule"])
    held_out = {split: [] for split in TEXT_SPLITS}
    parts, batch, pairs, dropped = [], [], 0, 0

    def encode(batch):
        examples, _, too_long = encode_pairs(tokenizer, [pair[:2] for _, pair in batch],
                                             job["seq_length"], job["boundaries"],
                                             indices=[index for index, _ in batch])
        count_progress(len(batch), token_counts(examples, job["seq_length"])[0],
                       sum(pair[2] for _, pair in batch))
        return examples, too_long

    entries = job["entries"]
    stream = iter_pairs(entries, piece.start)
    for index, pair in piece_units(stream, piece, " and ".join(entries[piece.start.entry].paths)):
        split = split_of(pair.source)
        if split != "train":
            held_out[split].append([index, pair.source, pair.target])
            count_progress(1, 0, pair.size)
            continue
        pairs += 1
        batch.append((index, (pair.source, pair.target, pair.size)))
        if len(batch) == ENCODE_BATCH:
            examples, too_long = encode(batch)
            parts.append(examples)
            dropped += too_long
            batch = []
    if batch:
        examples, too_long = encode(batch)
        parts.append(examples)
        dropped += too_long
    examples = concatenate_examples(parts)
    name = shard_name("train", piece.index, job["pieces"])
    written = _write_examples(Path(job["output_dir"]) / name, examples,
                              f"train pairs of piece {piece.index}")
    return {"splits": {"train": {
                "files": [name] if written else [],
                "file_buckets": [_bucket_counts(examples.buckets)] if written else [],
                "pairs": pairs, "kept": len(examples.source_ids), "dropped_too_long": dropped,
                "tokens": token_counts(examples, job["seq_length"])[0]}},
            "held_out": held_out}


def _bucket_counts(buckets) -> dict:
    """`bucket_counts` with the bucket lengths as JSON keys."""
    return {str(length): count for length, count in bucket_counts(buckets).items()}


def _padding(real: int, bucketed: int, full: int) -> dict:
    """dataset.json's padding_ratio: padded to buckets and to seq_length."""
    return {"bucketed": round(padding_ratio(real, bucketed), 4),
            "full_length": round(padding_ratio(real, full), 4)}


def _write_examples(path, examples, description) -> int:
    """Write Examples as a MindRecord file, rows sorted by (bucket, index); the rows
    written (no file for none)."""
    order = np.lexsort((examples.indices, examples.buckets))
    rows = ({"source_ids": examples.source_ids[i], "target_ids": examples.target_ids[i],
             "bucket": np.int32(examples.buckets[i]), "index": np.int32(examples.indices[i])}
            for i in order)
    return write_mindrecord_unless_empty(path, RECORD_SCHEMA, rows, description=description)


def _summary(examples, seq_length, pairs, dropped, files, file_buckets) -> dict:
    real, bucketed, full = token_counts(examples, seq_length)
    return {"files": files, "file_buckets": file_buckets, "pairs": pairs,
            "kept": len(examples.source_ids), "dropped_too_long": dropped, "tokens": real,
            "examples_per_bucket": _bucket_counts(examples.buckets),
            "padding_ratio": _padding(real, bucketed, full)}


def _train_summary(records, boundaries, seq_length) -> dict:
    """The train split's entry of dataset.json, from the pieces' records."""
    parts = [record["splits"]["train"] for record in records]
    per_bucket = {str(b): sum(counts.get(str(b), 0) for part in parts
                              for counts in part["file_buckets"]) for b in boundaries}
    per_bucket = {b: count for b, count in per_bucket.items() if count}
    real = sum(part["tokens"] for part in parts)
    kept = sum(part["kept"] for part in parts)
    bucketed = 2 * sum(int(b) * count for b, count in per_bucket.items())
    return {"files": [name for part in parts for name in part["files"]],
            "file_buckets": [counts for part in parts for counts in part["file_buckets"]],
            "pairs": sum(part["pairs"] for part in parts), "kept": kept,
            "dropped_too_long": sum(part["dropped_too_long"] for part in parts),
            "tokens": real, "examples_per_bucket": per_bucket,
            "padding_ratio": _padding(real, bucketed, 2 * seq_length * kept)}


def _write_held_out(output_dir, split, found, tokenizer, seq_length, boundaries,
                    languages) -> dict:
    """Write a dev or test split (its pairs in input order, indexed 0, 1, ... after the
    pairs too long are dropped) and its text files; its entry of dataset.json."""
    found.sort()
    examples, kept, dropped = encode_pairs(tokenizer, [(s, t) for _, s, t in found],
                                           seq_length, boundaries)
    name = SPLIT_FILES[split]
    written = _write_examples(output_dir / name, examples,
                              f"{split} {languages[0]}->{languages[1]} pairs")
    summary = _summary(examples, seq_length, len(found), dropped, [name] if written else [],
                       [_bucket_counts(examples.buckets)] if written else [])
    summary["text"] = {}
    for lang, side in zip(languages, (0, 1)):
        text_name = f"{split}.{lang}"
        write_atomically(output_dir / text_name, "".join(pair[side] + "\n" for pair in kept))
        summary["text"][lang] = text_name
    return summary


def translation_dataset_ready(output_dir, vocab_size, seq_length, languages=("en", "de")):
    """True if `output_dir` holds a complete translation dataset for this vocab_size,
    seq_length and languages (source, target); False if it holds none. DataError if it was
    built with others or if files are missing."""
    def files(manifest):
        if any("file_buckets" not in part for part in manifest.get("splits", {}).values()):
            raise DataError(f"{output_dir}: built by an earlier version of model-zoo (its "
                            f"dataset.json has no per-file bucket counts); delete it and build "
                            f"again")
        names = [TOKENIZER_FILE]
        for split, part in manifest.get("splits", {}).items():
            names.extend(part.get("files", [SPLIT_FILES.get(split)]))
            names.extend(part.get("text", {}).values())
        return names
    asked = {"vocab_size": vocab_size, "seq_length": seq_length,
             "languages": {"source": languages[0], "target": languages[1]}}
    return dataset_ready(output_dir, asked, files)


# ---------------------------------------------------------------------------------------------
# Reading

def split_rows(dataset_dir, split):
    """(the split's MindRecord files, the bucket of every row of them in order), from
    dataset.json's per-file bucket counts (each file's rows are sorted by bucket)."""
    if split not in SPLIT_FILES:
        raise DataError(f"unknown split {split!r} (splits: {', '.join(SPLITS)})")
    manifest = built_manifest(dataset_dir)
    part = manifest["splits"][split]
    paths = [str(Path(dataset_dir) / name) for name in part["files"]]
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: file not found (dataset.json lists it)")
    buckets = []
    for counts in part["file_buckets"]:   # a file's rows are sorted by bucket
        ordered = sorted((int(bucket), count) for bucket, count in counts.items())
        buckets.append(np.repeat(np.array([b for b, _ in ordered], np.int32),
                                 [count for _, count in ordered]))
    return paths, np.concatenate(buckets) if buckets else np.zeros(0, np.int32)


def reference_file(dataset_dir, split) -> str:
    """The text file of a dev or test split's target sentences, line i the row of index i."""
    manifest = built_manifest(dataset_dir)
    texts = manifest["splits"].get(split, {}).get("text")
    if not texts:
        raise DataError(f"{dataset_dir}: split {split!r} has no text files "
                        f"(splits with text: {', '.join(TEXT_SPLITS)})")
    return str(Path(dataset_dir) / texts[manifest["languages"]["target"]])


def read_examples(dataset_dir, split) -> Examples:
    """A split's rows in index order (dev/test: the order of their text files) as Examples."""
    paths, _ = split_rows(dataset_dir, split)
    rows = [row for path in paths for row in read_mindrecord(path, list(RECORD_SCHEMA))]
    rows.sort(key=lambda row: int(row["index"]))
    return Examples([row["source_ids"] for row in rows], [row["target_ids"] for row in rows],
                    np.array([row["bucket"] for row in rows], dtype=np.int32),
                    np.array([row["index"] for row in rows], dtype=np.int32))


def make_batch(rows, length, with_index=False):
    """The BATCH_COLUMNS arrays for `rows` ((source ids, target ids, index) each) padded to
    `length`."""
    count = len(rows)
    source_ids = np.full((count, length), PAD_ID, dtype=np.int32)
    source_mask = np.zeros((count, length), dtype=np.int32)
    decoder_input_ids = np.full((count, length), PAD_ID, dtype=np.int32)
    decoder_mask = np.zeros((count, length), dtype=np.int32)
    label_ids = np.full((count, length), PAD_ID, dtype=np.int32)
    for row, (source, target, _) in enumerate(rows):
        source_ids[row, :len(source)] = source
        source_mask[row, :len(source)] = 1
        decoder_length = len(target) - 1
        decoder_input_ids[row, :decoder_length] = target[:-1]
        label_ids[row, :decoder_length] = target[1:]
        decoder_mask[row, :decoder_length] = 1
    batch = (source_ids, source_mask, decoder_input_ids, decoder_mask, label_ids)
    if with_index:
        batch += (np.array([int(index) for _, _, index in rows], dtype=np.int32),)
    return batch


def create_translation_dataset(dataset_dir, split, batch_size, *, num_shards=1, shard_id=0,
                               seed=1, shuffle=True, skip_batches=0, repeat=True,
                               drop_remainder=True, with_index=False):
    """This rank's bucketed batches of a split, as a MindSpore dataset (columns BATCH_COLUMNS).

    `batch_size` sentences per rank; a global step takes `batch_size * num_shards` pairs of one
    bucket and rank `shard_id` reads its slice, so all ranks feed the same shape and together
    read the global batch (see model_zoo.data.buckets). The order depends only on `seed` (and
    the epoch); `skip_batches` resumes at a step with the batches an uninterrupted run would
    see. With `repeat` the dataset is endless. For evaluation use shuffle=False, repeat=False,
    drop_remainder=False (the last batch of a bucket may then be smaller) and with_index=True.

    Only the rows' buckets (from dataset.json) are held in memory: each epoch, the rows this
    rank needs are read from the files in the order it needs them (MindDataset with a
    SubsetSampler), as the batches are taken.
    """
    paths, buckets = split_rows(dataset_dir, split)
    if not buckets.size:
        raise DataError(f"{dataset_dir}: its {split} split holds no sentence pairs")

    def read_batches(schedule):   # [(bucket length, row numbers)] of the rest of an epoch
        order = np.concatenate([members for _, members in schedule]).tolist()
        rows = ms_dataset.MindDataset(
            paths, columns_list=READ_COLUMNS, sampler=ms_dataset.SubsetSampler(order),
            num_parallel_workers=1).create_tuple_iterator(output_numpy=True, num_epochs=1)
        for length, members in schedule:
            yield make_batch([next(rows) for _ in members], length, with_index)

    batches = BucketedBatches(
        buckets, read_batches, batch_size, num_shards=num_shards, shard_id=shard_id, seed=seed,
        shuffle=shuffle, skip_batches=skip_batches, repeat=repeat, drop_remainder=drop_remainder)
    columns = BATCH_COLUMNS + ((INDEX_COLUMN,) if with_index else ())
    return bucketed_dataset(batches, columns)


# ---------------------------------------------------------------------------------------------
# Command line

def add_data_arguments(parser):
    """Arguments of `model-zoo data transformer`."""
    parser.add_argument("--input", nargs="+", default=[], metavar="SOURCE",
                        help=f"{BUILTIN_LOCALE_DE} for the English-German pairs of the system's "
                             f"message catalogs, SOURCE_FILE:TARGET_FILE parallel text files, "
                             f"or a file of pairs: .tsv (source TAB target) or .jsonl (the "
                             f"--source-lang and --target-lang fields), either gzipped")
    parser.add_argument("--source", action="append", default=[], metavar="FILE",
                        help="source-language text, one sentence per line (with --target)")
    parser.add_argument("--target", action="append", default=[], metavar="FILE",
                        help="its translation, line by line")
    parser.add_argument("--output-dir", required=True, help="directory to build the dataset in")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="joint tokenizer vocabulary size")
    parser.add_argument("--seq-length", type=int, required=True,
                        help="longest sequence in tokens (longer pairs are dropped)")
    parser.add_argument("--dev-size", type=int, default=DEFAULT_DEV_SIZE,
                        help=f"pairs in the dev split (default {DEFAULT_DEV_SIZE})")
    parser.add_argument("--test-size", type=int, default=DEFAULT_TEST_SIZE,
                        help=f"pairs in the test split (default {DEFAULT_TEST_SIZE})")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS),
                        metavar="N", help="bucket lengths, capped at --seq-length (default "
                                          f"{' '.join(map(str, DEFAULT_BUCKETS))})")
    parser.add_argument("--source-lang", default="en", help="source language code (default en)")
    parser.add_argument("--target-lang", default="de", help="target language code (default de)")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the split and the tokenizer's sample (default 1)")
    add_piece_arguments(parser)


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print what was found."""
    output_dir = Path(args.output_dir)
    if len(args.source) != len(args.target):
        raise DataError(f"give as many --target files as --source files "
                        f"({len(args.source)} --source, {len(args.target)} --target)")
    sources = list(args.input) + [f"{s}:{t}" for s, t in zip(args.source, args.target)]
    if not sources:
        raise DataError(f"no input: use --input {BUILTIN_LOCALE_DE}, --input SOURCE:TARGET or "
                        f"--source FILE --target FILE")
    started = time.perf_counter()
    options = BuildOptions(seed=args.seed, workers=args.workers, shard_size=args.shard_size,
                           num_files=args.num_files,
                           tokenizer_sentences=args.tokenizer_sentences)
    manifest = build_translation_dataset(
        output_dir, sources, vocab_size=args.vocab_size, seq_length=args.seq_length,
        dev_size=args.dev_size, test_size=args.test_size, seed=args.seed,
        source=" ".join(sources), buckets=args.buckets,
        languages=(args.source_lang, args.target_lang), options=options)
    for source, found in manifest["source_stats"].items():
        print(f"{source}: {_describe_source(found)}")
    splits, padding = manifest["splits"], manifest["padding_ratio"]
    print(f"transformer dataset: {manifest['pairs']['found']} pairs found, "
          f"{manifest['pairs']['kept']} kept, {manifest['pairs']['dropped_too_long']} dropped "
          f"(longer than {args.seq_length} tokens); kept/split: "
          + ", ".join(f"{s} {splits[s]['kept']}/{splits[s]['pairs']}" for s in SPLITS)
          + f"; vocab {args.vocab_size}; buckets {manifest['buckets']}; train padding "
            f"{padding['bucketed']:.1%} bucketed vs {padding['full_length']:.1%} at full length; "
            f"{len(splits['train']['files'])} train file(s); "
            f"{time.perf_counter() - started:.1f} s; in {output_dir}")


def _describe_source(found):
    if "entries" in found:
        skipped = found["files_skipped"]
        return (f"{found['kept']} pairs from {found['entries']} entries of {found['files_read']} "
                f"catalogs in {found['directory']}"
                + (f" ({len(skipped)} unreadable skipped: {', '.join(skipped)})" if skipped else "")
                + f"; dropped: {found['untranslated']} untranslated, {found['technical']} "
                  f"placeholders/options/paths, {found['too_short']} under {MIN_WORDS} words, "
                  f"{found['too_long']} over {MAX_WORDS} words, {found['duplicate']} duplicates, "
                  f"{found['header'] + found['plural'] + found['context']} header/plural/context")
    return f"{found['kept']} pairs from {found['lines']} lines ({found['blank']} blank skipped)"

