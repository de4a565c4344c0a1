"""Transformer data: catalog pairs, parallel files, leak-free split, bucketing, MindRecord round
trip, per-rank batches and resuming."""

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from model_zoo.data import (Tokenizer, bucket_boundaries, bucket_counts, global_batches,
                            read_manifest)
from model_zoo.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from conftest import write_pairs
from model_zoo.errors import DataError
from model_zoo.data.streaming import BuildOptions
from model_zoo.models.transformer import data as tdata
from model_zoo.models.transformer import pairs as tpairs

CATALOGS = Path(tpairs.CATALOG_ROOT, "de", "LC_MESSAGES")
needs_catalogs = pytest.mark.skipif(not any(CATALOGS.glob("*.mo")),
                                    reason=f"no German message catalogs in {CATALOGS}")
# printf placeholders, {fields}, options, paths and URLs
NOT_PROSE = r"%(\d+\$)?[-+#0-9.*lhqjzt]*[a-zA-Z%]|\{\S*\}|(?<!\S)--?\S+|(?<!\S)[/~]\S*|\S*://\S*"
VOCAB = 500
SEQ = 32
DEV = TEST = 150


@pytest.fixture(scope="module")
def catalog():
    stats = {}
    return tpairs.message_catalog_pairs(stats=stats), stats


@pytest.fixture(scope="module")
def small_pairs(catalog):
    """Every tenth catalog pair: a few thousand pairs from all catalogs."""
    return catalog[0][::10]


PIECES = 3


@pytest.fixture(scope="module")
def pairs_file(small_pairs, tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("transformer_pairs") / "pairs.tsv", small_pairs)


def build(directory, pairs_file, workers=1):
    """The test dataset: the catalog slice in PIECES pieces (each its own train file)."""
    return tdata.build_translation_dataset(
        directory, [str(pairs_file)], vocab_size=VOCAB, seq_length=SEQ, dev_size=DEV,
        test_size=TEST, seed=3, source="catalog slice", batch_size=32,
        options=BuildOptions(num_files=PIECES, workers=workers))


@pytest.fixture(scope="module")
def built(pairs_file, tmp_path_factory):
    directory = tmp_path_factory.mktemp("transformer_data") / "tiny"
    return directory, build(directory, pairs_file)


def batches(directory, split, batch_size, count=None, **options):
    """The batches of create_translation_dataset (with the index column) as numpy tuples."""
    dataset = tdata.create_translation_dataset(directory, split, batch_size, with_index=True,
                                               **options)
    found = []
    for batch in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
        found.append(batch)
        if len(found) == count:
            break
    return found


# --- message catalogs ------------------------------------------------------------------------

@needs_catalogs
def test_catalog_pairs_are_thousands_of_clean_phrases(catalog):
    pairs, stats = catalog
    assert len(pairs) > 10_000 and stats["kept"] == len(pairs)
    assert stats["files_read"] > 50
    assert len({english for english, _ in pairs}) == len(pairs)
    for english, german in pairs:
        for text in (english, german):
            assert text and text == " ".join(text.split())  # one line, normalised spaces
            assert "\x00" not in text and "\x04" not in text
        assert english.casefold() != german.casefold()
        assert not english.startswith(("Project-Id-Version", "Content-Type"))
        words = re.sub(NOT_PROSE, " ", english)
        assert len(re.findall(r"[^\W\d_]{2,}", words)) >= 2, english
        assert len(english.split()) <= tpairs.MAX_WORDS
    assert tpairs.message_catalog_pairs() == pairs  # deterministic


def write_mo(path, entries, charset="UTF-8", raw=()):
    """A GNU .mo file of {msgid: msgstr} (plus raw (msgid bytes, msgstr bytes) entries)."""
    header = (f"Content-Type: text/plain; charset={charset}\n"
              f"Plural-Forms: nplurals=2; plural=n != 1;\n")
    items = [(b"", header.encode())] + [(k.encode(), v.encode()) for k, v in entries.items()]
    items = sorted(items + list(raw))
    ids_start = 28 + 16 * len(items)
    blob, ids, strs = b"", [], []
    for key, _ in items:
        ids.append((len(key), ids_start + len(blob)))
        blob += key + b"\x00"
    for _, value in items:
        strs.append((len(value), ids_start + len(blob)))
        blob += value + b"\x00"
    table = b"".join(struct.pack("<2I", *entry) for entry in ids + strs)
    path.write_bytes(struct.pack("<7I", 0x950412DE, 0, len(items), 28, 28 + 8 * len(items), 0, 0)
                     + table + blob)


