"""BERT datasets: the tokenizer and the masked-LM + next-sentence pretraining set (the
topic classification set is in `classification.py`, the `model-zoo data bert` command in
`data_command.py`).

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
    Everything is drawn from Python's `random.Random`, seeded per split and piece of the
    corpus from `seed`: a build is reproducible on any machine, with any number of workers.
    The train split makes `dupe_factor` passes with different pairs and masks; the held-out
    split one pass. Random B segments come from the same split of the same piece.

Dataset directories (dataset.json is written last and marks a complete dataset):
    pretraining:    tokenizer.model, train.mindrecord, heldout.mindrecord (+ .db), dataset.json;
                    a corpus of several pieces: train-00000-of-00004.mindrecord, ...
    classification: tokenizer.model (a copy of the one given), train.mindrecord,
                    dev.mindrecord (+ .db), dataset.json
"""

import os
import random
import re
from pathlib import Path

import numpy as np

from model_zoo.data import (
    TOKENIZER_FILE,
    Tokenizer,
    dataset_ready,
    split_paths,
    train_tokenizer,
    write_mindrecord,
)
from model_zoo.data.streaming import (
    BuildOptions,
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
from model_zoo.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from model_zoo.errors import DataError

# After the shared tokenizer's PAD_ID, UNK_ID, BOS_ID and EOS_ID (0-3): BERT's own symbols.
CLS_ID, SEP_ID, MASK_ID = 4, 5, 6
SPECIAL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
FIRST_TEXT_ID = 7
WORD_START = "\u2581"

PRETRAINING_COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions",
                       "masked_lm_ids", "masked_lm_weights", "next_sentence_label")
INT_SEQUENCE = {"type": "int32", "shape": [-1]}
PRETRAINING_SCHEMA = {
    "input_ids": INT_SEQUENCE, "token_type_ids": INT_SEQUENCE, "attention_mask": INT_SEQUENCE,
    "masked_lm_positions": INT_SEQUENCE, "masked_lm_ids": INT_SEQUENCE,
    "masked_lm_weights": {"type": "float32", "shape": [-1]},
    "next_sentence_label": {"type": "int32"},
}

PRETRAINING_SPLITS = ("train", "heldout")
PRETRAINING_FILES = {split: shard_name(split, 0, 1) for split in PRETRAINING_SPLITS}
PIECE_NUMBERS = ("documents", "sentences", "tokens", "examples", "is_next", "random_next",
                 "masked_predictions")   # what each piece counts of a split, summed

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

def train_bert_tokenizer(documents, model_path, vocab_size, *, sentences: int = 0,
                         seed: int = 1):
    """Train BERT's SentencePiece tokenizer on the sentences of `documents` (see above), a
    seeded sample of `sentences` of them if > 0 (`train_tokenizer`)."""
    lines = (sentence for document in documents for sentence in split_sentences(document))
    train_tokenizer(lines, model_path, vocab_size, user_defined_symbols=SPECIAL_SYMBOLS,
                    word_boundaries=True, sentences=sentences, seed=seed)
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


def build_pretraining_dataset(output_dir, sources, *, vocab_size, seq_length,
                              max_predictions_per_seq=20, masked_lm_prob=0.15,
                              whole_word_mask=False, dupe_factor=2, short_seq_prob=0.1,
                              options=BuildOptions(), source=None, record_sources=True):
    """Build a BERT pretraining dataset from `sources` (files, folders, globs, built-in
    corpora) into `output_dir`; returns dataset.json.

    A streaming build (`model_zoo.data.streaming`, cut and split by `options`): the
    tokenizer is trained on a sample of the train split's sentences, and each piece of the
    corpus becomes its own MindRecord files of the rows of
    `create_pretraining_examples(tokenize_documents(its documents of a split), ...,
    seed=f"{split}:{seed}:{piece}")`, with dupe_factor passes for "train" and one for
    "heldout"; random next sentences come from the same piece, as in Google's script, which
    runs on each input shard alone. An unfinished earlier build with the same settings is
    resumed, the files of another replaced; a complete dataset is never overwritten.

    Raises:
        DataError: a dataset already there, invalid sizes, or too little text for a split.
    """
    output_dir = Path(output_dir)
    _check_pretraining_sizes(vocab_size, seq_length, max_predictions_per_seq, masked_lm_prob,
                             dupe_factor, short_seq_prob)
    sizes = {"vocab_size": vocab_size, "seq_length": seq_length,
             "max_predictions_per_seq": max_predictions_per_seq,
             "masked_lm_prob": masked_lm_prob, "whole_word_mask": whole_word_mask,
             "dupe_factor": dupe_factor, "short_seq_prob": short_seq_prob}
    path = output_dir / TOKENIZER_FILE

    def tokenizer_for(plan, rule, entries):
        return planned_tokenizer(output_dir, plan, path, lambda: train_bert_tokenizer(
            train_documents(entries, options.json_key, rule), path, vocab_size,
            sentences=options.tokenizer_sentences, seed=options.seed))

    plan, records, _ = streaming_build(
        output_dir, sources, options, settings=dict(sizes, task="pretraining"),
        splits=PRETRAINING_SPLITS, label="bert data", tokenizer_for=tokenizer_for,
        build_piece=build_pretraining_piece, job=dict(sizes, seed=options.seed))
    summary = split_totals(records, PRETRAINING_SPLITS, PIECE_NUMBERS)
    for split, numbers in summary.items():
        numbers["passes"] = dupe_factor if split == "train" else 1
        if numbers["examples"] == 0:
            raise DataError(
                f"the {split} split has {numbers['documents']} documents and no sentence pair: "
                f"pairs need at least 2 documents of a piece, one of them with 2 sentences or "
                f"more; give more text or larger pieces"
                + (" or a larger heldout_fraction" if split == "heldout" else ""))
    manifest = {
        "task": "pretraining",
        "source": source,
        **sizes,
        "heldout_fraction": options.heldout_fraction,
        "seed": options.seed,
        "tokenizer": TOKENIZER_FILE,
        "special_ids": special_ids(),
        "columns": list(PRETRAINING_COLUMNS),
        "splits": summary,
        "build": build_summary(plan),
    }
    return finish_build(output_dir, manifest, sources, records, record_sources)


