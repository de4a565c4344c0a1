"""Data pipeline: corpus, tokenizer, packing, MindRecord round trip, sharding, resuming, errors."""

import argparse
import json
import string

import numpy as np
import pytest

from model_zoo.data import (
    Tokenizer,
    count_samples,
    create_dataset,
    pack_token_stream,
    python_docstrings_corpus,
    read_text_documents,
    train_tokenizer,
    write_mindrecord,
)
from model_zoo.errors import DataError
from model_zoo.causal_lm import data as lm_data

from conftest import write_jsonl
from model_zoo.data.streaming import BuildOptions

SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}}
SAMPLE_COUNT = 20


@pytest.fixture(scope="module")
def docstrings():
    return python_docstrings_corpus()


@pytest.fixture(scope="module")
def small_corpus(docstrings):
    return docstrings[:150]


@pytest.fixture(scope="module")
def tokenizer(small_corpus, tmp_path_factory):
    return train_tokenizer(small_corpus, tmp_path_factory.mktemp("tok") / "tokenizer.model", 300)


@pytest.fixture(scope="module")
def numbered_records(tmp_path_factory):
    """A MindRecord file whose sample i is [i, i, i], so samples are easy to identify."""
    path = tmp_path_factory.mktemp("records") / "numbered.mindrecord"
    rows = [{"input_ids": np.full(3, i, dtype=np.int32)} for i in range(SAMPLE_COUNT)]
    write_mindrecord(path, SCHEMA, rows, description="numbered samples")
    return path


def take_batches(dataset, count=None):
    """The first `count` batches of `input_ids` as lists of sample numbers (all if None)."""
    batches = []
    for (input_ids,) in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
        batches.append(input_ids[:, 0].tolist())
        if len(batches) == count:
            break
    return batches


def test_docstring_corpus_is_deterministic_english_text(docstrings):
    long_ones = python_docstrings_corpus(min_chars=1000)
    assert long_ones == [document for document in docstrings if len(document) >= 1000]
    assert 0 < len(long_ones) < len(docstrings)
    text = "".join(docstrings)
    assert len(docstrings) > 100 and len(text) > 100_000
    assert all(len(document) >= 200 for document in docstrings)
    visible = [char for char in text if not char.isspace()]
    letters = sum(char in string.ascii_letters for char in visible)
    assert letters / len(visible) > 0.7


def test_read_text_documents_splits_on_blank_lines(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("First document,\n  second line.\n\n \n\nSecond document.\n\n",
                    encoding="utf-8")
    assert read_text_documents([path]) == ["First document,\n  second line.", "Second document."]


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    (b"caf\xe9 latin-1", "not UTF-8"),
    (b"\n  \n\n", "no text"),
])
def test_read_text_documents_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        read_text_documents([path])
    assert str(path) in str(error.value)


def test_read_text_documents_rejects_a_folder_without_text(tmp_path):
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match="a folder without text files"):
        read_text_documents([tmp_path])


DOCUMENTS = ["First document,\n  second line.", "Zweites Dokument: café ☕", "Third."]


def write_inputs(folder):
    """The same documents as plain text, JSON lines, and both gzipped."""
    import gzip
    import json
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(DOCUMENTS) + "\n"
    lines = "".join(json.dumps({"id": i, "body": d}) + "\n\n" for i, d in enumerate(DOCUMENTS))
    (folder / "plain.txt").write_text(text, encoding="utf-8")
    (folder / "lines.jsonl").write_text(lines, encoding="utf-8")
    (folder / "plain.txt.gz").write_bytes(gzip.compress(text.encode()))
    (folder / "lines.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    return folder


@pytest.mark.parametrize("name", ["plain.txt", "lines.jsonl", "plain.txt.gz", "lines.jsonl.gz"])
def test_every_input_format_gives_the_same_documents(tmp_path, name):
    folder = write_inputs(tmp_path / "inputs")
    assert read_text_documents([folder / name], json_key="body") == DOCUMENTS


def test_folders_and_globs_read_their_files_in_sorted_order(tmp_path):
    folder = write_inputs(tmp_path / "inputs")
    everything = read_text_documents([folder], json_key="body")
    assert everything == DOCUMENTS * 4       # lines.jsonl(.gz), then plain.txt(.gz)
    assert read_text_documents([str(folder / "*.jsonl*")], json_key="body") == DOCUMENTS * 2
    with pytest.raises(DataError, match="no file matches"):
        read_text_documents([str(folder / "*.csv")])


def test_json_strings_may_hold_unicode_line_separators(tmp_path):
    import json
    path = tmp_path / "lines.jsonl"
    text = "one\u2028two\u0085three"
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n" +
                    json.dumps({"text": "next"}) + "\r\n", encoding="utf-8")
    assert read_text_documents([path]) == [text, "next"]