def test_catalog_filter_rules(tmp_path):
    messages = tmp_path / "xx" / "LC_MESSAGES"
    messages.mkdir(parents=True)
    write_mo(messages / "a.mo", {
        "Open the file": "Datei öffnen",
        "Save _As": "Speichern _unter",                       # mnemonics removed
        "max_connections is too large": "max_connections ist zu groß",  # identifier kept
        "cannot read\n  the file %s\n": "kann die Datei %s\nnicht lesen",  # joined
        "%s: %s (%d)": "%s: %s (%d)",                         # untranslated
        "%s -> %s": "%s -> %s [de]",                          # placeholders only
        "--force --all -x": "--force --alle -x",              # options only
        "/usr/share/locale": "/usr/teilen/locale",            # path
        "Germany": "Deutschland",                             # one word
        "word " * 70: "Wort " * 70,                           # too long
        "Same text": "Same text",                             # untranslated
        "ctx\x04Open file": "Datei öffnen",                   # context
    }, raw=[(b"one file\x00%d files", b"eine Datei\x00%d Dateien")])  # plural
    write_mo(messages / "b.mo", {"Open the file": "Die Datei öffnen",  # duplicate: a.mo wins
                                 "Close the window": "Fenster schließen"})
    write_mo(messages / "c.mo", {}, raw=[(b"Bad bytes here", b"ung\xfcltig")])  # not UTF-8
    (messages / "d.mo").write_bytes(b"not a catalog")
    stats = {}
    pairs = tpairs.message_catalog_pairs("xx", root=tmp_path, stats=stats)
    assert pairs == [("Open the file", "Datei öffnen"), ("Save As", "Speichern unter"),
                     ("cannot read the file %s", "kann die Datei %s nicht lesen"),
                     ("max_connections is too large", "max_connections ist zu groß"),
                     ("Close the window", "Fenster schließen")]
    assert stats["files_skipped"] == ["c.mo", "d.mo"] and stats["files_read"] == 2
    assert stats["header"] == 2 and stats["duplicate"] == 1 and stats["context"] == 1
    assert stats["plural"] == 2 and stats["untranslated"] == 2 and stats["too_long"] == 1
    assert stats["technical"] == 3 and stats["too_short"] == 1 and stats["kept"] == 5
    with pytest.raises(DataError, match="no message catalogs"):
        tpairs.message_catalog_pairs("zz", root=tmp_path)


# --- parallel files --------------------------------------------------------------------------

def test_read_parallel_files(tmp_path):
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_bytes(b"\xef\xbb\xbfHello  world\r\n\nGood morning\n")
    target.write_bytes("Hallo Welt\r\nLeer\nGuten Morgen\n".encode())
    stats = {}
    assert tpairs.read_parallel_files(source, target, stats=stats) == [
        ("Hello world", "Hallo Welt"), ("Good morning", "Guten Morgen")]
    assert stats == {"lines": 3, "blank": 1, "kept": 2}
    assert tpairs.load_pairs([f"{source}:{target}"]) == tpairs.read_parallel_files(source, target)

    target.write_text("Hallo Welt\nGuten Morgen\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{source} has 3 lines but {target} has 2"):
        tpairs.read_parallel_files(source, target)
    target.write_bytes(b"Hallo\nGr\xfc\xdfe\nMorgen\n")
    with pytest.raises(DataError, match=rf"{target} line 2: not UTF-8"):
        tpairs.read_parallel_files(source, target)
    with pytest.raises(DataError, match="missing.de: file not found"):
        tpairs.read_parallel_files(source, tmp_path / "missing.de")
    with pytest.raises(DataError, match="SOURCE_FILE:TARGET_FILE"):
        tpairs.load_pairs([str(source)])
    with pytest.raises(DataError, match="unknown built-in"):
        tpairs.load_pairs(["builtin:wmt14"])


