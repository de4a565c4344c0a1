"""Text documents for training: a built-in offline corpus, user files, and a train/heldout split.

User inputs are plain text (documents separated by blank lines) or JSON lines (`.jsonl`: one
object per line, its text under `json_key`, default "text"), either one gzipped (`.gz`), and
folders or glob patterns of such files (read in sorted order).
"""

import ast
import glob
import gzip
import inspect
import json
import os
import re
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from model_zoo.errors import DataError

BUILTIN_PYTHON_DOCS = "builtin:python-docs"
DEFAULT_JSON_KEY = "text"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl")   # what a folder of inputs is read for


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
BLANK_LINES = re.compile(r"\n\s*\n")


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
    documents = []
    for path in paths:
        for found in input_files(path):
            documents.extend(file_documents(found, json_key))
    return documents


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


def file_documents(path: Path, json_key: str = DEFAULT_JSON_KEY) -> list:
    """The documents of one input file: JSON lines for a .jsonl (or .jsonl.gz) name, else
    text with documents separated by blank lines."""
    text = _read_utf8(path)
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        documents = list(_json_lines(path, text, json_key))
    else:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        documents = []
        for block in BLANK_LINES.split(text):
            document = block.rstrip().lstrip("\n")
            if document.strip():
                documents.append(document)
    if not documents:
        raise DataError(f"{path}: holds no text")
    return documents


def _read_utf8(path: Path) -> str:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
        reason = getattr(error, "strerror", None) or error
        raise DataError(f"{path}: cannot be read ({reason})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (invalid byte at offset "
                        f"{error.start})") from None


def _json_lines(path: Path, text: str, json_key: str):
    """The `json_key` strings of a JSON-lines text; blank lines are skipped."""
    # lines end at "\n" only: JSON strings may hold U+2028 and the like unescaped
    for number, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
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
            yield value


def split_documents(documents, heldout_fraction, seed):
    """Split documents into (train, heldout) by a permutation seeded with `seed`.

    About `heldout_fraction` of the documents are held out, at least one in each split;
    both splits keep the documents' original order.
    """
    documents = list(documents)
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents to split into train and heldout, "
                        f"got {len(documents)}")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be between 0 and 1 (exclusive), "
                        f"got {heldout_fraction}")
    heldout_count = min(max(round(len(documents) * heldout_fraction), 1), len(documents) - 1)
    permutation = np.random.default_rng(seed).permutation(len(documents))
    heldout_indices = set(permutation[:heldout_count].tolist())
    train = [doc for index, doc in enumerate(documents) if index not in heldout_indices]
    heldout = [doc for index, doc in enumerate(documents) if index in heldout_indices]
    return train, heldout


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
    (`builtin:python-docs`), in order."""
    documents = []
    for source in sources:
        if source == BUILTIN_PYTHON_DOCS:
            documents.extend(python_docstrings_corpus())
        elif source.startswith("builtin:"):
            raise DataError(f"{source}: unknown built-in corpus (available: {BUILTIN_PYTHON_DOCS})")
        else:
            documents.extend(read_text_documents([source], json_key))
    return documents
