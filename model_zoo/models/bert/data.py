"""BERT datasets: masked-LM + next-sentence pretraining, and a topic classification task.

Tokenizer
    SentencePiece (BPE) trained on the pretraining train split with SentencePiece's usual
    word-boundary handling (`train_tokenizer(..., word_boundaries=True)`): every word's first
    piece starts with "▁", which whole-word masking uses. Ids: pad=0, unk=1, bos=2, eos=3,
    [CLS]=4, [SEP]=5, [MASK]=6; text pieces start at 7. A literal "[CLS]", "[SEP]" or
    "[MASK]" in the text would encode to the special id, so such ids in text become unk.

Pretraining examples (after Google's create_pretraining_data.py, with the deviations noted)
    Sentences: a document is cut at blank lines and after ".", "!" or "?" (optionally
    followed by a closing quote or bracket) followed by whitespace, except after "e.g.",
    "i.e.", "cf." and "vs."; whitespace inside a sentence collapses to one space. This suits
    docstrings and ordinary prose; a decimal point or "os.path" is not cut because no
    whitespace follows.
    Pairs: for each document (every pass of `dupe_factor`), sentences are gathered into a
    chunk until it holds a target length (seq_length - 3 tokens, or with `short_seq_prob` a
    random shorter one). Segment A is the chunk's first 1..n-1 sentences. With probability
    0.5 segment B is the rest of the chunk (next_sentence_label 0, "is next"), else it is
    taken from a random sentence onward of another document (label 1, "random"; Hugging
    Face's convention) and the unused sentences go back for the next chunk. Unlike Google's
    code, a one-sentence chunk does not force a random B (which biases the labels towards
    "random" on short documents): its next sentence is added, or at the end of a document
    the previous sentence becomes A. Documents of a single sentence therefore only supply
    random B segments. Truncation to seq_length - 3 tokens removes tokens from the longer
    segment, from the front of A or the end of B, so the A|B junction of an "is next" pair
    is always a real sentence boundary.
    Layout: `[CLS] A [SEP] B [SEP]` then padding (id 0) to seq_length; token_type_ids 0 up
    to the first [SEP], 1 after it up to the second, 0 on padding; attention_mask 1 on
    tokens and 0 on padding.
    Masking: the candidates are the tokens of A and B (never [CLS], [SEP] or padding);
    n = min(max_predictions_per_seq, max(1, round(masked_lm_prob * candidates))) of them are
    chosen at random, or with `whole_word_mask` whole words (a word starts at a piece
    beginning with "▁" or at the start of a segment; a word that does not fit in what is
    left of n is skipped). Each chosen token becomes [MASK] with probability 0.8, a random
    text token (id >= 7) with 0.1, and stays unchanged with 0.1. masked_lm_positions (sorted)
    and masked_lm_ids (the original tokens) are padded with 0 to max_predictions_per_seq,
    masked_lm_weights is 1.0 for the real predictions and 0.0 for padding.
    Everything is drawn from Python's `random.Random`, seeded per split from `seed`: a build
    is reproducible on any machine. The train split makes `dupe_factor` passes with different
    pairs and masks; the held-out split one pass. Random B segments come from the same split.

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

Dataset directories (dataset.json is written last and marks a complete dataset):
    pretraining:    tokenizer.model, train.mindrecord, heldout.mindrecord (+ .db), dataset.json
    classification: tokenizer.model (a copy of the one given), train.mindrecord,
                    dev.mindrecord (+ .db), dataset.json
"""

import hashlib
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from model_zoo.data import (
    BUILTIN_PYTHON_DOCS,
    MANIFEST_FILE,
    Tokenizer,
    check_no_dataset,
    dataset_ready,
    load_documents,
    python_docstring_records,
    read_manifest,
    split_documents,
    train_tokenizer,
    write_mindrecord,
)
from model_zoo.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from model_zoo.errors import DataError, UserInputError
from model_zoo.files import write_atomically, write_json_atomically