def test_files_of_pairs_give_the_pairs_of_parallel_files(tmp_path):
    import gzip
    pairs = [("Hello world", "Hallo Welt"), ("Good  morning", "Guten Morgen"), ("x", " ")]
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_text("".join(f"{s}\n" for s, _ in pairs), encoding="utf-8")
    target.write_text("".join(f"{t}\n" for _, t in pairs), encoding="utf-8")
    expected = tpairs.read_parallel_files(source, target)
    tsv = "".join(f"{s}\t{t}\r\n" for s, t in pairs)
    lines = "".join(json.dumps({"translation": {"en": s, "de": t}}) + "\n" for s, t in pairs)
    flat = "".join(json.dumps({"de": t, "en": s, "id": 1}) + "\n" for s, t in pairs)
    (tmp_path / "p.tsv").write_text(tsv, encoding="utf-8")
    (tmp_path / "p.tsv.gz").write_bytes(gzip.compress(tsv.encode()))
    (tmp_path / "p.jsonl").write_text(lines, encoding="utf-8")
    (tmp_path / "flat.jsonl.gz").write_bytes(gzip.compress(flat.encode()))
    for name in ("p.tsv", "p.tsv.gz", "p.jsonl", "flat.jsonl.gz"):
        stats = {}
        assert tpairs.load_pairs([str(tmp_path / name)], stats=stats) == expected
        assert stats[str(tmp_path / name)] == {"lines": 3, "blank": 1, "kept": 2}
    assert tpairs.load_pairs([str(tmp_path / "p.jsonl")], languages=("de", "en")) == \
        [(t, " ".join(s.split())) for s, t in expected]

    (tmp_path / "bad.tsv").write_text("one\ttwo\nno tab here\n", encoding="utf-8")
    with pytest.raises(DataError, match="bad.tsv line 2: 1 tab-separated fields"):
        tpairs.load_pairs([str(tmp_path / "bad.tsv")])
    (tmp_path / "bad.jsonl").write_text('{"en": "a", "fr": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="bad.jsonl line 1: no 'en' and 'de' fields"):
        tpairs.load_pairs([str(tmp_path / "bad.jsonl")])


# --- split -----------------------------------------------------------------------------------

@needs_catalogs
def test_split_has_no_leakage_and_is_deterministic(catalog):
    pairs = catalog[0]
    splits = tdata.split_pairs(pairs, dev=1000, test=1000, seed=1)
    assert [len(splits["dev"]), len(splits["test"])] == [1000, 1000]
    assert sum(map(len, splits.values())) == len(pairs)
    keys = {name: {tdata.normalised_source(s) for s, _ in part} for name, part in splits.items()}
    assert not keys["train"] & keys["dev"] and not keys["train"] & keys["test"]
    assert not keys["dev"] & keys["test"]
    assert tdata.split_pairs(pairs, dev=1000, test=1000, seed=1) == splits
    assert tdata.split_pairs(pairs, dev=1000, test=1000, seed=2)["dev"] != splits["dev"]


def test_split_keeps_near_identical_sources_together():
    pairs = [(f"Sentence number {i}.", f"Satz {i}") for i in range(40)]
    pairs += [("Open file", "Datei öffnen"), ("open  FILE!", "Datei öffnen!"),
              ("Open file...", "Datei öffnen ...")]
    for seed in range(20):
        splits = tdata.split_pairs(pairs, dev=5, test=5, seed=seed)
        homes = [name for name, part in splits.items() for s, _ in part if "file" in s.lower()]
        assert len(set(homes)) == 1 and len(homes) == 3
        assert len(splits["dev"]) == 5 and len(splits["test"]) == 5
    with pytest.raises(DataError, match="still leave training pairs"):
        tdata.split_pairs(pairs, dev=30, test=13)


def full_sort_choice(keys, dev, test, seed):
    """The dev and test groups of sorting every group of `keys` by its draw (the reference)."""
    from collections import Counter
    from model_zoo.data.streaming import heldout_draw
    counts = Counter(keys)
    chosen, room = {"dev": [], "test": []}, {"dev": dev, "test": test}
    for key in sorted(counts, key=lambda k: heldout_draw(seed, k)):
        split = next((name for name in room if counts[key] <= room[name]), None)
        if split:
            chosen[split].append(key)
            room[split] -= counts[key]
        if not any(room.values()):
            break
    return {split: sorted(found) for split, found in chosen.items()}, counts


def held_out_choice(keys, dev, test, seed):
    groups = tdata.HeldOutGroups(dev, test, seed)
    most = 0
    for key in keys:
        groups.add(key)
        most = max(most, len(groups.groups))
    return groups.choose(), most


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_held_out_groups_keep_few_candidates_and_choose_as_a_full_sort(seed):
    """The scan's bounded selection equals sorting every group by its draw, with many
    groups too large for dev or test among them (boilerplate lines repeated thousands of
    times)."""
    rng = np.random.default_rng(seed)
    keys = [int(k) for k in rng.zipf(1.3, 20_000) % 5000]
    keys += [int(k) for k in rng.integers(10**6, 10**6 + 40, 8000)]   # 40 groups of ~200
    keys = [keys[i] for i in rng.permutation(len(keys))]
    chosen, most = held_out_choice(keys, 50, 30, seed)
    reference, counts = full_sort_choice(keys, 50, 30, seed)
    assert chosen == reference
    assert [sum(counts[k] for k in chosen[s]) for s in ("dev", "test")] == [50, 30]
    assert most <= tdata.CANDIDATE_FACTOR * 80 and len(counts) > 5 * most
    # a group larger than dev and test with the lowest draw does not crowd out the others
    assert held_out_choice([7] * 5 + list(range(100, 120)), 1, 0, seed)[0] == \
        full_sort_choice([7] * 5 + list(range(100, 120)), 1, 0, seed)[0]


# --- bucketing and the built dataset ---------------------------------------------------------

def test_bucket_boundaries_are_capped_at_seq_length():
    assert bucket_boundaries(128) == (8, 16, 24, 32, 48, 64, 96, 128)
    assert bucket_boundaries(40) == (8, 16, 24, 32, 40)
    assert bucket_boundaries(5) == (5,)


@needs_catalogs
def test_build_writes_the_dataset_and_reports_padding(built):
    directory, manifest = built
    names = {path.name for path in directory.iterdir()}
    assert {"tokenizer.model", "dataset.json", "dev.en", "dev.de", "test.en", "test.de"} <= names
    data_files = {f"train-{i:05d}-of-{PIECES:05d}.mindrecord" for i in range(PIECES)} | {
        "dev.mindrecord", "test.mindrecord"}
    assert data_files | {f"{name}.db" for name in data_files} <= names
    assert set(manifest["splits"]["train"]["files"]) < data_files
    assert json.loads((directory / "dataset.json").read_text()) == manifest
    assert manifest["buckets"] == [8, 16, 24, 32] and manifest["vocab_size"] == VOCAB
    assert Tokenizer(directory / "tokenizer.model").vocab_size == VOCAB
    splits = manifest["splits"]
    assert splits["dev"]["pairs"] == DEV and splits["test"]["pairs"] == TEST
    assert manifest["pairs"]["found"] == sum(part["pairs"] for part in splits.values())
    dropped = sum(part["dropped_too_long"] for part in splits.values())
    assert dropped > 0 and manifest["pairs"]["dropped_too_long"] == dropped
    assert manifest["pairs"]["kept"] == manifest["pairs"]["found"] - dropped
    padding = manifest["padding_ratio"]
    assert 0 < padding["bucketed"] < padding["full_length"] < 1
    assert tdata.translation_dataset_ready(directory, VOCAB, SEQ)
    assert not tdata.translation_dataset_ready(directory.parent / "none", VOCAB, SEQ)
    with pytest.raises(DataError, match="built with vocab_size=500, seq_length=32"):
        tdata.translation_dataset_ready(directory, VOCAB, 64)
    old = directory.parent / "old"   # a dataset.json of a build that did not count buckets
    old.mkdir()
    (old / "dataset.json").write_text(json.dumps(dict(manifest, splits={"train": {}})))
    with pytest.raises(DataError, match="earlier version of model-zoo"):
        tdata.translation_dataset_ready(old, VOCAB, SEQ)
    with pytest.raises(DataError, match="already holds a dataset"):
        tdata.build_translation_dataset(directory, ["builtin:locale-de"], vocab_size=VOCAB,
                                        seq_length=SEQ)


@needs_catalogs
def test_every_pair_lands_in_the_smallest_bucket_that_fits(built):
    directory, manifest = built
    boundaries = np.array(manifest["buckets"])
    examples = tdata.read_examples(directory, "train")
    real = padded = 0
    for source, target, bucket in zip(*examples[:3]):
        length = max(len(source), len(target) - 1)
        assert bucket == boundaries[boundaries >= length].min()
        real += len(source) + len(target) - 1
        padded += 2 * bucket
    assert len(examples.source_ids) == manifest["splits"]["train"]["kept"]
    assert manifest["splits"]["train"]["examples_per_bucket"] == {
        str(b): int(np.sum(examples.buckets == b)) for b in boundaries
        if np.any(examples.buckets == b)}
    assert manifest["padding_ratio"]["bucketed"] == round((padded - real) / padded, 4)


@needs_catalogs
def test_dev_split_round_trip(built):
    """Reading the dev split back gives exactly the tokenized dev.en / dev.de lines."""
    directory, manifest = built
    tokenizer = Tokenizer(directory / "tokenizer.model")
    sources = (directory / "dev.en").read_text(encoding="utf-8").splitlines()
    targets = (directory / "dev.de").read_text(encoding="utf-8").splitlines()
    assert len(sources) == len(targets) == manifest["splits"]["dev"]["kept"]
    found = {}
    for batch in batches(directory, "dev", 16, shuffle=False, repeat=False,
                         drop_remainder=False):
        source_ids, source_mask, decoder_ids, decoder_mask, label_ids, index = batch
        assert source_ids.shape == decoder_ids.shape == label_ids.shape == source_mask.shape
        assert source_ids.shape[1] in manifest["buckets"] and source_ids.dtype == np.int32
        for row, i in enumerate(index):
            source = source_ids[row][source_mask[row] == 1]
            assert np.all(source_ids[row][source_mask[row] == 0] == PAD_ID)
            decoder = decoder_ids[row][decoder_mask[row] == 1]
            labels = label_ids[row][decoder_mask[row] == 1]
            assert decoder[0] == BOS_ID and labels[-1] == EOS_ID
            assert np.array_equal(decoder[1:], labels[:-1])
            found[int(i)] = (source.tolist(), labels.tolist())
    assert sorted(found) == list(range(len(sources)))
    for i, (source, target) in enumerate(zip(sources, targets)):
        assert found[i] == (tokenizer.encode(source) + [EOS_ID],
                            tokenizer.encode(target) + [EOS_ID])
        if UNK_ID not in found[i][1]:  # a character never seen in training decodes to unk
            assert tokenizer.decode(found[i][1][:-1]) == target


@needs_catalogs
def test_two_workers_build_the_same_dataset_split_as_split_pairs(built, pairs_file,
                                                                 small_pairs, tmp_path):
    directory, manifest = built
    again = build(tmp_path / "two", pairs_file, workers=2)
    for found in (manifest, again):
        found["build"].pop("seconds")
    assert again == manifest   # the files' SHA-256 included
    for name in ("dev.en", "dev.de", "test.en", "test.de"):
        assert (tmp_path / "two" / name).read_bytes() == (directory / name).read_bytes()
    splits = tdata.split_pairs(small_pairs, DEV, TEST, seed=3)
    for split in ("dev", "test"):
        lines = (directory / f"{split}.en").read_text(encoding="utf-8").splitlines()
        in_order = [source for source, _ in splits[split]]
        assert lines == [source for source in in_order if source in set(lines)]
        assert manifest["splits"][split]["pairs"] == len(splits[split])


@needs_catalogs
def test_a_build_stopped_after_its_pieces_resumes_them(built, pairs_file, tmp_path,
                                                       monkeypatch, capsys):
    directory = tmp_path / "stopped"
    written = tdata._write_held_out

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tdata, "_write_held_out", fail)
    with pytest.raises(OSError, match="disk full"):
        build(directory, pairs_file)
    records = sorted(directory.glob(".piece-*.json"))
    assert len(records) == PIECES
    times = {path: path.stat().st_mtime_ns for path in directory.glob("train-*")}
    monkeypatch.setattr(tdata, "_write_held_out", written)
    capsys.readouterr()
    manifest = build(directory, pairs_file)
    assert "resuming the unfinished build" in capsys.readouterr().out
    assert times == {path: path.stat().st_mtime_ns for path in directory.glob("train-*")}
    expected = dict(built[1], build=dict(built[1]["build"], seconds=None))
    assert dict(manifest, build=dict(manifest["build"], seconds=None)) == expected
    assert not list(directory.glob(".piece-*.json"))


