"""BERT's fine-tuning set: docstring topic classification.

Fine-tuning task: which area of the standard library does a docstring document?
    Labels (4 topics) come from where the docstring is, not from its text: "internet"
    (email, http, urllib, ssl, socket, mail and news protocols, ...), "data" (file formats,
    archives and compression, codecs, text processing: json, csv, xml, tarfile, re, ...),
    "system" (files, processes, threads and async I/O: os, pathlib, shutil, subprocess,
    threading, multiprocessing, asyncio, ...) and "language" (the language and developer
    tools: ast, inspect, importlib, typing, collections, unittest, pdb, ...). See
    DOCSTRING_TOPICS. Modules whose topic is ambiguous or that form a topic of their own
    (GUI, numbers and time, logging, distutils, generated codec tables) are left out.
    Why this task: a reader can judge any example ("is this about networking or about the
    file system?"); it needs the meaning of the words, since no fixed surface cue gives the
    label away; it offers about 4,000 examples on any machine with Python 3.11. Rejected:
    class-vs-function docstrings (the first word, "Return ..." vs "Class ..."/"A ...", and the
    imperative mood give it away even after stripping that word) and the gettext catalogs
    under /usr/share/locale (short interface strings whose natural label, the catalog, is the
    source file itself, so no split can keep files apart; the language of a translation is
    told by its characters).
    Examples: docstrings of at least 40 characters with whitespace collapsed, exact
    duplicates (same words, case-insensitive) dropped. Split: whole modules stay together
    (a "unit" is a top-level module or package; _pyio goes with io, posixpath/ntpath/
    genericpath with os, _collections_abc with collections, bz2/gzip/lzma/_compression
    together, ...). Per topic, units in a seeded order go to dev until dev holds about
    `dev_fraction` of the topic's examples. Then a dev example sharing at least half of its
    word trigrams with a train example (e.g. a docstring copied between asyncio and
    concurrent.futures) is dropped. dataset.json reports the counts per class and split and
    the majority-class baseline on dev, which fine-tuning has to beat. The docstrings are
    also part of the pretraining text (without labels), as in-domain unlabelled text is in
    BERT's recipe.
    Layout: `[CLS] text [SEP]` truncated to seq_length, padded with 0, token_type_ids 0,
    attention_mask 1 on tokens, `label` int32 (index into dataset.json's `labels`).
"""

import hashlib
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from model_zoo.data import (
    Tokenizer,
    check_no_dataset,
    dataset_ready,
    python_docstring_records,
    read_manifest,
    write_manifest,
    write_mindrecord,
)
from model_zoo.errors import DataError
from model_zoo.files import write_atomically

from .data import (CLS_ID, INT_SEQUENCE, SEP_ID, TOKENIZER_FILE, WORDS, check_int, encode_text,
                   load_bert_tokenizer, normalize_whitespace, task_check)

CLASSIFICATION_COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "label")
CLASSIFICATION_SCHEMA = {"input_ids": INT_SEQUENCE, "token_type_ids": INT_SEQUENCE,
                         "attention_mask": INT_SEQUENCE, "label": {"type": "int32"}}
CLASSIFICATION_FILES = {"train": "train.mindrecord", "dev": "dev.mindrecord"}

# The classification task: topic -> top-level standard-library modules and packages.
DOCSTRING_TOPICS = {
    "internet": (
        "email mailbox mailcap mimetypes smtplib smtpd poplib imaplib nntplib ftplib telnetlib "
        "http urllib nturl2path wsgiref cgi cgitb webbrowser html _markupbase xmlrpc socket "
        "socketserver ssl ipaddress asynchat asyncore netrc").split(),
    "data": (
        "json csv configparser tomllib plistlib xml pickle pickletools shelve dbm sqlite3 "
        "tarfile zipfile zipapp gzip bz2 lzma _compression base64 quopri uu xdrlib chunk wave "
        "aifc sunau sndhdr imghdr codecs stringprep difflib textwrap re string shlex gettext "
        "locale").split(),
    "system": (
        "os posixpath ntpath genericpath shutil tempfile pathlib glob fnmatch filecmp fileinput "
        "stat io _pyio platform _osx_support _aix_support subprocess _bootsubprocess signal pty "
        "getpass pipes threading _threading_local multiprocessing concurrent asyncio queue "
        "sched selectors").split(),
    "language": (
        "ast dis opcode symtable tokenize keyword codeop code compileall py_compile inspect "
        "importlib imp zipimport pkgutil modulefinder runpy site _sitebuiltins sysconfig venv "
        "ensurepip typing types abc _py_abc enum dataclasses functools operator contextlib "
        "collections _collections_abc copy copyreg weakref reprlib pprint warnings traceback "
        "linecache unittest doctest pdb bdb trace tracemalloc profile cProfile pstats timeit "
        "pydoc rlcompleter tabnanny pyclbr __future__").split(),
}
CLASSIFICATION_LABELS = tuple(DOCSTRING_TOPICS)
# Modules that share code or copied docstrings are one unit, kept in one split.
SPLIT_UNITS = {
    "_pyio": "io", "posixpath": "os", "ntpath": "os", "genericpath": "os", "nturl2path": "urllib",
    "_markupbase": "html", "_collections_abc": "collections", "_py_abc": "abc",
    "_threading_local": "threading", "_sitebuiltins": "site", "_bootsubprocess": "subprocess",
    "_compression": "compression", "bz2": "compression", "gzip": "compression",
    "lzma": "compression", "_osx_support": "platform", "_aix_support": "platform",
    "profile": "profile", "cProfile": "profile", "pstats": "profile", "pdb": "bdb",
    "pickletools": "pickle", "copyreg": "pickle", "asynchat": "asyncore", "smtpd": "asyncore",
}
MIN_DOCSTRING_CHARS = 40
NEAR_DUPLICATE_OVERLAP = 0.5