# After the shared tokenizer's PAD_ID, UNK_ID, BOS_ID and EOS_ID (0-3): BERT's own symbols.
CLS_ID, SEP_ID, MASK_ID = 4, 5, 6
SPECIAL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
FIRST_TEXT_ID = 7
WORD_START = "\u2581"

PRETRAINING_COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions",
                       "masked_lm_ids", "masked_lm_weights", "next_sentence_label")
CLASSIFICATION_COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "label")
_INT_SEQUENCE = {"type": "int32", "shape": [-1]}
PRETRAINING_SCHEMA = {
    "input_ids": _INT_SEQUENCE, "token_type_ids": _INT_SEQUENCE, "attention_mask": _INT_SEQUENCE,
    "masked_lm_positions": _INT_SEQUENCE, "masked_lm_ids": _INT_SEQUENCE,
    "masked_lm_weights": {"type": "float32", "shape": [-1]},
    "next_sentence_label": {"type": "int32"},
}
CLASSIFICATION_SCHEMA = {"input_ids": _INT_SEQUENCE, "token_type_ids": _INT_SEQUENCE,
                         "attention_mask": _INT_SEQUENCE, "label": {"type": "int32"}}

TOKENIZER_FILE = "tokenizer.model"
PRETRAINING_FILES = {"train": "train.mindrecord", "heldout": "heldout.mindrecord"}
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

BLANK_LINES = re.compile(r"\n\s*\n")
SENTENCE_END = re.compile(r"[.!?][\"')\]]?\s+")
ABBREVIATIONS = ("e.g.", "i.e.", "cf.", "vs.")
WORDS = re.compile(r"\w+")


# ----------------------------------------------------------------------------- sentences

def normalize_whitespace(text):
    """`text` with every run of whitespace (newlines included) replaced by one space."""
    return " ".join(text.split())


def split_sentences(document):
    """The sentences of a document, whitespace-normalized (see the module docstring)."""
    sentences = []
    for paragraph in BLANK_LINES.split(document):
        start = 0
        for end in SENTENCE_END.finditer(paragraph):
            words = paragraph[start:end.end()].split()
            if words and words[-1].lower() in ABBREVIATIONS:
                continue
            sentences.append(paragraph[start:end.end()])
            start = end.end()
        sentences.append(paragraph[start:])
    return [sentence for sentence in map(normalize_whitespace, sentences) if sentence]


# ----------------------------------------------------------------------------- tokenizer

def train_bert_tokenizer(documents, model_path, vocab_size):
    """Train BERT's SentencePiece tokenizer on the sentences of `documents` (see above)."""
    sentences = [sentence for document in documents for sentence in split_sentences(document)]
    train_tokenizer(sentences, model_path, vocab_size, user_defined_symbols=SPECIAL_SYMBOLS,
                    word_boundaries=True)
    return load_bert_tokenizer(model_path)


def load_bert_tokenizer(model_path):
    """A Tokenizer, checked to have BERT's ids; DataError if it is missing or another kind."""
    tokenizer = Tokenizer(model_path)
    expected = {PAD_ID: "<pad>", UNK_ID: "<unk>", CLS_ID: "[CLS]", SEP_ID: "[SEP]",
                MASK_ID: "[MASK]"}
    if tokenizer.vocab_size <= FIRST_TEXT_ID or any(
            tokenizer.id_to_piece(token_id) != piece for token_id, piece in expected.items()):
        found = [tokenizer.id_to_piece(i) for i in range(min(tokenizer.vocab_size, FIRST_TEXT_ID))]
        raise DataError(f"{model_path}: not a BERT tokenizer (ids 0-6 must be <pad> <unk> <s> "
                        f"</s> [CLS] [SEP] [MASK], found {' '.join(found)})")
    return tokenizer


def word_start_flags(tokenizer):
    """Boolean array over the vocabulary: True for pieces that begin a word ("▁...")."""
    return np.array([tokenizer.id_to_piece(i).startswith(WORD_START)
                     for i in range(tokenizer.vocab_size)], dtype=bool)