# --- per-rank batches ------------------------------------------------------------------------

@needs_catalogs
def test_two_shards_read_disjoint_halves_of_each_global_batch(built):
    directory, _ = built
    examples = tdata.read_examples(directory, "train")
    per_epoch = len(global_batches(examples.buckets, 32, seed=5))
    whole = batches(directory, "train", 32, per_epoch, seed=5)
    halves = [batches(directory, "train", 16, per_epoch, num_shards=2, shard_id=shard, seed=5)
              for shard in (0, 1)]
    seen = []
    for step, (one, first, second) in enumerate(zip(whole, *halves)):
        assert first[0].shape == second[0].shape == (16, one[0].shape[1])  # same bucket
        assert not set(first[5]) & set(second[5])
        assert np.array_equal(np.concatenate([first[5], second[5]]), one[5])
        for column in range(5):
            assert np.array_equal(np.concatenate([first[column], second[column]]), one[column])
        seen.extend(one[5].tolist())
    assert len(whole) == per_epoch
    counts = bucket_counts(examples.buckets)
    assert len(seen) == len(set(seen)) == sum(n - n % 32 for n in counts.values())
    assert built[1]["train_batches_per_epoch"] == {"batch_size": 32, "batches": per_epoch}


@needs_catalogs
def test_shuffle_is_seeded_and_differs_per_epoch(built):
    directory, _ = built
    per_epoch = len(global_batches(tdata.read_examples(directory, "train").buckets, 64, seed=7))
    stream = [batch[5].tolist() for batch in batches(directory, "train", 64, 2 * per_epoch,
                                                     seed=7)]
    assert stream == [batch[5].tolist() for batch in batches(directory, "train", 64,
                                                             2 * per_epoch, seed=7)]
    assert stream[:per_epoch] != stream[per_epoch:]
    assert sorted(sum(stream[:per_epoch], [])) != sum(stream[:per_epoch], [])
    assert stream[:5] != [batch[5].tolist() for batch in batches(directory, "train", 64, 5,
                                                                 seed=8)]


