"""Sentence pairs for translation, read as a stream from any number of inputs.

Inputs (`pair_entries`):
    builtin:locale-de        English -> German pairs from the system's gettext message
                             catalogs (/usr/share/locale/de/LC_MESSAGES/*.mo), filtered to
                             real phrases and sentences (`message_catalog_pairs`)
    SOURCE_FILE:TARGET_FILE  the user's parallel text, one sentence per line, either gzipped
    PAIRS.tsv, PAIRS.jsonl   a file of pairs (source TAB target; or JSON objects keyed by the
                             languages, at the top level or under "translation"), either
                             gzipped

`iter_pairs` reads them in order from any `PairStart` on, a line at a time, so a build can
cut the inputs into pieces that workers read on their own. Whitespace is normalised (runs
of whitespace become one space) and pairs with a blank side are skipped.
"""

import functools
import gettext
import json
import re
from pathlib import Path
from typing import List, NamedTuple, Tuple

from model_zoo.data.corpus import decode_text, raw_lines
from model_zoo.errors import DataError

CATALOG_ROOT = "/usr/share/locale"
BUILTIN_LOCALE_PREFIX = "builtin:locale-"
BUILTIN_LOCALE_DE = "builtin:locale-de"
PAIR_FILE_SUFFIXES = (".tsv", ".jsonl")   # a file of pairs, optionally .gz
CATALOG, PAIR_FILE, PARALLEL = "catalog", "pair file", "parallel files"
MIN_WORDS = 2
MAX_WORDS = 60

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


# ---------------------------------------------------------------------------------------------
# Streams of pairs

class PairEntry(NamedTuple):
    """One input of sentence pairs, as `pair_entries` finds it."""

    kind: str          # CATALOG, PAIR_FILE or PARALLEL
    paths: tuple       # (locale,), (file,) or (source file, target file)
    source: str        # the input as the user gave it
    languages: tuple = ("en", "de")   # a .jsonl pair file's keys (source, target)

    def files(self) -> list:
        return [] if self.kind == CATALOG else [Path(path) for path in self.paths]


class PairStart(NamedTuple):
    """Where a pair starts, so that a reader can start there (`iter_pairs(start=...)`)."""

    entry: int          # index of its input in the entries read
    offset: int         # byte offset of its line (in the source file of parallel files);
                        # for a catalog, the pair's index in it
    target_offset: int  # parallel files: byte offset of the target line; else 0
    line: int           # its line number (0 for a catalog)


class SentencePair(NamedTuple):
    source: str
    target: str
    start: PairStart
    size: int           # bytes of input it came from


def pair_entries(sources, languages=("en", "de")) -> List[PairEntry]:
    """The inputs that `sources` name (module docstring), in order; DataError for a source
    that names none."""
    entries = []
    for source in map(str, sources):
        if source.startswith(BUILTIN_LOCALE_PREFIX):
            entries.append(PairEntry(CATALOG, (source[len(BUILTIN_LOCALE_PREFIX):],), source))
        elif source.startswith("builtin:"):
            raise DataError(f"{source}: unknown built-in corpus (available: {BUILTIN_LOCALE_DE})")
        elif is_pair_file(source):
            entries.append(PairEntry(PAIR_FILE, (source,), source, tuple(languages)))
        else:
            entries.append(PairEntry(PARALLEL, _file_pair(source), source))
    if not entries:
        raise DataError(f"no input given: use {BUILTIN_LOCALE_DE} or SOURCE_FILE:TARGET_FILE")
    return entries


def is_pair_file(source: str) -> bool:
    """Whether a source names one file of pairs, rather than SOURCE_FILE:TARGET_FILE."""
    return source.removesuffix(".gz").endswith(PAIR_FILE_SUFFIXES) and (
        ":" not in source or Path(source).is_file())


def _file_pair(source):
    """Split SOURCE_FILE:TARGET_FILE at the first colon that leaves two existing files."""
    colons = [i for i, char in enumerate(source) if char == ":"]
    if not colons:
        raise DataError(f"{source!r}: expected SOURCE_FILE:TARGET_FILE or {BUILTIN_LOCALE_DE}")
    for i in colons:
        if Path(source[:i]).is_file() and Path(source[i + 1:]).is_file():
            return source[:i], source[i + 1:]
    return source[:colons[0]], source[colons[0] + 1:]