def encode_text(tokenizer, text):
    """Token ids of `text` (whitespace-normalized), with special ids replaced by unk."""
    ids = tokenizer.encode(normalize_whitespace(text))
    return [UNK_ID if token_id < FIRST_TEXT_ID else token_id for token_id in ids]


def tokenize_documents(documents, tokenizer):
    """Documents as lists of sentences as lists of token ids; empty ones are dropped."""
    tokenized = []
    for document in documents:
        sentences = [encode_text(tokenizer, sentence) for sentence in split_sentences(document)]
        sentences = [ids for ids in sentences if ids]
        if sentences:
            tokenized.append(sentences)
    return tokenized


# ----------------------------------------------------------------------------- pretraining

def create_pretraining_examples(documents_ids, *, vocab_size, seq_length,
                                max_predictions_per_seq=20, masked_lm_prob=0.15,
                                whole_word_mask=False, word_starts=None, dupe_factor=1,
                                short_seq_prob=0.1, seed=1):
    """Masked-LM and next-sentence examples from tokenized documents, as columns.

    Args:
        documents_ids: documents, each a list of sentences, each a non-empty list of text ids.
        vocab_size: size of the vocabulary (random replacements are drawn from 7..vocab_size-1).
        seq_length, max_predictions_per_seq, masked_lm_prob, dupe_factor, short_seq_prob:
            see the module docstring.
        whole_word_mask: mask whole words; needs `word_starts` (see `word_start_flags`).
        seed: anything `random.Random` accepts (an int or a str).

    Returns:
        {column: numpy array} for PRETRAINING_COLUMNS, one row per example (in a seeded
        random order): int32 (N, seq_length) for the first three, (N, P) for the masked-LM
        columns (float32 weights), int32 (N,) next_sentence_label.

    Raises:
        DataError: invalid sizes, or fewer than 2 documents.
    """
    _check_pretraining_sizes(vocab_size, seq_length, max_predictions_per_seq, masked_lm_prob,
                             dupe_factor, short_seq_prob)
    if whole_word_mask and word_starts is None:
        raise DataError("whole_word_mask needs word_starts (word_start_flags(tokenizer))")
    documents_ids = [[list(sentence) for sentence in document if len(sentence)]
                     for document in documents_ids]
    documents_ids = [document for document in documents_ids if document]
    if len(documents_ids) < 2:
        raise DataError(f"need at least 2 non-empty documents to draw random next sentences, "
                        f"got {len(documents_ids)}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(dupe_factor):
        for index in range(len(documents_ids)):
            pairs.extend(_document_pairs(documents_ids, index, seq_length, short_seq_prob, rng))
    rng.shuffle(pairs)
    masking = {"vocab_size": vocab_size, "max_predictions_per_seq": max_predictions_per_seq,
               "masked_lm_prob": masked_lm_prob,
               "word_starts": word_starts if whole_word_mask else None}
    rows = [_example(tokens_a, tokens_b, is_random, seq_length, rng, **masking)
            for tokens_a, tokens_b, is_random in pairs]
    columns = {}
    for position, name in enumerate(PRETRAINING_COLUMNS):
        dtype = np.float32 if name == "masked_lm_weights" else np.int32
        shape = (0,) if name == "next_sentence_label" else (
            0, seq_length if position < 3 else max_predictions_per_seq)
        columns[name] = (np.array([row[position] for row in rows], dtype=dtype) if rows
                         else np.zeros(shape, dtype=dtype))
    return columns


def _document_pairs(documents, document_index, seq_length, short_seq_prob, rng):
    """(tokens_a, tokens_b, is_random_next) pairs of one document (see the module docstring)."""
    document = documents[document_index]
    max_tokens = seq_length - 3
    target = max_tokens
    if rng.random() < short_seq_prob:
        target = rng.randint(2, max_tokens)
    if len(document) < 2:
        return []
    pairs = []
    chunk, length, i = [], 0, 0
    while i < len(document):
        chunk.append(i)
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            is_random = rng.random() < 0.5
            if not is_random and len(chunk) == 1:
                if i + 1 < len(document):
                    i += 1
                    chunk.append(i)
                else:
                    chunk.insert(0, i - 1)
            a_end = 1 if len(chunk) == 1 else rng.randint(1, len(chunk) - 1)
            tokens_a = [token for j in chunk[:a_end] for token in document[j]]
            if is_random:
                other_index = rng.randrange(len(documents) - 1)
                other_index += other_index >= document_index
                other = documents[other_index]
                tokens_b = []
                for sentence in other[rng.randrange(len(other)):]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target - len(tokens_a):
                        break
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                tokens_b = [token for j in chunk[a_end:] for token in document[j]]
            while len(tokens_a) + len(tokens_b) > max_tokens:
                if len(tokens_a) > len(tokens_b):
                    del tokens_a[0]
                else:
                    tokens_b.pop()
            pairs.append((tokens_a, tokens_b, is_random))
            chunk, length = [], 0
        i += 1
    return pairs


def _example(tokens_a, tokens_b, is_random, seq_length, rng, *, vocab_size,
             max_predictions_per_seq, masked_lm_prob, word_starts):
    """One example's columns, in PRETRAINING_COLUMNS order."""
    tokens = [CLS_ID, *tokens_a, SEP_ID, *tokens_b, SEP_ID]
    segment_b = range(len(tokens_a) + 2, len(tokens) - 1)
    candidates = []  # groups of positions masked together
    for segment in (range(1, len(tokens_a) + 1), segment_b):
        for position in segment:
            if (word_starts is not None and position != segment.start
                    and not word_starts[tokens[position]]):
                candidates[-1].append(position)
            else:
                candidates.append([position])
    eligible = len(tokens_a) + len(tokens_b)
    to_predict = min(max_predictions_per_seq, max(1, int(round(eligible * masked_lm_prob))))
    rng.shuffle(candidates)
    selected = []
    for group in candidates:
        if len(selected) >= to_predict:
            break
        if len(selected) + len(group) <= to_predict:
            selected.extend(group)
    if not selected:  # every word is longer than the budget: mask part of one
        selected = candidates[0][:to_predict]
    selected.sort()

    input_ids = list(tokens)
    for position in selected:
        draw = rng.random()
        if draw < 0.8:
            input_ids[position] = MASK_ID
        elif draw >= 0.9:
            input_ids[position] = rng.randrange(FIRST_TEXT_ID, vocab_size)
    padding = [0] * (seq_length - len(tokens))
    unused = [0] * (max_predictions_per_seq - len(selected))
    return (input_ids + padding,
            [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1) + padding,
            [1] * len(tokens) + padding,
            selected + unused,
            [tokens[position] for position in selected] + unused,
            [1.0] * len(selected) + [0.0] * len(unused),
            int(is_random))


def build_pretraining_dataset(output_dir, documents, *, vocab_size, seq_length,
                              max_predictions_per_seq=20, masked_lm_prob=0.15,
                              whole_word_mask=False, dupe_factor=2, short_seq_prob=0.1,
                              heldout_fraction=0.05, seed=1, source="documents"):
    """Build a BERT pretraining dataset from text documents into `output_dir`; returns dataset.json.

    The documents are split into train and held-out documents by
    `split_documents(documents, heldout_fraction, seed)`, the tokenizer is trained on the
    train split, and each split becomes a MindRecord file of the rows of
    `create_pretraining_examples(tokenize_documents(split documents, tokenizer), ...,
    seed=f"{split}:{seed}")`, with dupe_factor passes for "train" and one for "heldout".
    Files of an incomplete earlier build (no dataset.json) are replaced; a complete dataset
    is never overwritten.

    Raises:
        DataError: a dataset already there, invalid sizes, or too little text for a split.
    """
    output_dir = Path(output_dir)
    check_no_dataset(output_dir)
    _check_pretraining_sizes(vocab_size, seq_length, max_predictions_per_seq, masked_lm_prob,
                             dupe_factor, short_seq_prob)
    splits = dict(zip(PRETRAINING_FILES, split_documents(documents, heldout_fraction, seed)))
    tokenizer = train_bert_tokenizer(splits["train"], output_dir / TOKENIZER_FILE, vocab_size)
    word_starts = word_start_flags(tokenizer) if whole_word_mask else None

    examples, summary = {}, {}
    for split, split_documents_ in splits.items():
        documents_ids = tokenize_documents(split_documents_, tokenizer)
        pairable = sum(len(document) >= 2 for document in documents_ids)
        if len(documents_ids) < 2 or pairable == 0:
            raise DataError(
                f"the {split} split has {len(documents_ids)} non-empty documents, "
                f"{pairable} of them with 2 sentences or more: sentence pairs need at least 2 "
                f"documents, one of them with 2 sentences or more; give more text"
                + (" or a larger heldout_fraction" if split == "heldout" else ""))
        passes = dupe_factor if split == "train" else 1
        columns = create_pretraining_examples(
            documents_ids, vocab_size=vocab_size, seq_length=seq_length,
            max_predictions_per_seq=max_predictions_per_seq, masked_lm_prob=masked_lm_prob,
            whole_word_mask=whole_word_mask, word_starts=word_starts, dupe_factor=passes,
            short_seq_prob=short_seq_prob, seed=f"{split}:{seed}")
        count = len(columns["next_sentence_label"])
        random_next = int(columns["next_sentence_label"].sum())
        examples[split] = columns
        summary[split] = {
            "file": PRETRAINING_FILES[split], "documents": len(split_documents_),
            "sentences": sum(len(document) for document in documents_ids),
            "tokens": sum(len(sentence) for document in documents_ids for sentence in document),
            "passes": passes, "examples": count, "is_next": count - random_next,
            "random_next": random_next,
            "masked_predictions": int(columns["masked_lm_weights"].sum()),
        }

    for split, columns in examples.items():
        write_mindrecord(output_dir / PRETRAINING_FILES[split], PRETRAINING_SCHEMA,
                         _rows(columns, PRETRAINING_COLUMNS),
                         description=f"BERT pretraining examples ({split}), seq_length "
                                     f"{seq_length}", overwrite=True)
    manifest = {
        "task": "pretraining",
        "source": source,
        "vocab_size": vocab_size,
        "seq_length": seq_length,
        "max_predictions_per_seq": max_predictions_per_seq,
        "masked_lm_prob": masked_lm_prob,
        "whole_word_mask": whole_word_mask,
        "dupe_factor": dupe_factor,
        "short_seq_prob": short_seq_prob,
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        "tokenizer": TOKENIZER_FILE,
        "special_ids": _special_ids(),
        "columns": list(PRETRAINING_COLUMNS),
        "splits": summary,
    }
    write_json_atomically(output_dir / MANIFEST_FILE, manifest)
    return manifest


def pretraining_dataset_ready(output_dir, vocab_size, seq_length, max_predictions_per_seq):
    """True if `output_dir` holds a complete pretraining dataset built with these sizes.

    False if it holds no dataset.json; DataError if it holds another dataset, one built with
    other sizes, or if files are missing.
    """
    asked = {"vocab_size": vocab_size, "seq_length": seq_length,
             "max_predictions_per_seq": max_predictions_per_seq}
    return dataset_ready(output_dir, asked, [TOKENIZER_FILE, *PRETRAINING_FILES.values()],
                         _task_check(output_dir, "pretraining"))


# ----------------------------------------------------------------------------- classification

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
    _check_int("seq_length", seq_length, 3)
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
    write_json_atomically(output_dir / MANIFEST_FILE, manifest)
    return manifest


def classification_dataset_ready(output_dir, vocab_size, seq_length, *, tokenizer_path=None):
    """True if `output_dir` holds a complete classification dataset for these sizes.

    False if it holds no dataset.json; DataError if it holds another dataset, one built with
    other sizes or (when `tokenizer_path` is given) another tokenizer, or if files are missing.
    """
    if not dataset_ready(output_dir, {"vocab_size": vocab_size, "seq_length": seq_length},
                         [TOKENIZER_FILE, *CLASSIFICATION_FILES.values()],
                         _task_check(output_dir, "classification")):
        return False
    manifest = read_manifest(output_dir)
    if tokenizer_path is not None:
        digest = hashlib.sha256(Tokenizer(tokenizer_path).model_path.read_bytes()).hexdigest()
        if digest != manifest.get("tokenizer_sha256"):
            raise DataError(f"{output_dir} was built with another tokenizer than {tokenizer_path} "
                            f"(from {manifest.get('tokenizer_source')}); use another directory "
                            f"or delete it")
    return True


# ----------------------------------------------------------------------------- shared

def add_data_arguments(parser):
    """Arguments of `model-zoo data bert`."""
    parser.add_argument("--task", choices=("pretrain", "classify"), default="pretrain",
                        help="pretrain: masked-LM + next-sentence examples from --input "
                             "(default); classify: the docstring topic classification set, "
                             "tokenized with --tokenizer")
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help=f"pretrain: UTF-8 text files (documents separated by blank lines), "
                             f"or {BUILTIN_PYTHON_DOCS} for the docstrings of Python's "
                             f"standard library")
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
    parser.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="pretrain: fraction of documents held out (default 0.05)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="classify: the pretraining dataset's tokenizer.model")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the splits, pairs and masks (default 1)")


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
    documents = load_documents(args.input)
    source = " ".join(args.input)
    if BUILTIN_PYTHON_DOCS in args.input:
        source += f" (Python {sys.version.split()[0]})"
    manifest = build_pretraining_dataset(
        output_dir, documents, vocab_size=args.vocab_size, seq_length=args.seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq, masked_lm_prob=args.masked_lm_prob,
        whole_word_mask=args.whole_word_mask, dupe_factor=args.dupe_factor,
        short_seq_prob=args.short_seq_prob, heldout_fraction=args.heldout_fraction,
        seed=args.seed, source=source)
    splits = manifest["splits"]
    print(f"bert dataset: {len(documents)} documents, "
          f"{splits['train']['sentences'] + splits['heldout']['sentences']} sentences, "
          f"{splits['train']['examples']} train / {splits['heldout']['examples']} heldout "
          f"examples of {args.seq_length} tokens (at most {args.max_predictions_per_seq} "
          f"masked) in {output_dir}")


