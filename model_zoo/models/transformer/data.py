"""Translation dataset: sentence pairs, a leak-free split, a joint SentencePiece vocabulary
and length-bucketed MindRecord files.

Sources of sentence pairs:
    builtin:locale-de        English -> German pairs from the system's gettext message
                             catalogs (/usr/share/locale/de/LC_MESSAGES/*.mo), filtered to
                             real phrases and sentences (`message_catalog_pairs`)
    SOURCE_FILE:TARGET_FILE  the user's parallel text, one sentence per line
                             (`read_parallel_files`)
    PAIRS.tsv, PAIRS.jsonl   a file of pairs, optionally gzipped (`read_pair_file`)

A built dataset directory holds:
    tokenizer.model              joint SentencePiece model of both languages, trained on the
                                 train split (pad=0, unk=1, bos=2, eos=3)
    train.mindrecord (+ .db)     one row per sentence pair (columns below), in split order
    dev.mindrecord (+ .db)
    test.mindrecord (+ .db)
    dev.en dev.de test.en test.de  the dev/test pairs as plain text, one per line: line i is
                                 the row with index i (references for sacreBLEU)
    dataset.json                 what was built; written last, it marks a complete dataset

MindRecord columns (RECORD_SCHEMA), one row per pair:
    source_ids  int32 [n]      source tokens + eos                       (n <= seq_length)
    target_ids  int32 [m + 2]  bos + target tokens + eos                 (m + 1 <= seq_length)
    bucket      int32          padded length of the pair: the smallest bucket boundary
                               >= max(n, m + 1)
    index       int32          position of the pair in its split (line in dev.en / dev.de)

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

import gettext
import json
import re
import time
from pathlib import Path
from typing import List, NamedTuple, Tuple

import numpy as np

from model_zoo.data.buckets import (
    DEFAULT_BUCKETS,
    BucketedBatches,
    assign_buckets,
    bucket_boundaries,
    bucket_counts,
    bucketed_dataset,
    padding_ratio,
)
from model_zoo.data.manifest import (check_no_dataset, check_positive, dataset_ready,
                                     write_manifest)
from model_zoo.data.mindrecord import read_mindrecord, write_mindrecord
from model_zoo.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, UNK_ID,
                                      train_tokenizer)
from model_zoo.errors import DataError
from model_zoo.files import write_atomically

SPLITS = ("train", "dev", "test")
SPLIT_FILES = {split: f"{split}.mindrecord" for split in SPLITS}
TEXT_SPLITS = ("dev", "test")
CATALOG_ROOT = "/usr/share/locale"
BUILTIN_LOCALE_PREFIX = "builtin:locale-"
PAIR_FILE_SUFFIXES = (".tsv", ".jsonl")   # a file of pairs, optionally .gz
BUILTIN_LOCALE_DE = "builtin:locale-de"
DEFAULT_DEV_SIZE = 1000
DEFAULT_TEST_SIZE = 1000
MIN_WORDS = 2
MAX_WORDS = 60
RECORD_SCHEMA = {
    "source_ids": {"type": "int32", "shape": [-1]},
    "target_ids": {"type": "int32", "shape": [-1]},
    "bucket": {"type": "int32"},
    "index": {"type": "int32"},
}
BATCH_COLUMNS = ("source_ids", "source_mask", "decoder_input_ids", "decoder_mask", "label_ids")
INDEX_COLUMN = "index"

Pair = Tuple[str, str]

# printf (%s, %-10.3lu, %1$s, %%), Python (%(name)s, {0}, {name}), shell ($HOME, ${VAR}) and
# <placeholder> forms. No space flag: "50% of" is not a placeholder.
PLACEHOLDER = re.compile(
    r"%(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t|I64)?"
    r"[diouxXeEfFgGaAcspnmS%]"
    r"|%\([^)\s]*\)[a-zA-Z]|\{[^{}\s]*\}|\$\{?\w+\}?|<[^<>\s]+>")
OPTION = re.compile(r"^[\[(\"'`]*--?[A-Za-z0-9?]")
PATH_OR_URL = re.compile(r"^[\[(\"'`«»„“‘]*(?:/|~/|\.\.?/|[A-Za-z]:\\)|://|^\S+@\S+\.\w+")
LETTERS = re.compile(r"[^\W\d_]{2,}")
# A word: starts with a letter; letters and digits joined by - ' ’ . /; opening brackets or
# quotes before it, closing ones and punctuation after it.
WORD = re.compile(r"^[(\[{\"'«»„“‘‚¿¡]*[^\W\d_][^\W_]*(?:[-'’./][^\W_]+)*"
                  r"[-)\]}\"'»«“”’‘.,:;!?…]*$")
MNEMONIC = re.compile(r"_(?=[^\W\d_])")
NOT_WORD = re.compile(r"[\W_]+")


# ---------------------------------------------------------------------------------------------
# Sentence pairs

def message_catalog_pairs(locale="de", root=CATALOG_ROOT, *, stats=None) -> List[Pair]:
    """English -> `locale` pairs from the gettext catalogs in `root/<locale>/LC_MESSAGES/*.mo`.

    Files are read in sorted order (unreadable ones are skipped and named in `stats`). Kept are
    msgid -> msgstr entries that are phrases: the header, plural and context entries,
    untranslated entries, strings made mostly of placeholders, options or paths, strings of
    fewer than 2 words on the English side (a word starts with a letter and holds no
    underscore, so identifiers such as fts_close are not words) and strings of more than 60
    tokens on either side are dropped. Whitespace is normalised (multi-line entries become one
    line) and GTK mnemonic underscores ("_Open") are removed. The first entry of each English
    string wins. If `stats` is a dict, it receives the counts of each reason and the files
    read and skipped.
    """
    directory = Path(root) / locale / "LC_MESSAGES"
    files = sorted(directory.glob("*.mo"))
    if not files:
        raise DataError(f"{directory}: no message catalogs (*.mo) found for locale {locale!r}")
    counts = dict.fromkeys(("entries", "header", "plural", "context", "untranslated",
                            "technical", "too_short", "too_long", "duplicate", "kept"), 0)
    skipped, seen, pairs = [], set(), []
    for path in files:
        catalog = _read_catalog(path)
        if catalog is None:
            skipped.append(path.name)
            continue
        for msgid, msgstr in catalog.items():
            counts["entries"] += 1
            reason, pair = _catalog_entry(msgid, msgstr)
            if reason is None and pair[0] in seen:
                reason = "duplicate"
            if reason is not None:
                counts[reason] += 1
                continue
            seen.add(pair[0])
            pairs.append(pair)
    counts["kept"] = len(pairs)
    if stats is not None:
        stats.update(counts, directory=str(directory), files_read=len(files) - len(skipped),
                     files_skipped=skipped)
    return pairs


def _read_catalog(path):
    try:
        with open(path, "rb") as handle:
            return gettext.GNUTranslations(handle)._catalog  # pylint: disable=protected-access
    except (OSError, UnicodeDecodeError, LookupError, ValueError, TypeError):
        return None  # corrupt, or a charset the header misstates


def _catalog_entry(msgid, msgstr):
    """(reason to drop or None, (english, translation))."""
    if not isinstance(msgid, str):  # gettext keys plural forms as (msgid, n)
        return "plural", None
    if msgid == "":
        return "header", None
    if "\x00" in msgid or "\x00" in msgstr:
        return "plural", None
    if "\x04" in msgid:
        return "context", None
    english, translation = _strip_mnemonics(" ".join(msgid.split()), " ".join(msgstr.split()))
    if not translation or english.casefold() == translation.casefold():
        return "untranslated", None
    return _phrase_check(english, translation), (english, translation)


def _phrase_check(english, translation):
    tokens = english.split()
    technical = [_is_technical(token) for token in tokens]
    if 2 * sum(technical) > len(tokens):
        return "technical"
    words = sum(not tech and bool(WORD.match(PLACEHOLDER.sub("", token)))
                for token, tech in zip(tokens, technical))
    if words < MIN_WORDS:
        return "too_short"
    if max(len(tokens), len(translation.split())) > MAX_WORDS:
        return "too_long"
    return None


def _is_technical(token):
    """A placeholder, option, path, URL or e-mail, or a token without a word in it."""
    if OPTION.match(token) or PATH_OR_URL.search(token):
        return True
    return not LETTERS.search(PLACEHOLDER.sub(" ", token))


def _strip_mnemonics(english, translation):
    """Remove GTK keyboard-accelerator underscores ("_Open" / "Ö_ffnen") from both sides.

    Only when the English has exactly one underscore before a letter and its word does not
    recur in the translation (where it would be an identifier such as max_connections).
    """
    if english.count("_") != 1 or not MNEMONIC.search(english):
        return english, translation
    word = next(token for token in english.split() if "_" in token)
    if word in translation.split():
        return english, translation
    return MNEMONIC.sub("", english, count=1), MNEMONIC.sub("", translation, count=1)


def read_parallel_files(source_path, target_path, *, stats=None) -> List[Pair]:
    """Sentence pairs from two UTF-8 files with one sentence per line.

    Whitespace is normalised; lines where either side is blank are skipped (counted in
    `stats["blank"]` when `stats` is a dict). DataError names the file for a missing or
    non-UTF-8 file (with the line), and both files and their line counts when they differ.
    """
    source_lines = _read_lines(Path(source_path))
    target_lines = _read_lines(Path(target_path))
    if len(source_lines) != len(target_lines):
        raise DataError(f"parallel files differ in length: {source_path} has "
                        f"{len(source_lines)} lines but {target_path} has {len(target_lines)}; "
                        f"they need one sentence per line, line i translating line i")
    pairs, blank = _normalised_pairs(zip(source_lines, target_lines))
    if not pairs:
        raise DataError(f"{source_path} and {target_path}: no line pair with text on both sides")
    if stats is not None:
        stats.update(lines=len(source_lines), blank=blank, kept=len(pairs))
    return pairs


def _normalised_pairs(raw_pairs):
    """(the pairs with whitespace normalised, how many were skipped for a blank side)."""
    pairs, blank = [], 0
    for sides in raw_pairs:
        source, target = (" ".join(side.split()) for side in sides)
        if source and target:
            pairs.append((source, target))
        else:
            blank += 1
    return pairs, blank


def _read_lines(path):
    """The lines of a UTF-8 text file (gzipped for .gz), without their line ends."""
    from model_zoo.data.corpus import decoded_lines
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    return [text.rstrip("\r") for text, _ in decoded_lines(path)]


def read_pair_file(path, languages=("en", "de"), *, stats=None) -> List[Pair]:
    """Sentence pairs from one file, optionally gzipped: `.tsv`, a source and its
    translation on each line, separated by a tab; or `.jsonl`, one object a line whose
    `languages` keys (source, target) hold them, at the top level or under "translation"
    (the layout of Hugging Face translation datasets).

    Whitespace is normalised and pairs with a blank side skipped, as in
    `read_parallel_files`; DataError names the file and line of a malformed one.
    """
    from model_zoo.data.corpus import decoded_lines
    path = Path(path)
    json_lines = path.name.removesuffix(".gz").endswith(".jsonl")
    raw_pairs = []
    for text, number in decoded_lines(path):
        if not text.strip():
            continue
        if json_lines:
            sides = _json_pair(path, number, text, languages)
        else:
            sides = text.rstrip("\r").split("\t")
            if len(sides) != 2:
                raise DataError(f"{path} line {number}: {len(sides)} tab-separated fields, "
                                f"expected 2 (source, then its translation)")
        raw_pairs.append(sides)
    lines = len(raw_pairs)
    pairs, blank = _normalised_pairs(raw_pairs)
    if not pairs:
        raise DataError(f"{path}: no pair with text on both sides")
    if stats is not None:
        stats.update(lines=lines, blank=blank, kept=len(pairs))
    return pairs


def _json_pair(path, number, text, languages):
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path} line {number}: not JSON ({error.msg} at column "
                        f"{error.colno})") from None
    if isinstance(record, dict) and isinstance(record.get("translation"), dict):
        record = record["translation"]
    if not isinstance(record, dict) or any(lang not in record for lang in languages):
        raise DataError(f"{path} line {number}: no {' and '.join(map(repr, languages))} "
                        f"fields (give the languages with --source-lang and --target-lang)")
    sides = [record[lang] for lang in languages]
    if not all(isinstance(side, str) for side in sides):
        raise DataError(f"{path} line {number}: the {' and '.join(languages)} fields must "
                        f"be text")
    return sides


def is_pair_file(source: str) -> bool:
    """Whether a source names one file of pairs (`read_pair_file`), rather than
    SOURCE_FILE:TARGET_FILE."""
    return source.removesuffix(".gz").endswith(PAIR_FILE_SUFFIXES) and (
        ":" not in source or Path(source).is_file())


def load_pairs(sources, *, stats=None, languages=("en", "de")) -> List[Pair]:
    """The pairs of every source in order: `builtin:locale-de` (or another locale code),
    a file of pairs (`.tsv`, `.jsonl`, gzipped or not; `languages` are its JSON keys) or
    `SOURCE_FILE:TARGET_FILE`. If `stats` is a dict, it receives {source: its stats}."""
    sources = list(sources)
    if not sources:
        raise DataError(f"no input given: use {BUILTIN_LOCALE_DE} or SOURCE_FILE:TARGET_FILE")
    pairs = []
    for source in sources:
        found = {}
        if source.startswith(BUILTIN_LOCALE_PREFIX):
            pairs.extend(message_catalog_pairs(source[len(BUILTIN_LOCALE_PREFIX):], stats=found))
        elif source.startswith("builtin:"):
            raise DataError(f"{source}: unknown built-in corpus (available: {BUILTIN_LOCALE_DE})")
        elif is_pair_file(source):
            pairs.extend(read_pair_file(source, languages, stats=found))
        else:
            pairs.extend(read_parallel_files(*_file_pair(source), stats=found))
        if stats is not None:
            stats[source] = found
    return pairs


def _file_pair(source):
    """Split SOURCE_FILE:TARGET_FILE at the first colon that leaves two existing files."""
    colons = [i for i, char in enumerate(source) if char == ":"]
    if not colons:
        raise DataError(f"{source!r}: expected SOURCE_FILE:TARGET_FILE or {BUILTIN_LOCALE_DE}")
    for i in colons:
        if Path(source[:i]).is_file() and Path(source[i + 1:]).is_file():
            return source[:i], source[i + 1:]
    return source[:colons[0]], source[colons[0] + 1:]


# ---------------------------------------------------------------------------------------------
# Split

def normalised_source(text):
    """The leakage key of a sentence: lower case, punctuation and spacing ignored."""
    return " ".join(NOT_WORD.sub(" ", text.casefold()).split())


def split_pairs(pairs, dev=DEFAULT_DEV_SIZE, test=DEFAULT_TEST_SIZE, seed=1):
    """Split pairs into {"train", "dev", "test"} without leakage between them.

    Pairs whose source sentences are equal up to case, punctuation and spacing form one group,
    and a group never straddles two splits. Groups are taken in an order permuted with `seed`
    and fill dev, then test, with whole groups up to `dev` and `test` pairs (exactly those sizes
    unless large groups are in the way); the rest is train. Each split keeps the input order.
    """
    pairs = list(pairs)
    for name, size in (("dev", dev), ("test", test)):
        if not isinstance(size, int) or size < 0:
            raise DataError(f"{name} size must be a non-negative integer, got {size!r}")
    if len(pairs) - dev - test < 1:
        raise DataError(f"{len(pairs)} pairs cannot give {dev} dev and {test} test pairs and "
                        f"still leave training pairs; use smaller dev/test sizes or more data")
    groups = {}
    for index, (source, _) in enumerate(pairs):
        groups.setdefault(normalised_source(source), []).append(index)
    members = list(groups.values())
    assignment = np.zeros(len(pairs), dtype=np.int8)  # 0 train, 1 dev, 2 test
    filled = {1: 0, 2: 0}
    limits = {1: dev, 2: test}
    for group in np.random.default_rng(seed).permutation(len(members)):
        indices = members[group]
        for split in (1, 2):
            if filled[split] + len(indices) <= limits[split]:
                assignment[indices] = split
                filled[split] += len(indices)
                break
        if filled[1] == dev and filled[2] == test:
            break
    return {name: [pairs[i] for i in np.flatnonzero(assignment == code)]
            for code, name in enumerate(SPLITS)}


# ---------------------------------------------------------------------------------------------
# Building the dataset

class Examples(NamedTuple):
    """A split's tokenized pairs: per pair its source ids (+eos), target ids (bos...eos),
    bucket length and index in the split."""

    source_ids: list
    target_ids: list
    buckets: np.ndarray
    indices: np.ndarray


def encode_pairs(tokenizer, pairs, seq_length, boundaries):
    """Tokenize pairs into Examples, dropping those longer than `seq_length` on either side
    (source + eos, or bos + target). Returns (examples, kept pairs, dropped count)."""
    pairs = list(pairs)
    sources = tokenizer.encode([source for source, _ in pairs]) if pairs else []  # batch encode
    targets = tokenizer.encode([target for _, target in pairs]) if pairs else []
    source_ids, target_ids, lengths, kept = [], [], [], []
    for pair, source, target in zip(pairs, sources, targets):
        source = np.array(source + [EOS_ID], dtype=np.int32)
        target = np.array([BOS_ID] + target + [EOS_ID], dtype=np.int32)
        length = max(len(source), len(target) - 1)
        if length > seq_length:
            continue
        source_ids.append(source)
        target_ids.append(target)
        lengths.append(length)
        kept.append(pair)
    buckets = assign_buckets(lengths, boundaries) if lengths else np.zeros(0, np.int32)
    examples = Examples(source_ids, target_ids, buckets, np.arange(len(kept), dtype=np.int32))
    return examples, kept, len(pairs) - len(kept)


def token_counts(examples, seq_length):
    """(real tokens, tokens when padded to buckets, tokens when padded to seq_length), counting
    the source and the decoder side (bos + target) of every pair."""
    real = sum(len(s) + len(t) - 1 for s, t in zip(examples.source_ids, examples.target_ids))
    bucketed = 2 * int(np.sum(examples.buckets, dtype=np.int64))
    return real, bucketed, 2 * seq_length * len(examples.source_ids)


def build_translation_dataset(output_dir, pairs, *, vocab_size, seq_length,
                              dev_size=DEFAULT_DEV_SIZE, test_size=DEFAULT_TEST_SIZE, seed=1,
                              source="pairs", buckets=DEFAULT_BUCKETS, source_lang="en",
                              target_lang="de", source_stats=None, batch_size=None,
                              sources=None):
    """Build a translation dataset from (source, target) pairs into `output_dir`.

    Splits the pairs (`split_pairs`), trains the joint tokenizer on the train split, drops pairs
    longer than `seq_length` tokens on either side, assigns buckets and writes the files listed
    in this module's docstring, dataset.json last. Returns the manifest. Files of an
    incomplete earlier build (no dataset.json) are replaced; a complete dataset is never
    overwritten. `source_stats` (e.g. from `load_pairs`) is recorded in the manifest, and
    `sources` (the data sources the pairs came from) for `data.sources` checks.

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
    pairs = list(pairs)
    splits = split_pairs(pairs, dev_size, test_size, seed)
    train_text = [s for s, _ in splits["train"]] + [t for _, t in splits["train"]]
    tokenizer = train_tokenizer(train_text, output_dir / TOKENIZER_FILE, vocab_size)

    encoded, summary = {}, {}
    for split, split_pairs_ in splits.items():
        examples, kept, dropped = encode_pairs(tokenizer, split_pairs_, seq_length, boundaries)
        if split == "train" and not kept:
            raise DataError(f"no training pair fits seq_length={seq_length}")
        real, bucketed, full = token_counts(examples, seq_length)
        encoded[split] = (examples, kept)
        summary[split] = {
            "file": SPLIT_FILES[split], "pairs": len(split_pairs_), "kept": len(kept),
            "dropped_too_long": dropped, "tokens": real,
            "examples_per_bucket": {str(length): count for length, count
                                    in bucket_counts(examples.buckets).items()},
            "padding_ratio": {"bucketed": round(padding_ratio(real, bucketed), 4),
                              "full_length": round(padding_ratio(real, full), 4)}}

    for split, (examples, kept) in encoded.items():
        write_mindrecord(output_dir / SPLIT_FILES[split], RECORD_SCHEMA, _record_rows(examples),
                         description=f"{split} {source_lang}->{target_lang} pairs, "
                                     f"seq_length {seq_length}", overwrite=True)
        if split in TEXT_SPLITS:
            texts = {}
            for lang, side in ((source_lang, 0), (target_lang, 1)):
                name = f"{split}.{lang}"
                write_atomically(output_dir / name, "".join(pair[side] + "\n" for pair in kept))
                texts[lang] = name
            summary[split]["text"] = texts

    kept_total = sum(part["kept"] for part in summary.values())
    manifest = {
        "source": source,
        "languages": {"source": source_lang, "target": target_lang},
        "pairs": {"found": len(pairs), "kept": kept_total,
                  "dropped_too_long": len(pairs) - kept_total},
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
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    if batch_size is not None:
        manifest["train_batches_per_epoch"] = {
            "batch_size": batch_size,
            "batches": sum(count // batch_size for count
                           in bucket_counts(encoded["train"][0].buckets).values())}
    if source_stats is not None:
        manifest["source_stats"] = source_stats
    return write_manifest(output_dir, manifest, sources)


def _record_rows(examples):
    for source, target, bucket, index in zip(*examples):
        yield {"source_ids": source, "target_ids": target, "bucket": np.int32(bucket),
               "index": np.int32(index)}


def translation_dataset_ready(output_dir, vocab_size, seq_length):
    """True if `output_dir` holds a complete translation dataset for this vocab_size and
    seq_length; False if it holds none. DataError if it was built with other sizes or if
    files are missing."""
    def files(manifest):
        names = [TOKENIZER_FILE, *SPLIT_FILES.values()]
        for split in TEXT_SPLITS:
            names.extend(manifest.get("splits", {}).get(split, {}).get("text", {}).values())
        return names
    return dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length}, files)