def test_a_file_named_like_a_glob_is_read_as_itself(tmp_path):
    path = tmp_path / "data[1].txt"
    path.write_text("Some text.", encoding="utf-8")
    assert read_text_documents([path]) == ["Some text."]


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": oops}\n', "bad.jsonl line 2: not JSON"),
    ("bad.jsonl", b'{"text": "fine"}\n\n["a list"]\n', "bad.jsonl line 3: no 'text' field"),
    ("bad.jsonl", b'{"text": 7}\n', "bad.jsonl line 1: 'text' is a int, not text"),
    ("bad.txt", b"fine\nstill fine\ncaf\xe9\n", "bad.txt line 3: not UTF-8"),
    ("bad.txt.gz", b"not gzip at all", "bad.txt.gz: cannot be read"),
    ("empty.jsonl", b"\n\n", "empty.jsonl: holds no text"),
])
def test_bad_inputs_name_the_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_text_documents([tmp_path / name])


def test_tokenizer_round_trip_and_exact_vocab_size(tokenizer, small_corpus):
    assert tokenizer.vocab_size == 300
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert tokenizer.id_to_piece(tokenizer.eos_id) == "</s>"
    for text in [small_corpus[0], "Return the number of items.\n\n    Indented  line, two spaces."]:
        ids = tokenizer.encode(text)
        assert tokenizer.unk_id not in ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.array(tokenizer.encode("a list"), dtype=np.int32)) == "a list"


def test_tokenizer_training_is_deterministic(small_corpus, tmp_path):
    first = train_tokenizer(small_corpus, tmp_path / "a" / "tokenizer.model", 300)
    second = train_tokenizer(small_corpus, tmp_path / "b" / "tokenizer.model", 300)
    assert first.model_path.read_bytes() == second.model_path.read_bytes()
    assert first.encode(small_corpus[1]) == second.encode(small_corpus[1])
    assert Tokenizer(first.model_path).encode(small_corpus[1]) == first.encode(small_corpus[1])
    assert sorted(path.name for path in tmp_path.glob("*/*")) == ["tokenizer.model"] * 2


def test_tokenizer_rejects_too_small_corpus(tmp_path):
    with pytest.raises(DataError, match="too small for vocab_size=300.*smaller vocab_size"):
        train_tokenizer(["hello world"] * 3, tmp_path / "tokenizer.model", 300)
    assert not (tmp_path / "tokenizer.model").exists()


def test_tokenizer_rejects_missing_or_corrupt_model(tmp_path):
    with pytest.raises(DataError, match="not found"):
        Tokenizer(tmp_path / "missing.model")
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a readable SentencePiece model"):
        Tokenizer(corrupt)


def test_pack_token_stream_separates_documents_and_drops_tail():
    samples = pack_token_stream([[5, 6, 7], [8], [9, 10, 11, 12]], length=4, eos_id=3)
    # stream: 5 6 7 3 | 8 3 9 10 | 11 12 3 (tail, dropped)
    assert samples.dtype == np.int32
    assert samples.tolist() == [[5, 6, 7, 3], [8, 3, 9, 10]]
    assert pack_token_stream([[5]], length=4, eos_id=3).shape == (0, 4)


def test_text_to_mindrecord_round_trip(tokenizer, small_corpus, tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(small_corpus[:10]), encoding="utf-8")
    documents = read_text_documents([text_file])
    samples = pack_token_stream([tokenizer.encode(doc) for doc in documents], 33, tokenizer.eos_id)
    path = tmp_path / "train.mindrecord"
    write_mindrecord(path, SCHEMA, ({"input_ids": row} for row in samples), description="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "corpus.txt", "train.mindrecord", "train.mindrecord.db"]
    assert count_samples(path) == len(samples)
    dataset = create_dataset(path, ["input_ids"], batch_size=1, shuffle=False, repeat=False)
    rows = [batch[0] for batch in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]
    np.testing.assert_array_equal(np.concatenate(rows), samples)


def test_shuffle_is_seeded_and_differs_per_epoch(numbered_records):
    batches_per_epoch = SAMPLE_COUNT // 4
    first = take_batches(create_dataset(numbered_records, ["input_ids"], 4, seed=7),
                         2 * batches_per_epoch)
    again = take_batches(create_dataset(numbered_records, ["input_ids"], 4, seed=7),
                         2 * batches_per_epoch)
    other_seed = take_batches(create_dataset(numbered_records, ["input_ids"], 4, seed=8),
                              2 * batches_per_epoch)
    assert first == again
    assert first != other_seed
    epoch_1, epoch_2 = first[:batches_per_epoch], first[batches_per_epoch:]
    assert epoch_1 != epoch_2
    assert sorted(sum(epoch_1, [])) == sorted(sum(epoch_2, [])) == list(range(SAMPLE_COUNT))


def test_shards_are_disjoint_and_cover_the_data(numbered_records):
    shards = [sum(take_batches(create_dataset(numbered_records, ["input_ids"], 1, num_shards=2,
                                              shard_id=shard_id, shuffle=False, repeat=False)), [])
              for shard_id in range(2)]
    assert len(shards[0]) == len(shards[1]) == SAMPLE_COUNT // 2
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(SAMPLE_COUNT))