def _rows(columns, names):
    for index in range(len(columns[names[0]])):
        yield {name: columns[name][index] for name in names}


def _special_ids():
    return {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "cls": CLS_ID,
            "sep": SEP_ID, "mask": MASK_ID}


def _check_pretraining_sizes(vocab_size, seq_length, max_predictions_per_seq, masked_lm_prob,
                             dupe_factor, short_seq_prob):
    _check_int("vocab_size", vocab_size, FIRST_TEXT_ID + 1)
    _check_int("seq_length", seq_length, 5)
    _check_int("max_predictions_per_seq", max_predictions_per_seq, 1)
    _check_int("dupe_factor", dupe_factor, 1)
    if max_predictions_per_seq > seq_length - 3:
        raise DataError(f"max_predictions_per_seq={max_predictions_per_seq} is more than the "
                        f"seq_length - 3 = {seq_length - 3} tokens a sequence can hold")
    if not 0.0 < masked_lm_prob <= 1.0:
        raise DataError(f"masked_lm_prob must be in (0, 1], got {masked_lm_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise DataError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _task_check(output_dir, task):
    """A dataset_ready check that a manifest describes a BERT `task` dataset."""
    def check(manifest):
        built = manifest.get("task")
        if built != task:
            kind = f"a BERT {built} dataset" if built else "another model's dataset"
            raise DataError(f"{output_dir} holds {kind}, not a BERT {task} dataset; use "
                            f"another directory or delete it")
    return check