def _tokenizer_and_word_starts(path):
    tokenizer = load_bert_tokenizer(path)
    return tokenizer, word_start_flags(tokenizer)


def build_pretraining_piece(job: dict, piece) -> dict:
    """The pretraining examples of one piece of the corpus, written as its train and
    heldout files (a worker's task; see `model_zoo.data.streaming.build_pieces`)."""
    tokenizer, word_starts = piece_tokenizer(job, _tokenizer_and_word_starts)
    documents = {split: [] for split in PRETRAINING_SPLITS}
    for _, text, heldout, size in piece_documents(job["entries"], job["json_key"], job["rule"],
                                                  piece):
        tokenized = tokenize_documents([text], tokenizer)
        if tokenized:
            documents["heldout" if heldout else "train"].append(tokenized[0])
        count_progress(1, sum(len(sentence) for document in tokenized for sentence in document),
                       size)
    output_dir, numbers = Path(job["output_dir"]), {}
    for split, documents_ids in documents.items():
        pairable = sum(len(document) >= 2 for document in documents_ids)
        columns = None
        if len(documents_ids) >= 2 and pairable:
            columns = create_pretraining_examples(
                documents_ids, vocab_size=job["vocab_size"], seq_length=job["seq_length"],
                max_predictions_per_seq=job["max_predictions_per_seq"],
                masked_lm_prob=job["masked_lm_prob"], whole_word_mask=job["whole_word_mask"],
                word_starts=word_starts, short_seq_prob=job["short_seq_prob"],
                dupe_factor=job["dupe_factor"] if split == "train" else 1,
                seed=f"{split}:{job['seed']}:{piece.index}")
        count = 0 if columns is None else len(columns["next_sentence_label"])
        name = shard_name(split, piece.index, job["pieces"])
        if count:
            write_mindrecord(output_dir / name, PRETRAINING_SCHEMA,
                             record_rows(columns, PRETRAINING_COLUMNS),
                             description=f"BERT pretraining examples ({split}), seq_length "
                                         f"{job['seq_length']}", overwrite=True)
        random_next = 0 if columns is None else int(columns["next_sentence_label"].sum())
        numbers[split] = {
            "files": [name] if count else [], "documents": len(documents_ids),
            "sentences": sum(len(document) for document in documents_ids),
            "tokens": sum(len(sentence) for document in documents_ids for sentence in document),
            "examples": count, "is_next": count - random_next, "random_next": random_next,
            "masked_predictions": 0 if columns is None else int(columns["masked_lm_weights"].sum()),
        }
    return {"splits": numbers}


def pretraining_dataset_ready(output_dir, vocab_size, seq_length, max_predictions_per_seq):
    """True if `output_dir` holds a complete pretraining dataset built with these sizes.

    False if it holds no dataset.json; DataError if it holds another dataset, one built with
    other sizes, or if files are missing.
    """
    asked = {"vocab_size": vocab_size, "seq_length": seq_length,
             "max_predictions_per_seq": max_predictions_per_seq}
    return dataset_ready(output_dir, asked, lambda manifest: [TOKENIZER_FILE, *(
        os.path.basename(path) for split in PRETRAINING_SPLITS
        for path in split_paths(output_dir, PRETRAINING_FILES, split))],
        task_check(output_dir, "pretraining"))


def record_rows(columns, names):
    """MindRecord rows from column arrays."""
    for index in range(len(columns[names[0]])):
        yield {name: columns[name][index] for name in names}


def special_ids():
    return {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "cls": CLS_ID,
            "sep": SEP_ID, "mask": MASK_ID}


def _check_pretraining_sizes(vocab_size, seq_length, max_predictions_per_seq, masked_lm_prob,
                             dupe_factor, short_seq_prob):
    check_int("vocab_size", vocab_size, FIRST_TEXT_ID + 1)
    check_int("seq_length", seq_length, 5)
    check_int("max_predictions_per_seq", max_predictions_per_seq, 1)
    check_int("dupe_factor", dupe_factor, 1)
    if max_predictions_per_seq > seq_length - 3:
        raise DataError(f"max_predictions_per_seq={max_predictions_per_seq} is more than the "
                        f"seq_length - 3 = {seq_length - 3} tokens a sequence can hold")
    if not 0.0 < masked_lm_prob <= 1.0:
        raise DataError(f"masked_lm_prob must be in (0, 1], got {masked_lm_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise DataError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")


def check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")


def task_check(output_dir, task):
    """A dataset_ready check that a manifest describes a BERT `task` dataset."""
    def check(manifest):
        built = manifest.get("task")
        if built != task:
            kind = f"a BERT {built} dataset" if built else "another model's dataset"
            raise DataError(f"{output_dir} holds {kind}, not a BERT {task} dataset; use "
                            f"another directory or delete it")
    return check