@pytest.mark.parametrize("num_shards, shard_id", [(1, 0), (2, 1)])
def test_skip_batches_resumes_at_the_same_position(numbered_records, num_shards, shard_id):
    def batches(skip, count):
        dataset = create_dataset(numbered_records, ["input_ids"], 3, num_shards=num_shards,
                                 shard_id=shard_id, seed=5, skip_batches=skip)
        return take_batches(dataset, count)

    uninterrupted = batches(0, 16)
    assert batches(7, 9) == uninterrupted[7:]
    assert batches(2, 4) == uninterrupted[2:6]


def test_create_dataset_rejects_missing_file_and_too_few_samples(numbered_records, tmp_path):
    missing = tmp_path / "missing.mindrecord"
    with pytest.raises(DataError, match="missing.mindrecord: MindRecord file not found"):
        create_dataset(missing, ["input_ids"], 2)
    with pytest.raises(DataError, match="missing.mindrecord"):
        count_samples(missing)
    with pytest.raises(DataError, match="20 samples over 2 shard.* 10 per shard, fewer than one "
                                        "batch of 16"):
        create_dataset(numbered_records, ["input_ids"], 16, num_shards=2, shard_id=0)
    with pytest.raises(DataError, match="no column labels"):
        create_dataset(numbered_records, ["labels"], 2)