class TopicExample(NamedTuple):
    """One docstring of the classification task."""

    text: str    # whitespace-normalized docstring
    label: int   # index into CLASSIFICATION_LABELS
    unit: str    # the group of modules it is split with, e.g. "os"
    path: str    # source file relative to the standard library


def docstring_topic_examples(min_chars=MIN_DOCSTRING_CHARS):
    """The task's examples in source order: docstrings of the DOCSTRING_TOPICS modules of at
    least `min_chars` characters, the first of each group of exact duplicates kept."""
    topic_of = {module: label for label, modules in enumerate(DOCSTRING_TOPICS.values())
                for module in modules}
    examples, seen = [], set()
    for record in python_docstring_records(min_chars):
        module = record.path.split("/")[0].removesuffix(".py")
        if module not in topic_of:
            continue
        text = normalize_whitespace(record.text)
        key = " ".join(WORDS.findall(text.lower()))
        if key in seen:
            continue
        seen.add(key)
        examples.append(TopicExample(text, topic_of[module], SPLIT_UNITS.get(module, module),
                                     record.path))
    return examples


def split_topic_examples(examples, *, dev_fraction=0.2, seed=1):
    """Split examples into (train, dev, dropped) keeping each unit in one split.

    For each topic, its units in a seeded order go to dev while dev holds less than
    `dev_fraction` of the topic's examples (skipping a unit that would take it past 1.5 times
    that or leave train without the topic; if every unit is that large, the smallest one).
    Dev examples sharing at least half of their word trigrams with a train example are
    returned as `dropped` instead of in dev.
    """
    if not 0.0 < dev_fraction < 1.0:
        raise DataError(f"dev_fraction must be between 0 and 1 (exclusive), got {dev_fraction}")
    rng = random.Random(f"bert-classification:{seed}")
    dev_units = set()
    for label in range(len(CLASSIFICATION_LABELS)):
        sizes = Counter(example.unit for example in examples if example.label == label)
        total, target, dev_size = sum(sizes.values()), dev_fraction * sum(sizes.values()), 0
        units = sorted(sizes)
        rng.shuffle(units)
        for unit in units:
            if dev_size >= target:
                break
            if dev_size + sizes[unit] <= min(1.5 * target, total - 1):
                dev_units.add(unit)
                dev_size += sizes[unit]
        if dev_size == 0 and len(units) > 1:  # every unit is too large: the smallest one
            dev_units.add(min(units, key=lambda unit: (sizes[unit], unit)))
    train = [example for example in examples if example.unit not in dev_units]
    dev_candidates = [example for example in examples if example.unit in dev_units]
    train_shingles = defaultdict(set)
    for index, example in enumerate(train):
        for shingle in _shingles(example.text):
            train_shingles[shingle].add(index)
    train_sizes = [len(_shingles(example.text)) for example in train]
    dev, dropped = [], []
    for example in dev_candidates:
        shingles = _shingles(example.text)
        shared = Counter(index for shingle in shingles for index in train_shingles.get(shingle, ()))
        near = any(count >= NEAR_DUPLICATE_OVERLAP * min(len(shingles), train_sizes[index])
                   for index, count in shared.items())
        (dropped if near else dev).append(example)
    return train, dev, dropped


def _shingles(text):
    words = WORDS.findall(text.lower())
    if len(words) < 3:
        return {tuple(words)}
    return {tuple(words[i:i + 3]) for i in range(len(words) - 2)}


def encode_classification_example(tokenizer, text, seq_length):
    """(input_ids, token_type_ids, attention_mask) of `[CLS] text [SEP]`, truncated and padded."""
    return _single_segment(encode_text(tokenizer, text), seq_length)