@needs_catalogs
@pytest.mark.parametrize("num_shards,shard_id", [(1, 0), (2, 1)])
def test_skip_batches_resumes_at_the_same_batch(built, num_shards, shard_id):
    directory, _ = built
    per_epoch = len(global_batches(tdata.read_examples(directory, "train").buckets,
                                   32 * num_shards, seed=2))
    skip = per_epoch + 3  # across an epoch boundary
    full = batches(directory, "train", 32, skip + 4, num_shards=num_shards, shard_id=shard_id,
                   seed=2)
    resumed = batches(directory, "train", 32, 4, num_shards=num_shards, shard_id=shard_id,
                      seed=2, skip_batches=skip)
    for expected, got in zip(full[skip:], resumed):
        for a, b in zip(expected, got):
            assert np.array_equal(a, b)
    assert len(resumed) == 4


@needs_catalogs
def test_reader_errors(built):
    directory, _ = built
    with pytest.raises(DataError, match="no bucket holds a global batch"):
        tdata.create_translation_dataset(directory, "dev", 10_000)
    with pytest.raises(DataError, match="shard_id=2 is not in"):
        tdata.create_translation_dataset(directory, "dev", 4, num_shards=2, shard_id=2)
    with pytest.raises(DataError, match="unknown split 'heldout'"):
        tdata.create_translation_dataset(directory, "heldout", 4)
    with pytest.raises(DataError, match="missing: no dataset.json"):
        tdata.create_translation_dataset(directory.parent / "missing", "train", 4)