def test_write_mindrecord_never_overwrites_silently(tmp_path):
    path = tmp_path / "data.mindrecord"
    rows = [{"input_ids": np.arange(4, dtype=np.int32)}]
    write_mindrecord(path, SCHEMA, rows, description="first")
    with pytest.raises(DataError, match="data.mindrecord already exists"):
        write_mindrecord(path, SCHEMA, rows, description="second")
    write_mindrecord(path, SCHEMA, rows * 3, description="third", overwrite=True)
    assert count_samples(path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.mindrecord", "data.mindrecord.db"]


def test_write_mindrecord_rejects_rows_that_do_not_match_the_schema(tmp_path):
    path = tmp_path / "data.mindrecord"
    good = {"input_ids": np.arange(4, dtype=np.int32)}
    wrong_type = {"input_ids": np.arange(4, dtype=np.int64)}
    with pytest.raises(DataError, match="1 of 2 rows match the schema"):
        write_mindrecord(path, SCHEMA, [good, wrong_type], description="mixed")
    with pytest.raises(DataError, match="schema"):
        write_mindrecord(path, SCHEMA, [wrong_type], description="wrong")
    assert list(tmp_path.iterdir()) == []


def test_gpt2_build_dataset(small_corpus, tmp_path):
    output_dir = tmp_path / "gpt2"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", small_corpus)
    manifest = lm_data.build_dataset(output_dir, [corpus], vocab_size=300, seq_length=32,
                                       options=BuildOptions(heldout_fraction=0.1),
                                       source="test")
    assert json.loads((output_dir / "dataset.json").read_text()) == manifest
    assert sorted(p.name for p in output_dir.iterdir()) == [
        "dataset.json", "heldout.mindrecord", "heldout.mindrecord.db", "tokenizer.model",
        "train.mindrecord", "train.mindrecord.db"]
    splits = manifest["splits"]
    assert splits["train"]["documents"] + splits["heldout"]["documents"] == len(small_corpus)
    for split in ("train", "heldout"):
        assert splits[split]["samples"] == splits[split]["tokens"] // 33
        assert count_samples(output_dir / f"{split}.mindrecord") == splits[split]["samples"]
    assert Tokenizer(output_dir / "tokenizer.model").vocab_size == 300

    assert lm_data.lm_dataset_ready(output_dir, 300, 32)
    assert not lm_data.lm_dataset_ready(tmp_path / "empty", 300, 32)
    with pytest.raises(DataError, match="built with vocab_size=300, seq_length=32"):
        lm_data.lm_dataset_ready(output_dir, 300, 64)
    with pytest.raises(DataError, match="already holds a dataset"):
        lm_data.build_dataset(output_dir, [corpus], vocab_size=300, seq_length=32)


def test_the_manifest_records_each_file_and_the_sources(small_corpus, tmp_path, monkeypatch):
    import hashlib
    from model_zoo.data.manifest import check_sources, verify_dataset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    write_jsonl(tmp_path / "texts" / "a.jsonl", small_corpus)
    output_dir = tmp_path / "gpt2"
    manifest = lm_data.build_dataset(output_dir, ["./texts//a.jsonl"], vocab_size=300,
                                       seq_length=32,
                                       options=BuildOptions(heldout_fraction=0.1))
    assert manifest["sources"] == ["texts/a.jsonl"]
    for name in ("train.mindrecord", "train.mindrecord.db", "tokenizer.model"):
        content = (output_dir / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(content),
                                           "sha256": hashlib.sha256(content).hexdigest()}
    assert "dataset.json" not in manifest["files"]
    verify_dataset(output_dir, ["texts/a.jsonl"], checksums=True)
    check_sources(output_dir, manifest, ["texts/./a.jsonl"])
    with pytest.raises(DataError, match=r"was built from \['texts/a.jsonl'\]"):
        check_sources(output_dir, manifest, ["texts/b.txt"])
    with pytest.raises(DataError, match="no dataset in"):
        verify_dataset(tmp_path / "nothing")


def test_gpt2_build_rejects_split_without_a_sample(small_corpus, tmp_path):
    with pytest.raises(DataError, match="heldout split has .* tokens, fewer than seq_length \\+ 1"):
        lm_data.build_dataset(tmp_path, [write_jsonl(tmp_path / "c.jsonl", small_corpus[:20])],
                                vocab_size=300, seq_length=2000)
    assert not (tmp_path / "dataset.json").exists()


def test_gpt2_data_command(small_corpus, tmp_path, capsys):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(small_corpus[:60]), encoding="utf-8")
    parser = argparse.ArgumentParser()
    lm_data.add_data_arguments(parser)
    args = parser.parse_args(["--input", str(text_file), "--output-dir", str(tmp_path / "out"),
                              "--vocab-size", "300", "--seq-length", "16"])
    lm_data.run_data_command(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("scanned") and "causal LM data: 100%" in lines[-2]
    assert "documents/s" not in lines[-2] and "/s)" in lines[-2]   # the progress line's rates
    summary = lines[-1]
    assert summary.startswith("causal LM dataset:") and "train" in summary and "out" in summary
    assert lm_data.lm_dataset_ready(tmp_path / "out", 300, 16)


def test_data_gpt2_builds_the_same_dataset_from_jsonl_gz_as_from_text(tmp_path):
    """The CLI over a gzipped JSON-lines file and over the same text in plain files."""
    from conftest import run_cli
    from model_zoo.data import read_mindrecord
    import gzip
    import json
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    documents = [" ".join(rng.choice(words, 30)) + "." for _ in range(40)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(documents), encoding="utf-8")
    lines = tmp_path / "corpus.jsonl.gz"
    lines.write_bytes(gzip.compress("".join(json.dumps({"content": d}) + "\n"
                                            for d in documents).encode()))
    built = {}
    for name, inputs in (("text", [text]), ("jsonl", [lines, "--json-key", "content"])):
        result = run_cli("data", "gpt2", "--input", *inputs, "--output-dir", tmp_path / name,
                         "--vocab-size", "64", "--seq-length", "16")
        assert result.returncode == 0, result.stderr
        built[name] = [row["input_ids"].tolist()
                       for row in read_mindrecord(tmp_path / name / "train.mindrecord")]
    assert built["text"] == built["jsonl"] and built["text"]
    assert (tmp_path / "text" / "tokenizer.model").read_bytes() == \
        (tmp_path / "jsonl" / "tokenizer.model").read_bytes()

    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n{broken\n', encoding="utf-8")
    result = run_cli("data", "gpt2", "--input", tmp_path / "bad.jsonl", "--json-key", "content",
                     "--output-dir", tmp_path / "bad", "--vocab-size", "64", "--seq-length", "16")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.jsonl line 2: not JSON" in errors[0], result.stderr
