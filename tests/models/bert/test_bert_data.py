"""BERT data: sentences, tokenizer ids, pretraining pairs and masks, MindRecord round trips,
the docstring topic classification set, the command and its errors.

Tiny sizes (vocab 300, seq_length 48-64, 200 docstrings) keep the file fast. Statistical
checks use deterministic seeds and tolerances of about 3 standard deviations for the sample
sizes involved (stated at each check), so they hold for any reasonable seed.
"""

import argparse
import json

import numpy as np
import pytest

from model_zoo.models.bert import classification as bert_classification
from model_zoo.models.bert import data as bert_data
from model_zoo.models.bert import data_command as bert_command
from model_zoo.models.bert.classification import CLASSIFICATION_COLUMNS, CLASSIFICATION_LABELS
from model_zoo.models.bert.data import (
    CLS_ID,
    FIRST_TEXT_ID,
    MASK_ID,
    PRETRAINING_COLUMNS,
    SEP_ID,
)
from model_zoo.data.tokenizer import UNK_ID
from model_zoo.data import (
    count_samples,
    create_dataset,
    load_documents,
    python_docstrings_corpus,
    train_tokenizer,
)
from model_zoo.data.streaming import BuildOptions, SplitRule
from model_zoo.errors import DataError, UserInputError

from conftest import write_jsonl

VOCAB = 300
SEQ = 64
MAX_PREDICTIONS = 20  # more than 15% of 61 text tokens: the cap never binds
BUILD_PREDICTIONS = 6
SPECIAL_IDS = {0, 2, 3, CLS_ID, SEP_ID, MASK_ID}  # never a text token (unk is one)


@pytest.fixture(scope="module")
def documents():
    return python_docstrings_corpus()[:200]


@pytest.fixture(scope="module")
def tokenizer(documents, tmp_path_factory):
    return bert_data.train_bert_tokenizer(documents, tmp_path_factory.mktemp("bert_tok") /
                                          "tokenizer.model", VOCAB)


@pytest.fixture(scope="module")
def documents_ids(documents, tokenizer):
    return bert_data.tokenize_documents(documents, tokenizer)


@pytest.fixture(scope="module")
def examples(documents_ids):
    return bert_data.create_pretraining_examples(
        documents_ids, vocab_size=VOCAB, seq_length=SEQ, max_predictions_per_seq=MAX_PREDICTIONS,
        dupe_factor=3, seed=1)


@pytest.fixture(scope="module")
def word_starts(tokenizer):
    return bert_data.word_start_flags(tokenizer)


@pytest.fixture(scope="module")
def whole_word_examples(documents_ids, word_starts):
    return bert_data.create_pretraining_examples(
        documents_ids, vocab_size=VOCAB, seq_length=SEQ, max_predictions_per_seq=MAX_PREDICTIONS,
        whole_word_mask=True, word_starts=word_starts, dupe_factor=2, seed=1)


