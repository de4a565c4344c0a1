"""Text documents for training: a built-in offline corpus, user files, and a train/heldout split.

User inputs are plain text (documents separated by blank lines) or JSON lines (`.jsonl`: one
object per line, its text under `json_key`, default "text"), either one gzipped (`.gz`), and
folders or glob patterns of such files (read in sorted order).
"""

import ast
import functools
import glob
import gzip
import inspect
import json
import os
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

from model_zoo.errors import DataError

BUILTIN_PYTHON_DOCS = "builtin:python-docs"
DEFAULT_JSON_KEY = "text"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl")   # what a folder of inputs is read for
READ_CHUNK = 1 << 22
UTF8_BOM = b"\xef\xbb\xbf"


def describe_sources(inputs) -> str:
    """The inputs of a dataset as its manifest's `source` says them, with the Python version
    whose standard library the built-in docstrings came from."""
    source = " ".join(inputs)
    if BUILTIN_PYTHON_DOCS in inputs:
        source += f" (Python {sys.version.split()[0]})"
    return source

EXCLUDED_STDLIB_DIRECTORIES = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
DOCUMENTED_KINDS = {ast.Module: "module", ast.ClassDef: "class", ast.FunctionDef: "function",
                    ast.AsyncFunctionDef: "function"}
DOCUMENTED_NODES = tuple(DOCUMENTED_KINDS)
STATEMENT_NODES = (ast.stmt, ast.excepthandler, ast.match_case)


def python_docstrings_corpus(min_chars=200):
    """English text available on every machine: the docstrings of Python's standard library.

    Each module, class and function docstring of at least `min_chars` characters is one
    document, in source order. Sources are parsed with `ast` (never imported) in sorted path
    order, so the result depends only on the Python version. Files that fail to parse are skipped.
    """
    return [record.text for record in python_docstring_records(min_chars)]


class Docstring(NamedTuple):
    """One docstring of the standard library and where it comes from."""

    path: str   # source file relative to the standard library, e.g. "email/message.py"
    kind: str   # "module", "class" or "function" (async functions included)
    name: str   # the class or function name, or the module path for a module docstring
    text: str   # the docstring, cleaned with inspect.cleandoc


def python_docstring_records(min_chars=1):
    """The docstrings of `python_docstrings_corpus` with their source file and kind, in order."""
    stdlib = Path(os.__file__).parent
    records = []
    for path in _stdlib_sources():
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        relative = path.relative_to(stdlib).as_posix()
        for node in _documented_nodes(tree):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                docstring = inspect.cleandoc(docstring)
                if len(docstring) >= min_chars:
                    kind = DOCUMENTED_KINDS[type(node)]
                    name = relative if kind == "module" else node.name
                    records.append(Docstring(relative, kind, name, docstring))
    return records


def _documented_nodes(node):
    """Module, class and function nodes in source order, reached through statements only
    (expressions hold no docstrings, and skipping them makes this several times faster)."""
    if isinstance(node, DOCUMENTED_NODES):
        yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, STATEMENT_NODES):
            yield from _documented_nodes(child)


def _stdlib_sources():
    """The standard library's `.py` files, sorted by their path relative to its directory."""
    stdlib = Path(os.__file__).parent
    sources = []
    for directory, subdirectories, filenames in os.walk(stdlib):
        subdirectories[:] = [name for name in subdirectories
                             if name not in EXCLUDED_STDLIB_DIRECTORIES]
        sources.extend(Path(directory, name) for name in filenames if name.endswith(".py"))
    return sorted(sources, key=lambda path: path.relative_to(stdlib).as_posix())


def read_text_documents(paths, json_key: str = DEFAULT_JSON_KEY):
    """The documents of input files (plain text, JSON lines, gzipped; see the module
    docstring), folders and glob patterns, in order.

    Raises DataError naming the file (and the line) if one is missing, not UTF-8, a JSON
    line is malformed or lacks `json_key`, or a file holds no text.
    """
    paths = list(paths)
    if not paths:
        raise DataError("no input text files given")
    entries = [found for path in paths for found in input_files(path)]
    return [document.text for document in iter_documents(entries, json_key)]