# ---------------------------------------------------------------------------------------------
# Reading

def read_examples(path) -> Examples:
    """A split's rows in file order (== index order) as Examples."""
    rows = read_mindrecord(path, list(RECORD_SCHEMA))
    return Examples([row["source_ids"] for row in rows], [row["target_ids"] for row in rows],
                    np.array([row["bucket"] for row in rows], dtype=np.int32),
                    np.array([row["index"] for row in rows], dtype=np.int32))


def make_batch(examples, members, length, with_index=False):
    """The BATCH_COLUMNS arrays for `members` (indices into `examples`) padded to `length`."""
    rows = len(members)
    source_ids = np.full((rows, length), PAD_ID, dtype=np.int32)
    source_mask = np.zeros((rows, length), dtype=np.int32)
    decoder_input_ids = np.full((rows, length), PAD_ID, dtype=np.int32)
    decoder_mask = np.zeros((rows, length), dtype=np.int32)
    label_ids = np.full((rows, length), PAD_ID, dtype=np.int32)
    for row, member in enumerate(members):
        source, target = examples.source_ids[member], examples.target_ids[member]
        source_ids[row, :len(source)] = source
        source_mask[row, :len(source)] = 1
        decoder_length = len(target) - 1
        decoder_input_ids[row, :decoder_length] = target[:-1]
        label_ids[row, :decoder_length] = target[1:]
        decoder_mask[row, :decoder_length] = 1
    batch = (source_ids, source_mask, decoder_input_ids, decoder_mask, label_ids)
    if with_index:
        batch += (examples.indices[np.asarray(members)].astype(np.int32),)
    return batch