@pytest.fixture(scope="module")
def pretraining_dir(documents, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("bert_pretraining") / "data"
    corpus = write_jsonl(output_dir.parent / "corpus.jsonl", documents[:150])
    bert_data.build_pretraining_dataset(output_dir, [corpus], vocab_size=VOCAB,
                                        seq_length=48, max_predictions_per_seq=BUILD_PREDICTIONS,
                                        dupe_factor=2, source="test slice",
                                        options=BuildOptions(heldout_fraction=0.1, seed=3),
                                        record_sources=False)
    return output_dir


@pytest.fixture(scope="module")
def classification_dir(pretraining_dir, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("bert_classification") / "data"
    bert_classification.build_classification_dataset(
        output_dir, pretraining_dir / "tokenizer.model", seq_length=32, seed=1)
    return output_dir


@pytest.fixture(scope="module")
def topic_examples():
    return bert_classification.docstring_topic_examples()


@pytest.fixture(scope="module")
def topic_split(topic_examples):
    return bert_classification.split_topic_examples(topic_examples, seed=1)


def originals(examples):
    """The unmasked input ids: masked positions restored from masked_lm_ids."""
    restored = examples["input_ids"].copy()
    for row in range(len(restored)):
        real = examples["masked_lm_weights"][row] > 0
        restored[row, examples["masked_lm_positions"][row][real]] = (
            examples["masked_lm_ids"][row][real])
    return restored


def segments(original_row, attention_row):
    """(tokens of A, tokens of B) of one unmasked example, checking [CLS] A [SEP] B [SEP]."""
    length = int(attention_row.sum())
    tokens = original_row[:length].tolist()
    assert tokens[0] == CLS_ID and tokens[-1] == SEP_ID
    separators = [index for index, token in enumerate(tokens) if token == SEP_ID]
    assert len(separators) == 2
    return tokens[1:separators[0]], tokens[separators[0] + 1:-1]


def predictions(examples):
    """Arrays over all real predictions: (row, position, original id, input id there)."""
    rows, positions = np.nonzero(examples["masked_lm_weights"])
    sequence_positions = examples["masked_lm_positions"][rows, positions]
    return (rows, sequence_positions, examples["masked_lm_ids"][rows, positions],
            examples["input_ids"][rows, sequence_positions])


# ----------------------------------------------------------------------------- text

def test_split_sentences():
    text = ("First one. Second, e.g. this one!  Third? \"Quoted.\" os.path and 3.14 stay\n"
            "together.\n\n  New paragraph\n  wrapped without a full stop\n\n\n")
    assert bert_data.split_sentences(text) == [
        "First one.", "Second, e.g. this one!", "Third?", "\"Quoted.\"",
        "os.path and 3.14 stay together.", "New paragraph wrapped without a full stop"]
    assert bert_data.split_sentences(" \n\n ") == []


def test_tokenizer_has_bert_ids_and_marks_every_word(tokenizer, tmp_path):
    assert tokenizer.vocab_size == VOCAB
    assert [tokenizer.id_to_piece(i) for i in range(FIRST_TEXT_ID)] == [
        "<pad>", "<unk>", "<s>", "</s>", "[CLS]", "[SEP]", "[MASK]"]
    text = "Return the\nnumber  of items."
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode(text)]
    words = [piece for piece in pieces if piece.startswith("\u2581")]
    assert len(words) == 5 and pieces[0].startswith("\u2581")
    assert tokenizer.decode(tokenizer.encode(text)) == "Return the number of items."
    # literal special symbols in text never become special ids
    assert bert_data.encode_text(tokenizer, "a [MASK] b [SEP]").count(UNK_ID) == 2
    assert not set(bert_data.encode_text(tokenizer, "a [MASK] b [SEP]")) & SPECIAL_IDS

    gpt2_style = train_tokenizer(["Some text. More text here."] * 20, tmp_path / "t.model", 40)
    with pytest.raises(DataError, match="not a BERT tokenizer"):
        bert_data.load_bert_tokenizer(gpt2_style.model_path)


# ----------------------------------------------------------------------------- pretraining

def test_layout_token_types_attention_and_padding(examples):
    count = len(examples["next_sentence_label"])
    assert count > 500
    for name in PRETRAINING_COLUMNS:
        assert len(examples[name]) == count
        assert examples[name].dtype == (np.float32 if name == "masked_lm_weights" else np.int32)
    assert examples["input_ids"].shape == (count, SEQ)
    assert examples["masked_lm_positions"].shape == (count, MAX_PREDICTIONS)
    restored = originals(examples)
    for row in range(count):
        attention = examples["attention_mask"][row]
        length = int(attention.sum())
        assert attention.tolist() == [1] * length + [0] * (SEQ - length)
        tokens_a, tokens_b = segments(restored[row], attention)
        assert tokens_a and tokens_b and len(tokens_a) + len(tokens_b) <= SEQ - 3
        assert not set(tokens_a + tokens_b) & SPECIAL_IDS
        assert examples["token_type_ids"][row].tolist() == (
            [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1) + [0] * (SEQ - length))
        assert not examples["input_ids"][row, length:].any()
    # long documents fill the sequence: truncation keeps pairs at seq_length - 3 tokens
    assert examples["attention_mask"].sum(axis=1).max() == SEQ


def test_masking_selects_15_percent_of_text_tokens_capped(examples, documents_ids):
    eligible = examples["attention_mask"].sum(axis=1) - 3
    selected = (examples["masked_lm_weights"] > 0).sum(axis=1)
    np.testing.assert_array_equal(selected,
                                  [max(1, int(round(0.15 * count))) for count in eligible])
    ratio = selected.sum() / eligible.sum()
    assert 0.14 < ratio < 0.16, ratio  # exact up to per-example rounding
    # weights are 1 exactly for real predictions, which come first; padding is all zero
    weights = examples["masked_lm_weights"]
    assert set(np.unique(weights).tolist()) == {0.0, 1.0}
    for row in range(len(weights)):
        real = int(selected[row])
        assert weights[row].tolist() == [1.0] * real + [0.0] * (MAX_PREDICTIONS - real)
        positions = examples["masked_lm_positions"][row]
        assert positions[:real].tolist() == sorted(set(positions[:real].tolist()))
        assert not positions[real:].any() and not examples["masked_lm_ids"][row, real:].any()

    capped = bert_data.create_pretraining_examples(documents_ids, vocab_size=VOCAB,
                                                   seq_length=SEQ, max_predictions_per_seq=4)
    eligible = capped["attention_mask"].sum(axis=1) - 3
    selected = capped["masked_lm_weights"].sum(axis=1)
    np.testing.assert_array_equal(
        selected, np.minimum(4, [max(1, int(round(0.15 * count))) for count in eligible]))
    assert (selected == 4).mean() > 0.5 and capped["masked_lm_ids"].shape[1] == 4


def test_masked_tokens_80_10_10_and_specials_never_selected(examples):
    rows, positions, original_ids, input_ids = predictions(examples)
    assert len(rows) > 3000
    restored = originals(examples)
    np.testing.assert_array_equal(restored[rows, positions], original_ids)
    assert not set(original_ids.tolist()) & SPECIAL_IDS  # never [CLS], [SEP] or padding
    lengths = examples["attention_mask"].sum(axis=1)
    assert (positions >= 1).all() and (positions < lengths[rows] - 1).all()
    masked = input_ids == MASK_ID
    kept = input_ids == original_ids
    replaced = ~masked & ~kept
    # binomial standard deviations at n > 3000: 0.007 (80%) and 0.0055 (10%); tolerance 0.03
    assert abs(masked.mean() - 0.8) < 0.03, masked.mean()
    assert abs(kept.mean() - 0.1) < 0.03, kept.mean()  # (+ random picks equal to the original)
    assert abs(replaced.mean() - 0.1) < 0.03, replaced.mean()
    assert (input_ids[replaced] >= FIRST_TEXT_ID).all() and (input_ids[replaced] < VOCAB).all()
    # positions that were not selected hold their original token
    unselected = np.ones(examples["input_ids"].shape, dtype=bool)
    unselected[rows, positions] = False
    np.testing.assert_array_equal(examples["input_ids"][unselected], restored[unselected])


def test_whole_word_masking_selects_whole_words(whole_word_examples, word_starts):
    restored = originals(whole_word_examples)
    rows, positions, _, _ = predictions(whole_word_examples)
    chosen = set(zip(rows.tolist(), positions.tolist()))
    multi_piece_words = 0
    for row in range(len(restored)):
        tokens_a, tokens_b = segments(restored[row], whole_word_examples["attention_mask"][row])
        for start, segment in ((1, tokens_a), (len(tokens_a) + 2, tokens_b)):
            words = []
            for offset, token in enumerate(segment):
                if offset == 0 or word_starts[token]:
                    words.append([])
                words[-1].append(start + offset)
            for word in words:
                picked = [(row, position) in chosen for position in word]
                assert all(picked) or not any(picked), (row, word)
                multi_piece_words += all(picked) and len(word) > 1
        selected = int(whole_word_examples["masked_lm_weights"][row].sum())
        assert 1 <= selected <= max(1, round(0.15 * (len(tokens_a) + len(tokens_b))))
    assert multi_piece_words > 100


def test_next_sentence_labels_balanced_and_is_next_pairs_consecutive(examples, documents_ids):
    labels = examples["next_sentence_label"]
    assert set(np.unique(labels).tolist()) == {0, 1}
    # n > 500 pairs: standard deviation of the fraction < 0.023; tolerance 0.07
    assert abs(labels.mean() - 0.5) < 0.07, labels.mean()
    sentence_starts = []  # (document stream, offset of a sentence start that is not the first)
    for document in documents_ids:
        stream = [token for sentence in document for token in sentence]
        offset = 0
        for sentence in document[:-1]:
            offset += len(sentence)
            sentence_starts.append((stream, offset))

    def consecutive(tokens_a, tokens_b):
        """A ends a sentence and B starts the next one(s) of the same document."""
        return any(stream[offset - len(tokens_a):offset] == tokens_a
                   and stream[offset:offset + len(tokens_b)] == tokens_b
                   for stream, offset in sentence_starts if offset >= len(tokens_a))

    restored = originals(examples)
    random_consecutive = 0
    for row in range(len(labels)):
        pair = segments(restored[row], examples["attention_mask"][row])
        if labels[row] == 0:
            assert consecutive(*pair), row
        else:
            random_consecutive += consecutive(*pair)
    assert random_consecutive <= 0.02 * labels.sum()  # only repeated sentences can match


def test_examples_are_deterministic_with_a_seed(documents_ids, examples):
    def make(seed):
        return bert_data.create_pretraining_examples(
            documents_ids, vocab_size=VOCAB, seq_length=SEQ,
            max_predictions_per_seq=MAX_PREDICTIONS, dupe_factor=3, seed=seed)

    again, other = make(1), make(2)
    for name in PRETRAINING_COLUMNS:
        np.testing.assert_array_equal(again[name], examples[name])
    assert not np.array_equal(other["masked_lm_positions"], examples["masked_lm_positions"])
    # the dupe_factor passes pair and mask the documents differently
    one_pass = bert_data.create_pretraining_examples(
        documents_ids, vocab_size=VOCAB, seq_length=SEQ, max_predictions_per_seq=MAX_PREDICTIONS,
        dupe_factor=1, seed=1)
    assert 2.5 < len(examples["input_ids"]) / len(one_pass["input_ids"]) < 3.5
    assert len({row.tobytes() for row in examples["input_ids"]}) > 0.95 * len(examples["input_ids"])


def test_pretraining_dataset_round_trip(pretraining_dir, documents):
    manifest = json.loads((pretraining_dir / "dataset.json").read_text())
    assert sorted(path.name for path in pretraining_dir.iterdir()) == [
        "dataset.json", "heldout.mindrecord", "heldout.mindrecord.db", "tokenizer.model",
        "train.mindrecord", "train.mindrecord.db"]
    assert {key: manifest[key] for key in ("task", "vocab_size", "seq_length",
                                           "max_predictions_per_seq", "masked_lm_prob",
                                           "whole_word_mask", "dupe_factor", "seed")} == {
        "task": "pretraining", "vocab_size": VOCAB, "seq_length": 48, "max_predictions_per_seq":
        BUILD_PREDICTIONS, "masked_lm_prob": 0.15, "whole_word_mask": False, "dupe_factor": 2,
        "seed": 3}
    assert manifest["columns"] == list(PRETRAINING_COLUMNS)

    tokenizer = bert_data.load_bert_tokenizer(pretraining_dir / "tokenizer.model")
    rule = SplitRule(0.1, 3)
    splits = {"train": [d for i, d in enumerate(documents[:150]) if not rule.heldout(i)],
              "heldout": [d for i, d in enumerate(documents[:150]) if rule.heldout(i)]}
    for split, split_docs in splits.items():
        summary = manifest["splits"][split]
        assert summary["documents"] == len(split_docs)
        expected = bert_data.create_pretraining_examples(
            bert_data.tokenize_documents(split_docs, tokenizer), vocab_size=VOCAB, seq_length=48,
            max_predictions_per_seq=BUILD_PREDICTIONS, dupe_factor=2 if split == "train" else 1,
            seed=f"{split}:3:0")
        count = len(expected["input_ids"])
        [name] = summary["files"]
        assert summary["examples"] == count == count_samples(pretraining_dir / name)
        assert summary["random_next"] == expected["next_sentence_label"].sum()
        dataset = create_dataset(pretraining_dir / name, PRETRAINING_COLUMNS,
                                 batch_size=1, shuffle=False, repeat=False)
        batches = list(dataset.create_tuple_iterator(output_numpy=True, num_epochs=1))
        assert len(batches) == count
        for index, name in enumerate(PRETRAINING_COLUMNS):
            read = np.concatenate([batch[index] for batch in batches])
            assert read.dtype == expected[name].dtype
            np.testing.assert_array_equal(read, expected[name])

    batch = next(create_dataset(pretraining_dir / "train.mindrecord", PRETRAINING_COLUMNS,
                                batch_size=4).create_tuple_iterator(output_numpy=True))
    assert [column.shape for column in batch] == (
        [(4, 48)] * 3 + [(4, BUILD_PREDICTIONS)] * 3 + [(4,)])
    assert bert_data.pretraining_dataset_ready(pretraining_dir, VOCAB, 48, BUILD_PREDICTIONS)


def test_pretraining_dataset_ready_rejects_mismatches(pretraining_dir, classification_dir,
                                                      tmp_path):
    assert not bert_data.pretraining_dataset_ready(tmp_path / "none", VOCAB, 48, BUILD_PREDICTIONS)
    with pytest.raises(DataError, match="built with vocab_size=300, seq_length=48, "
                                        "max_predictions_per_seq=6, but .*seq_length=64"):
        bert_data.pretraining_dataset_ready(pretraining_dir, VOCAB, 64, BUILD_PREDICTIONS)
    with pytest.raises(DataError, match="max_predictions_per_seq=20 is asked for"):
        bert_data.pretraining_dataset_ready(pretraining_dir, VOCAB, 48, 20)
    with pytest.raises(DataError, match="holds a BERT classification dataset"):
        bert_data.pretraining_dataset_ready(classification_dir, VOCAB, 32, BUILD_PREDICTIONS)
    other_model = tmp_path / "gpt2"
    other_model.mkdir()
    (other_model / "dataset.json").write_text(json.dumps({"vocab_size": VOCAB, "seq_length": 48}))
    with pytest.raises(DataError, match="another model's dataset"):
        bert_data.pretraining_dataset_ready(other_model, VOCAB, 48, BUILD_PREDICTIONS)
    with pytest.raises(DataError, match="already holds a dataset"):
        bert_data.build_pretraining_dataset(pretraining_dir, ["A. B."] * 4, vocab_size=VOCAB,
                                            seq_length=48)
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    manifest = json.loads((pretraining_dir / "dataset.json").read_text())
    (incomplete / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="tokenizer.model: missing"):
        bert_data.pretraining_dataset_ready(incomplete, VOCAB, 48, BUILD_PREDICTIONS)


def test_pretraining_rejects_too_little_text_and_bad_sizes(documents, documents_ids, tmp_path):
    # every document one sentence: no pair can be made
    one_sentence = [" ".join(document.replace(".", ",").replace("?", ",").replace("!", ",")
                             .split()) for document in documents[:60]]
    with pytest.raises(DataError, match="train split has 5[0-9] documents and no sentence pair"):
        bert_data.build_pretraining_dataset(
            tmp_path / "a", [write_jsonl(tmp_path / "a.jsonl", one_sentence)],
            vocab_size=VOCAB, seq_length=48)
    assert not (tmp_path / "a" / "dataset.json").exists()
    with pytest.raises(DataError, match="too small for vocab_size=300"):
        bert_data.build_pretraining_dataset(
            tmp_path / "b", [write_jsonl(tmp_path / "b.jsonl", ["One. Two.", "Three. Four."])],
            vocab_size=VOCAB, seq_length=48)
    with pytest.raises(DataError, match="at least 2 documents"):
        bert_data.build_pretraining_dataset(
            tmp_path / "c", [write_jsonl(tmp_path / "c.jsonl", documents[:1])],
            vocab_size=VOCAB, seq_length=48)
    sizes = {"vocab_size": VOCAB, "seq_length": 32}
    for bad, message in (({"max_predictions_per_seq": 30}, "more than the seq_length - 3"),
                         ({"masked_lm_prob": 0.0}, "masked_lm_prob"),
                         ({"dupe_factor": 0}, "dupe_factor must be an integer >= 1"),
                         ({"seq_length": 4}, "seq_length must be an integer >= 5"),
                         ({"whole_word_mask": True}, "needs word_starts")):
        with pytest.raises(DataError, match=message):
            bert_data.create_pretraining_examples(documents_ids, **{**sizes, **bad})
    with pytest.raises(DataError, match="at least 2 non-empty documents"):
        bert_data.create_pretraining_examples(documents_ids[:1], **sizes)


# ----------------------------------------------------------------------------- classification

def test_topic_split_keeps_modules_apart_and_is_deterministic(topic_examples, topic_split):
    train, dev, dropped = topic_split
    assert len(train) + len(dev) > 3000 and len(dev) > 500
    assert not {example.unit for example in train} & {example.unit for example in dev}
    assert not {example.path for example in train} & {example.path for example in dev}
    assert not {example.text for example in train} & {example.text for example in dev}
    assert len(dropped) < 0.1 * len(dev)
    for label in range(len(CLASSIFICATION_LABELS)):
        train_count = sum(example.label == label for example in train)
        dev_count = sum(example.label == label for example in dev)
        assert train_count > 300 and 0.1 < dev_count / (train_count + dev_count) < 0.4
    assert bert_classification.split_topic_examples(list(topic_examples), seed=1) == topic_split
    assert bert_classification.split_topic_examples(topic_examples, seed=2)[1] != dev


def test_classification_dataset(classification_dir, pretraining_dir, topic_split):
    manifest = json.loads((classification_dir / "dataset.json").read_text())
    assert sorted(path.name for path in classification_dir.iterdir()) == [
        "dataset.json", "dev.mindrecord", "dev.mindrecord.db", "tokenizer.model",
        "train.mindrecord", "train.mindrecord.db"]
    assert (classification_dir / "tokenizer.model").read_bytes() == (
        pretraining_dir / "tokenizer.model").read_bytes()
    assert manifest["labels"] == list(CLASSIFICATION_LABELS)
    assert manifest["columns"] == list(CLASSIFICATION_COLUMNS)
    train, dev, dropped = topic_split
    assert manifest["near_duplicates_dropped_from_dev"] == len(dropped)
    tokenizer = bert_data.load_bert_tokenizer(pretraining_dir / "tokenizer.model")
    for split, examples in (("train", train), ("dev", dev)):
        summary = manifest["splits"][split]
        assert summary["examples"] == len(examples) == count_samples(
            classification_dir / summary["file"])
        assert summary["per_class"] == {name: sum(example.label == label for example in examples)
                                        for label, name in enumerate(CLASSIFICATION_LABELS)}
        assert summary["units"] == sorted({example.unit for example in examples})
        dataset = create_dataset(classification_dir / summary["file"], CLASSIFICATION_COLUMNS,
                                 batch_size=1, shuffle=False, repeat=False)
        read = [tuple(column.reshape(-1).tolist() for column in batch)
                for batch in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]
        encode = bert_classification.encode_classification_example
        expected = [(*encode(tokenizer, example.text, 32), [example.label])
                    for example in examples]
        if split == "dev":
            assert read == expected  # dev keeps source order
        else:
            assert sorted(read) == sorted(expected) and read != expected  # train is shuffled
        for input_ids, token_type_ids, attention_mask, _ in read[:50]:
            length = sum(attention_mask)
            assert input_ids[0] == CLS_ID and input_ids[length - 1] == SEP_ID
            assert attention_mask == [1] * length + [0] * (32 - length)
            assert not any(token_type_ids) and not any(input_ids[length:])
    dev_counts = manifest["splits"]["dev"]["per_class"]
    train_counts = manifest["splits"]["train"]["per_class"]
    baseline = manifest["majority_baseline"]
    assert baseline["label"] == max(train_counts, key=train_counts.get)
    assert baseline["dev_accuracy"] == round(dev_counts[baseline["label"]] / len(dev), 4) < 0.5
    assert bert_classification.classification_dataset_ready(classification_dir, VOCAB, 32,
                                                  tokenizer_path=pretraining_dir /
                                                  "tokenizer.model")
    with pytest.raises(DataError, match="built with vocab_size=300, seq_length=32"):
        bert_classification.classification_dataset_ready(classification_dir, VOCAB, 64)
    with pytest.raises(DataError, match="holds a BERT pretraining dataset"):
        bert_classification.classification_dataset_ready(pretraining_dir, VOCAB, 48)


def test_classification_rejects_other_tokenizers(classification_dir, tmp_path):
    other = train_tokenizer(["Some text. More text here."] * 20, tmp_path / "other.model", 40)
    with pytest.raises(DataError, match="not a BERT tokenizer"):
        bert_classification.build_classification_dataset(tmp_path / "out", other.model_path,
                                                         seq_length=32)
    with pytest.raises(DataError, match="tokenizer model not found"):
        bert_classification.build_classification_dataset(
            tmp_path / "out", tmp_path / "missing.model", seq_length=32)
    assert not (tmp_path / "out").exists()
    other_bert = bert_data.train_bert_tokenizer(["Some text. More text here."] * 20,
                                                tmp_path / "bert.model", VOCAB // 10)
    with pytest.raises(DataError, match="built with another tokenizer"):
        bert_classification.classification_dataset_ready(classification_dir, VOCAB, 32,
                                               tokenizer_path=other_bert.model_path)


# ----------------------------------------------------------------------------- command

def test_data_command(documents, pretraining_dir, tmp_path, capsys):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(documents[:80]), encoding="utf-8")
    parser = argparse.ArgumentParser()
    bert_command.add_data_arguments(parser)
    args = parser.parse_args(["--input", str(text_file), "--output-dir", str(tmp_path / "pre"),
                              "--vocab-size", str(VOCAB), "--seq-length", "32",
                              "--max-predictions-per-seq", "5", "--whole-word-mask",
                              "--dupe-factor", "1", "--heldout-fraction", "0.2"])
    bert_command.run_data_command(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("scanned") and "bert data: 100%" in lines[-2]
    summary = lines[-1]
    assert summary.startswith("bert dataset:") and "train" in summary and "pre" in summary
    assert bert_data.pretraining_dataset_ready(tmp_path / "pre", VOCAB, 32, 5)
    manifest = json.loads((tmp_path / "pre" / "dataset.json").read_text())
    assert manifest["whole_word_mask"] is True and manifest["dupe_factor"] == 1

    with pytest.raises(UserInputError, match="--task classify needs --tokenizer"):
        bert_command.run_data_command(parser.parse_args(
            ["--task", "classify", "--output-dir", str(tmp_path / "cls"), "--seq-length", "32"]))
    with pytest.raises(UserInputError, match="needs --input and --vocab-size"):
        bert_command.run_data_command(parser.parse_args(
            ["--output-dir", str(tmp_path / "x"), "--seq-length", "32"]))
    with pytest.raises(DataError, match="builtin:nope: unknown built-in corpus"):
        load_documents(["builtin:nope"])

    bert_command.run_data_command(parser.parse_args(
        ["--task", "classify", "--tokenizer", str(pretraining_dir / "tokenizer.model"),
         "--output-dir", str(tmp_path / "cls"), "--seq-length", "24"]))
    summary = capsys.readouterr().out.strip()
    assert len(summary.splitlines()) == 1 and "majority baseline" in summary
    assert bert_classification.classification_dataset_ready(tmp_path / "cls", VOCAB, 24)