def _single_segment(ids, seq_length):
    tokens = [CLS_ID, *ids[:seq_length - 2], SEP_ID]
    padding = [0] * (seq_length - len(tokens))
    return tokens + padding, [0] * seq_length, [1] * len(tokens) + padding


def build_classification_dataset(output_dir, tokenizer_path, *, seq_length, seed=1,
                                 dev_fraction=0.2):
    """Build the docstring topic classification dataset into `output_dir`; returns dataset.json.

    `tokenizer_path` is the pretraining dataset's tokenizer.model; it is copied into
    `output_dir` and its SHA-256 recorded. Train examples are written in a seeded random
    order, dev examples in source order.

    Raises:
        DataError: a dataset already there, a missing or non-BERT tokenizer, seq_length < 3,
            or a Python whose standard library lacks the task's modules.
    """
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    check_int("seq_length", seq_length, 3)
    tokenizer = load_bert_tokenizer(tokenizer_path)
    model_bytes = Path(tokenizer_path).read_bytes()
    train, dev, dropped = split_topic_examples(docstring_topic_examples(),
                                               dev_fraction=dev_fraction, seed=seed)
    splits = {"train": train, "dev": dev}
    for split, examples in splits.items():
        missing = sorted(set(CLASSIFICATION_LABELS)
                         - {CLASSIFICATION_LABELS[example.label] for example in examples})
        if missing:
            raise DataError(f"the {split} split of the docstring topic task has no example of "
                            f"{', '.join(missing)}: this Python's standard library "
                            f"(Python {sys.version.split()[0]}) lacks the task's modules")
    random.Random(f"bert-classification-order:{seed}").shuffle(train)

    summary = {}
    encoded = {}
    for split, examples in splits.items():
        rows = []
        truncated = 0
        for example in examples:
            ids = encode_text(tokenizer, example.text)
            truncated += len(ids) > seq_length - 2
            input_ids, token_type_ids, attention_mask = _single_segment(ids, seq_length)
            rows.append({"input_ids": np.array(input_ids, np.int32),
                         "token_type_ids": np.array(token_type_ids, np.int32),
                         "attention_mask": np.array(attention_mask, np.int32),
                         "label": np.int32(example.label)})
        encoded[split] = rows
        counts = Counter(example.label for example in examples)
        summary[split] = {
            "file": CLASSIFICATION_FILES[split], "examples": len(examples),
            "per_class": {name: counts[label] for label, name in enumerate(CLASSIFICATION_LABELS)},
            "truncated": truncated,
            "units": sorted({example.unit for example in examples}),
        }
    train_counts = summary["train"]["per_class"]
    majority = max(CLASSIFICATION_LABELS, key=lambda name: train_counts[name])
    dev_counts = summary["dev"]["per_class"]

    write_atomically(output_dir / TOKENIZER_FILE, model_bytes)
    for split, rows in encoded.items():
        write_mindrecord(output_dir / CLASSIFICATION_FILES[split], CLASSIFICATION_SCHEMA, rows,
                         description=f"docstring topic classification ({split}), seq_length "
                                     f"{seq_length}", overwrite=True)
    manifest = {
        "task": "classification",
        "name": "python-docstring-topics",
        "source": f"docstrings of Python {sys.version.split()[0]}'s standard library",
        "vocab_size": tokenizer.vocab_size,
        "seq_length": seq_length,
        "seed": seed,
        "dev_fraction": dev_fraction,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_source": str(tokenizer_path),
        "tokenizer_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "labels": list(CLASSIFICATION_LABELS),
        "columns": list(CLASSIFICATION_COLUMNS),
        "near_duplicates_dropped_from_dev": len(dropped),
        "majority_baseline": {"label": majority,
                              "dev_accuracy": round(dev_counts[majority] / len(dev), 4),
                              "best_constant_dev_accuracy": round(
                                  max(dev_counts.values()) / len(dev), 4)},
        "splits": summary,
    }
    return write_manifest(output_dir, manifest)


def classification_dataset_ready(output_dir, vocab_size, seq_length, *, tokenizer_path=None):
    """True if `output_dir` holds a complete classification dataset for these sizes.

    False if it holds no dataset.json; DataError if it holds another dataset, one built with
    other sizes or (when `tokenizer_path` is given) another tokenizer, or if files are missing.
    """
    if not dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length},
                         [TOKENIZER_FILE, *CLASSIFICATION_FILES.values()],
                         task_check(output_dir, "classification")):
        return False
    manifest = read_manifest(output_dir)
    if tokenizer_path is not None:
        digest = hashlib.sha256(Tokenizer(tokenizer_path).model_path.read_bytes()).hexdigest()
        if digest != manifest.get("tokenizer_sha256"):
            raise DataError(f"{output_dir} was built with another tokenizer than {tokenizer_path} "
                            f"(from {manifest.get('tokenizer_source')}); use another directory "
                            f"or delete it")
    return True