def create_translation_dataset(path, batch_size, *, num_shards=1, shard_id=0, seed=1,
                               shuffle=True, skip_batches=0, repeat=True, drop_remainder=True,
                               with_index=False):
    """This rank's bucketed batches of a split, as a MindSpore dataset (columns BATCH_COLUMNS).

    `batch_size` sentences per rank; a global step takes `batch_size * num_shards` pairs of one
    bucket and rank `shard_id` reads its slice, so all ranks feed the same shape and together
    read the global batch (see model_zoo.data.buckets). The order depends only on `seed` (and
    the epoch); `skip_batches` resumes at a step with the batches an uninterrupted run would
    see. With `repeat` the dataset is endless. For evaluation use shuffle=False, repeat=False,
    drop_remainder=False (the last batch of a bucket may then be smaller) and with_index=True.
    """
    examples = read_examples(path)
    if not examples.source_ids:
        raise DataError(f"{path}: holds no sentence pairs")
    batches = BucketedBatches(
        examples.buckets, lambda members, length: make_batch(examples, members, length,
                                                             with_index),
        batch_size, num_shards=num_shards, shard_id=shard_id, seed=seed, shuffle=shuffle,
        skip_batches=skip_batches, repeat=repeat, drop_remainder=drop_remainder)
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
    parser.add_argument("--seed", type=int, default=1, help="seed of the split (default 1)")