def iter_pairs(entries, start=PairStart(0, 0, 0, 1), *, stats=None):
    """The pairs (`SentencePair`) of `entries` in order, from `start` on, a line at a time.

    DataError names the file (and line) of input that cannot be read; an input read from its
    beginning must give a pair. If `stats` is a dict, it receives for each input read from
    its beginning {source: counts} (`message_catalog_pairs`'s, or lines, blank, kept).
    """
    for number in range(start.entry, len(entries)):
        entry = entries[number]
        here = start if number == start.entry else PairStart(number, 0, 0, 1)
        for path in entry.files():
            if not path.exists():
                raise DataError(f"{path}: file not found")
            if not path.is_file():
                raise DataError(f"{path}: not a regular file")
        counts = {"lines": 0, "blank": 0, "kept": 0}
        if entry.kind == CATALOG:
            pairs, counts = _catalog(entry.paths[0])
            for index in range(here.offset, len(pairs)):
                source, target = pairs[index]
                yield SentencePair(source, target, PairStart(number, index, 0, 0),
                                   len(source.encode()) + len(target.encode()) + 2)
        else:
            lines = _pair_file_lines if entry.kind == PAIR_FILE else _parallel_lines
            for sides, position, size in lines(entry, here):
                counts["lines"] += 1
                source, target = (" ".join(side.split()) for side in sides)
                if source and target:
                    counts["kept"] += 1
                    yield SentencePair(source, target, PairStart(number, *position), size)
                else:
                    counts["blank"] += 1
        if here.offset == 0 and here.target_offset == 0:
            if entry.kind != CATALOG and not counts["kept"]:
                raise DataError(f"{' and '.join(entry.paths)}: no pair with text on both sides")
            if stats is not None:
                stats[entry.source] = dict(counts)


@functools.lru_cache(maxsize=4)
def _catalog(locale):
    stats = {}
    return tuple(message_catalog_pairs(locale, stats=stats)), stats


def _pair_file_lines(entry, start):
    """(the two sides, (offset, 0, line), bytes) of each non-blank line of a pair file."""
    path = Path(entry.paths[0])
    json_lines = path.name.removesuffix(".gz").endswith(".jsonl")
    for raw, offset, number in raw_lines(path, start.offset, start.line):
        text = decode_text(path, raw, number)
        if not text.strip():
            continue
        if json_lines:
            sides = _json_pair(path, number, text, entry.languages)
        else:
            sides = text.rstrip("\r").split("\t")
            if len(sides) != 2:
                raise DataError(f"{path} line {number}: {len(sides)} tab-separated fields, "
                                f"expected 2 (source, then its translation)")
        yield sides, (offset, 0, number), len(raw) + 1


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


def _parallel_lines(entry, start):
    """(the two lines, (offset, target offset, line), bytes) of parallel files, line by
    line; DataError when one file ends before the other."""
    paths = [Path(path) for path in entry.paths]
    readers = [raw_lines(paths[0], start.offset, start.line),
               raw_lines(paths[1], start.target_offset, start.line)]
    while True:
        source, target = (next(reader, None) for reader in readers)
        if source is None or target is None:
            if source is not None or target is not None:
                longer = 0 if source is not None else 1
                rest = 1 + sum(1 for _ in readers[longer])
                last = (source or target)[2] - 1
                counts = [last, last]
                counts[longer] += rest
                raise DataError(f"parallel files differ in length: {paths[0]} has "
                                f"{counts[0]} lines but {paths[1]} has {counts[1]}; they "
                                f"need one sentence per line, line i translating line i")
            return
        (source_raw, source_offset, number), (target_raw, target_offset, _) = source, target
        sides = [decode_text(path, raw, number).rstrip("\r")
                 for path, raw in zip(paths, (source_raw, target_raw))]
        yield sides, (source_offset, target_offset, number), len(source_raw) + len(target_raw) + 2


def load_pairs(sources, *, stats=None, languages=("en", "de")) -> List[Pair]:
    """The pairs of every source in order (module docstring), as a list; `languages` are a
    .jsonl file's keys. If `stats` is a dict, it receives {source: its counts}."""
    return [(pair.source, pair.target)
            for pair in iter_pairs(pair_entries(sources, languages), stats=stats)]


def read_parallel_files(source_path, target_path, *, stats=None) -> List[Pair]:
    """The pairs of two files of one sentence a line (line i translating line i)."""
    found = {}
    entry = PairEntry(PARALLEL, (str(source_path), str(target_path)), "")
    pairs = [(pair.source, pair.target) for pair in iter_pairs([entry], stats=found)]
    if stats is not None:
        stats.update(found[""])
    return pairs