def input_files(source: str) -> list:
    """The files an input names: itself, a folder's text files (recursively, sorted), or a
    glob pattern's matches (sorted); DataError when it names none."""
    source = str(source)
    path = Path(source)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and
                       p.name.removesuffix(".gz").endswith(TEXT_SUFFIXES))
        if not found:
            raise DataError(f"{source}: a folder without text files "
                            f"({', '.join(TEXT_SUFFIXES)}, optionally .gz)")
        return found
    if glob.has_magic(source) and not path.exists():
        found = sorted(Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p))
        if not found:
            raise DataError(f"{source}: no file matches")
        return found
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    return [path]


def input_entries(sources) -> list:
    """What `iter_documents` reads for data sources: each input file (a Path) that the
    sources name (`input_files`), and the names of built-in corpora (str), in order."""
    entries = []
    for source in sources:
        source = str(source)
        if source == BUILTIN_PYTHON_DOCS:
            entries.append(source)
        elif source.startswith("builtin:"):
            raise DataError(f"{source}: unknown built-in corpus (available: {BUILTIN_PYTHON_DOCS})")
        else:
            entries.extend(input_files(source))
    if not entries:
        raise DataError("no input text files given")
    return entries


def input_bytes(entry) -> int:
    """The size of an input as `iter_documents` counts it: a file's (uncompressed) bytes,
    or a built-in corpus's UTF-8 bytes. For gzip this is the size its trailer records
    (modulo 4 GiB, by the format), an estimate that only guides where files are cut."""
    if isinstance(entry, str):
        return sum(len(text.encode("utf-8")) + 2 for text in _builtin_documents(entry))
    if entry.suffix != ".gz":
        return entry.stat().st_size
    with open(entry, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() < 4:
            return 0
        handle.seek(-4, os.SEEK_END)
        return int.from_bytes(handle.read(4), "little")


class DocumentStart(NamedTuple):
    """Where a document starts, so a reader can start there (`iter_documents(start=...)`)."""

    entry: int    # index of its input in the list of entries read
    offset: int   # byte offset of its first line in the (uncompressed) file; for a built-in
                  # corpus, the document's index in it
    line: int     # the line number of that line (0 for a built-in corpus)


class Document(NamedTuple):
    text: str
    start: DocumentStart
    size: int     # bytes of input it came from, separators included


def iter_documents(entries, json_key: str = DEFAULT_JSON_KEY, start=DocumentStart(0, 0, 1)):
    """The documents (`Document`) of `entries` (`input_entries`) in order, from `start` on,
    read in a bounded window: a corpus of any size streams through.

    Raises DataError naming the file and line for input that cannot be read (see
    `read_text_documents`); a file read from its beginning must hold some text.
    """
    for number in range(start.entry, len(entries)):
        entry = entries[number]
        offset, line = (start.offset, start.line) if number == start.entry else (0, 1)
        if isinstance(entry, str):
            corpus = _builtin_documents(entry)
            for index in range(offset, len(corpus)):
                yield Document(corpus[index], DocumentStart(number, index, 0),
                               len(corpus[index].encode("utf-8")) + 2)
            continue
        json_lines = entry.name.removesuffix(".gz").endswith(".jsonl")
        reader = _json_line_documents if json_lines else _text_documents
        found = False
        for text, (position, first_line), size in reader(entry, offset, line, json_key):
            found = True
            yield Document(text, DocumentStart(number, position, first_line), size)
        if not found and offset == 0:
            raise DataError(f"{entry}: holds no text")


@functools.lru_cache(maxsize=1)
def _builtin_documents(name: str) -> tuple:
    assert name == BUILTIN_PYTHON_DOCS, name
    return tuple(python_docstrings_corpus())


def raw_lines(path: Path, offset: int, line: int):
    """(line bytes without its newline, its byte offset, its number) of a file (gunzipped
    for .gz) from `offset`, read in chunks; a byte-order mark at the start is skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            if offset:
                handle.seek(offset)
            if offset == 0:   # the first line starts after a byte-order mark
                offset = len(UTF8_BOM) if handle.read(len(UTF8_BOM)) == UTF8_BOM else 0
                handle.seek(offset)
            tail = b""
            while chunk := handle.read(READ_CHUNK):
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for raw in lines:
                    yield raw, offset, line
                    offset += len(raw) + 1
                    line += 1
            if tail:
                yield tail, offset, line
    except (OSError, EOFError, zlib.error) as error:
        reason = getattr(error, "strerror", None) or error
        raise DataError(f"{path}: cannot be read ({reason})") from None


def decode_text(path: Path, raw: bytes, line: int) -> str:
    """UTF-8 text of input bytes starting at `line`; DataError naming the bad byte's line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line = line + raw.count(b"\n", 0, error.start)
        column = error.start - raw.rfind(b"\n", 0, error.start)
        raise DataError(f"{path} line {bad_line}: not UTF-8 text (invalid byte at column "
                        f"{column})") from None


def _text_documents(path: Path, offset: int, line: int, json_key=None):
    """(text, (offset, line), size) of each document of a plain text file: runs of lines
    that are not blank (ASCII whitespace only), joined with newlines. Lines end at "\n"
    ("\r\n" too; a lone "\r" inside a document becomes "\n")."""
    del json_key
    lines, start, size = [], None, 0
    for raw, position, number in raw_lines(path, offset, line):
        if raw.strip():
            if not lines:
                start, size = (position, number), 0
            lines.append(raw)
            size += len(raw) + 1
        elif lines:
            text = _text_document(path, lines, start)
            if text:
                yield text, start, size + len(raw) + 1
            lines = []
    if lines and (text := _text_document(path, lines, start)):
        yield text, start, size


def _text_document(path: Path, lines: list, start) -> str:
    text = decode_text(path, b"\n".join(lines), start[1])
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip()


def _json_line_documents(path: Path, offset: int, line: int, json_key: str):
    """(text, (offset, line), size) of the `json_key` string of each JSON line; blank
    lines and empty texts are skipped."""
    # lines end at "\n" only: JSON strings may hold U+2028 and the like unescaped
    for raw, position, number in raw_lines(path, offset, line):
        if not raw.strip():
            continue
        try:
            record = json.loads(decode_text(path, raw, number))
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {number}: not JSON ({error.msg} at column "
                            f"{error.colno})") from None
        if not isinstance(record, dict) or json_key not in record:
            raise DataError(f"{path} line {number}: no {json_key!r} field (give the text's "
                            f"key with --json-key)")
        value = record[json_key]
        if not isinstance(value, str):
            raise DataError(f"{path} line {number}: {json_key!r} is a "
                            f"{type(value).__name__}, not text")
        if value.strip():
            yield value, (position, number), len(raw) + 1


def add_input_arguments(parser, *, required: bool, note: str = ""):
    """`--input` and `--json-key` of the data commands that read documents."""
    parser.add_argument("--input", nargs="+", required=required, metavar="FILE",
                        help=f"{note}UTF-8 text files (documents separated by blank lines), "
                             f".jsonl files (one JSON object a line, see --json-key), either "
                             f"gzipped (.gz), folders or glob patterns of them, or "
                             f"{BUILTIN_PYTHON_DOCS} for the docstrings of Python's standard "
                             f"library")
    parser.add_argument("--json-key", default=DEFAULT_JSON_KEY,
                        help=f"the field of a .jsonl line that holds its text (default "
                             f"{DEFAULT_JSON_KEY!r})")


def load_documents(sources, json_key: str = DEFAULT_JSON_KEY):
    """The documents of input files (`read_text_documents`) and built-in corpora
    (`builtin:python-docs`), in order, as a list."""
    return [document.text for document in iter_documents(input_entries(sources), json_key)]