def run_data_command(args):
    """Build the dataset described by the parsed arguments and print what was found."""
    output_dir = Path(args.output_dir)
    check_no_dataset(output_dir)
    if len(args.source) != len(args.target):
        raise DataError(f"give as many --target files as --source files "
                        f"({len(args.source)} --source, {len(args.target)} --target)")
    sources = list(args.input) + [f"{s}:{t}" for s, t in zip(args.source, args.target)]
    if not sources:
        raise DataError(f"no input: use --input {BUILTIN_LOCALE_DE}, --input SOURCE:TARGET or "
                        f"--source FILE --target FILE")
    started = time.perf_counter()
    stats = {}
    pairs = load_pairs(sources, stats=stats, languages=(args.source_lang, args.target_lang))
    for source, found in stats.items():
        print(f"{source}: {_describe_source(found)}")
    manifest = build_translation_dataset(
        output_dir, pairs, vocab_size=args.vocab_size, seq_length=args.seq_length,
        dev_size=args.dev_size, test_size=args.test_size, seed=args.seed,
        source=" ".join(sources), sources=sources, buckets=args.buckets,
        source_lang=args.source_lang, target_lang=args.target_lang, source_stats=stats)
    splits, padding = manifest["splits"], manifest["padding_ratio"]
    print(f"transformer dataset: {manifest['pairs']['found']} pairs found, "
          f"{manifest['pairs']['kept']} kept, {manifest['pairs']['dropped_too_long']} dropped "
          f"(longer than {args.seq_length} tokens); kept/split: "
          + ", ".join(f"{s} {splits[s]['kept']}/{splits[s]['pairs']}" for s in SPLITS)
          + f"; vocab {args.vocab_size}; buckets {manifest['buckets']}; train padding "
            f"{padding['bucketed']:.1%} bucketed vs {padding['full_length']:.1%} at full length; "
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

