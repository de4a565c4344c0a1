"""The streaming GPT-2 build: pieces, workers, resuming, and the document-level split."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import run_cli
from model_zoo.data import count_samples, create_dataset, read_mindrecord
from model_zoo.data.corpus import input_entries
from model_zoo.data.streaming import (PLAN_FILE, SplitRule, heldout_draw, plan_pieces,
                                      piece_documents, scan_corpus)
from model_zoo.errors import DataError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
BUILD = ["--vocab-size", "64", "--seq-length", "16", "--shard-size", "0.02"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 120 KB of text in 600 documents, in two files."""
    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("corpus")
    for name in ("a.txt", "b.txt"):
        documents = [" ".join(rng.choice(WORDS, rng.integers(5, 60))) + "."
                     for _ in range(300)]
        (folder / name).write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return folder


def build(corpus, output_dir, *extra):
    result = run_cli("data", "gpt2", "--input", corpus, "--output-dir", output_dir, *BUILD, *extra)
    assert result.returncode == 0, result.stderr
    return json.loads((output_dir / "dataset.json").read_text())


@pytest.fixture(scope="module")
def one_worker(corpus, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("built") / "one"
    return output_dir, build(corpus, output_dir, "--workers", "1")


def test_one_and_two_workers_write_the_same_files(corpus, one_worker, tmp_path):
    output_dir, manifest = one_worker
    assert manifest == build(corpus, tmp_path / "two", "--workers", "2")
    assert manifest["build"]["pieces"] >= 4
    train = manifest["splits"]["train"]
    assert len(train["files"]) == manifest["build"]["pieces"]
    assert train["files"][1] == f"train-00001-of-{manifest['build']['pieces']:05d}.mindrecord"
    assert not [name for name in os.listdir(output_dir) if name.startswith(".")]
    # the files read as one dataset, split over ranks
    paths = [str(output_dir / name) for name in train["files"]]
    assert count_samples(paths) == train["samples"]
    shards = [sum(len(ids) for (ids,) in create_dataset(
        paths, ["input_ids"], 4, num_shards=2, shard_id=rank, shuffle=False, repeat=False,
        drop_remainder=False).create_tuple_iterator(output_numpy=True)) for rank in (0, 1)]
    assert shards == [-(-train["samples"] // 2)] * 2   # MindSpore pads the shards to equal


def test_bert_builds_the_same_pieces_with_one_and_two_workers(tmp_path):
    rng = np.random.default_rng(1)
    sentences = [" ".join(rng.choice(WORDS, rng.integers(4, 12))).capitalize() + "."
                 for _ in range(900)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(sentences[i:i + 3]) for i in range(0, 900, 3)),
                      encoding="utf-8")
    manifests = []
    for workers in ("1", "2"):
        result = run_cli("data", "bert", "--input", corpus, "--output-dir", tmp_path / workers,
                         "--vocab-size", "64", "--seq-length", "32", "--shard-size", "0.01",
                         "--max-predictions-per-seq", "5", "--workers", workers)
        assert result.returncode == 0, result.stderr
        manifests.append(json.loads((tmp_path / workers / "dataset.json").read_text()))
    assert manifests[0] == manifests[1]
    train = manifests[0]["splits"]["train"]
    assert len(train["files"]) == manifests[0]["build"]["pieces"] >= 3
    assert count_samples([tmp_path / "1" / name for name in train["files"]]) == train["examples"]


def test_pieces_hold_every_document_once_in_its_split(corpus, one_worker):
    output_dir, manifest = one_worker
    entries = input_entries([str(corpus)])
    plan = scan_corpus(entries, "text", heldout_fraction=0.05, seed=1, piece_bytes=20_000)
    rule = SplitRule(**plan["rule"])
    seen = [index for piece in plan_pieces(plan)
            for index, *_ in piece_documents(entries, "text", rule, piece)]
    assert seen == list(range(600)) == list(range(plan["documents"]))
    heldout = sum(rule.heldout(index) for index in seen)
    assert heldout == manifest["splits"]["heldout"]["documents"] and 10 <= heldout <= 50
    # tokens: every document's ids and its eos, packed or dropped at a piece's end
    for split in ("train", "heldout"):
        summary = manifest["splits"][split]
        assert summary["tokens"] == summary["samples"] * 17 + summary["dropped_tokens"]


def test_the_split_follows_the_seed_and_keeps_one_document_in_each_split(tmp_path):
    draws = [heldout_draw(1, index) for index in range(10_000)]
    assert 0.045 < np.mean(np.array(draws) < 0.05) < 0.055
    assert draws[:5] != [heldout_draw(2, index) for index in range(5)]
    path = tmp_path / "two.txt"
    path.write_text("first\n\nsecond\n", encoding="utf-8")
    plan = scan_corpus(input_entries([path]), "text", heldout_fraction=0.05, seed=1,
                       piece_bytes=1 << 20)
    rule = SplitRule(**plan["rule"])
    assert sorted(rule.heldout(index) for index in range(2)) == [False, True]
    with pytest.raises(DataError, match="need at least 2 documents"):
        path.write_text("only one\n", encoding="utf-8")
        scan_corpus(input_entries([path]), "text", heldout_fraction=0.05, seed=1,
                    piece_bytes=1 << 20)


def test_num_files_cuts_the_corpus_in_about_that_many_pieces(corpus, tmp_path):
    plan = scan_corpus(input_entries([str(corpus)]), "text", heldout_fraction=0.05, seed=1,
                       num_files=3)
    assert len(plan["pieces"]) == 3
    sizes = [piece["bytes"] for piece in plan["pieces"]]
    assert max(sizes) < 1.1 * min(sizes)


def test_a_killed_build_leaves_no_process_and_resumes_from_its_finished_pieces(
        corpus, one_worker, tmp_path):
    """SIGKILL of the build's own process (two workers): its workers and multiprocessing's
    resource tracker end with it, and the next build keeps the finished pieces."""
    reference_dir, reference = one_worker
    output_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "model_zoo", "data", "gpt2", "--input", str(corpus),
               "--output-dir", str(output_dir), *BUILD, "--workers", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.monotonic() + 120
    while not (output_dir / ".piece-00001.json").exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.kill()   # the build's process only, as the OOM killer or `kill -9 PID` does
    process.wait()
    deadline = time.monotonic() + 10
    while True:   # the rest of its session (workers, resource tracker) follows it
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError("processes of the killed build are still running")
        time.sleep(0.05)
    # the files of the pieces finished when it died (piece 1's at least: with two workers
    # piece 0 may still have been writing)
    records = [json.loads(path.read_text()) for path in output_dir.glob(".piece-*.json")]
    finished = {name: (output_dir / name).stat().st_mtime_ns
                for record in records for name in record["files"]}
    assert any(name.startswith("train-") for name in finished), finished
    assert (output_dir / PLAN_FILE).exists() and not (output_dir / "dataset.json").exists()

    result = run_cli("data", "gpt2", "--input", corpus, "--output-dir", output_dir, *BUILD,
                     "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "resuming the unfinished build" in result.stdout
    assert json.loads((output_dir / "dataset.json").read_text()) == reference
    for name, changed in finished.items():   # kept, not rebuilt
        assert (output_dir / name).stat().st_mtime_ns == changed
    first = read_mindrecord(output_dir / reference["splits"]["train"]["files"][2])
    again = read_mindrecord(reference_dir / reference["splits"]["train"]["files"][2])
    assert [row["input_ids"].tolist() for row in first] == \
        [row["input_ids"].tolist() for row in again]


def test_other_settings_replace_an_unfinished_build(corpus, tmp_path):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / PLAN_FILE).write_text(json.dumps({"settings": {"seed": 99}}))
    (output_dir / "train-00007-of-00009.mindrecord").write_bytes(b"stale")
    result = run_cli("data", "gpt2", "--input", corpus, "--output-dir", output_dir,
                     "--vocab-size", "64", "--seq-length", "16", "--num-files", "2")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((output_dir / "dataset.json").read_text())
    assert "train-00007-of-00009.mindrecord" not in manifest["files"]
    assert not (output_dir / "train-00007-of-00009.mindrecord").exists()
    assert manifest["build"]["pieces"] == 2


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "also fine"}\n{broken\n',
     "bad.jsonl line 3: not JSON"),
    ("latin.txt", b"fine\n\nstill fine\ncaf\xe9\n", "latin.txt line 4: not UTF-8"),
    ("empty.txt", b"\n  \n", "empty.txt: holds no text"),
])
def test_bad_input_gives_one_error_line_naming_the_file_and_line(tmp_path, name, content,
                                                                   message):
    (tmp_path / name).write_bytes(content)
    result = run_cli("data", "gpt2", "--input", tmp_path / name, "--output-dir",
                     tmp_path / "out", "--vocab-size", "64", "--seq-length", "16")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "out" / "dataset.json").exists()