# --- command line ----------------------------------------------------------------------------

@needs_catalogs
def test_data_command_from_parallel_files(small_pairs, tmp_path, capsys):
    source, target = tmp_path / "train.en", tmp_path / "train.de"
    source.write_text("".join(s + "\n" for s, _ in small_pairs[:1500]), encoding="utf-8")
    target.write_text("".join(t + "\n" for _, t in small_pairs[:1500]), encoding="utf-8")
    parser = argparse.ArgumentParser()
    tdata.add_data_arguments(parser)
    args = parser.parse_args(["--source", str(source), "--target", str(target), "--output-dir",
                              str(tmp_path / "out"), "--vocab-size", "300", "--seq-length", "48",
                              "--dev-size", "50", "--test-size", "50"])
    tdata.run_data_command(args)
    printed = capsys.readouterr().out
    manifest = read_manifest(tmp_path / "out")
    splits = manifest["splits"]
    assert "1500 pairs found" in printed and f"dev {splits['dev']['kept']}/50" in printed
    assert f"{manifest['pairs']['dropped_too_long']} dropped" in printed and "padding" in printed
    assert manifest["buckets"] == [8, 16, 24, 32, 48]
    assert manifest["source_stats"][f"{source}:{target}"]["kept"] == 1500
    with pytest.raises(DataError, match="as many --target files"):
        tdata.run_data_command(parser.parse_args(["--source", str(source), "--output-dir",
                                                  str(tmp_path / "x"), "--vocab-size", "300",
                                                  "--seq-length", "48"]))
