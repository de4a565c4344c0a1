"""The dataset.json of a built dataset directory: written last, it marks a complete dataset.

It records how the dataset was built (settings, sources) and the size and SHA-256 of each of
its files, so a truncated, replaced or corrupt file is named before training starts: sizes
are checked whenever the dataset is used, checksums with `model-zoo train --verify-data`.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

from model_zoo.data.tokenizer import HF_TOKENIZER_FILE, TOKENIZER_FILE, Tokenizer
from model_zoo.errors import DataError
from model_zoo.files import exclusive_lock, sha256_of, write_json_atomically

MANIFEST_FILE = "dataset.json"


def write_manifest(output_dir, manifest: dict, sources=None, known_files=None) -> dict:
    """Write `manifest` as the dataset.json of `output_dir`, with `files`: the size and
    SHA-256 of every file of the dataset (hidden files excepted; `known_files` gives those
    of files already hashed, as {name: {"bytes", "sha256"}}), and `sources`: the data
    sources it was built from, if given (`check_sources`). Returns what was written."""
    known_files = known_files or {}
    output_dir = Path(output_dir)
    if sources is not None:
        manifest = dict(manifest, sources=[normalized_source(source) for source in sources])
    names = sorted(entry.name for entry in os.scandir(output_dir)
                   if entry.is_file() and not entry.name.startswith(".")
                   and entry.name != MANIFEST_FILE)
    manifest = dict(manifest, files={name: known_files.get(name) or
                                     {"bytes": (output_dir / name).stat().st_size,
                                      "sha256": sha256_of(output_dir / name)}
                                     for name in names})
    write_json_atomically(output_dir / MANIFEST_FILE, manifest)
    return manifest


def check_recorded_files(output_dir, manifest, checksums: bool = False):
    """DataError naming the first file of the dataset whose size (and, with `checksums`,
    SHA-256) differs from what dataset.json recorded when it was built."""
    output_dir = Path(output_dir)
    rebuild = f"delete {output_dir} and build it again"
    for name, recorded in (manifest.get("files") or {}).items():
        path = output_dir / name
        if not path.is_file():
            raise DataError(f"{path}: missing from the dataset in {output_dir}; {rebuild}")
        size = path.stat().st_size
        if size != recorded["bytes"]:
            raise DataError(f"{path}: {size} bytes, but {recorded['bytes']} when the dataset "
                            f"was built (truncated or replaced since); {rebuild}")
        if checksums and sha256_of(path) != recorded["sha256"]:
            raise DataError(f"{path}: its SHA-256 differs from the one recorded when the "
                            f"dataset was built (the file is corrupt or was changed); {rebuild}")


def check_sources(output_dir, manifest, sources):
    """DataError if the dataset in `output_dir` was built from other sources than the
    config's `data.sources` (compared as written, normalised: relative paths stay relative,
    so a dataset built on one machine is recognised on another)."""
    built_from = manifest.get("sources")
    if built_from is None:  # built before sources were recorded
        return
    if built_from != [normalized_source(source) for source in sources]:
        raise DataError(f"data.sources is {list(sources)} but the dataset in {output_dir} was "
                        f"built from {built_from}; set data.sources to those, or give another "
                        f"data.dataset_dir to build a dataset from data.sources")


def normalized_source(source: str) -> str:
    """A data source as recorded: each path (both of a Transformer `SOURCE:TARGET` pair)
    normalised (`./a//b.txt` -> `a/b.txt`); `builtin:` names stay as they are."""
    if source.startswith("builtin:"):
        return source
    return ":".join(os.path.normpath(part) for part in source.split(":"))


def verify_dataset(dataset_dir, sources=None, checksums: bool = False):
    """Before training on the dataset in `dataset_dir` (whose file sizes `dataset_ready`
    has checked): it was built from `sources` (the config's data.sources, if the model has
    them), its files' SHA-256 match with `checksums`, and its tokenizer loads (found now, not
    after training)."""
    manifest = built_manifest(dataset_dir)
    if sources is not None:
        check_sources(dataset_dir, manifest, sources)
    if checksums:
        check_recorded_files(dataset_dir, manifest, checksums=True)
    tokenizer = Path(dataset_dir) / TOKENIZER_FILE
    if tokenizer.exists():
        Tokenizer(tokenizer)


def dataset_digests(dataset_dir) -> dict:
    """What the ranks of a job compare before training, as {file name: SHA-256}, always two
    entries so that every rank sends as many bytes: the tokenizer file (zeros without one),
    then dataset.json (which records every data file's size and SHA-256)."""
    folder = Path(dataset_dir)
    tokenizer = next((name for name in (TOKENIZER_FILE, HF_TOKENIZER_FILE)
                      if (folder / name).is_file()), TOKENIZER_FILE)
    return {tokenizer: sha256_of(folder / tokenizer) if (folder / tokenizer).is_file()
            else "0" * 64,
            MANIFEST_FILE: sha256_of(folder / MANIFEST_FILE)}


@contextlib.contextmanager
def building(dataset_dir):
    """Hold the build lock of `dataset_dir` (one builder at a time) and, once held, remove
    the staging folders that killed builds left in it (`write_mindrecord`'s)."""
    dataset_dir = str(dataset_dir).rstrip("/\\")
    with exclusive_lock(dataset_dir + ".lock"):
        if os.path.isdir(dataset_dir):
            for entry in os.scandir(dataset_dir):
                if entry.is_dir() and entry.name.startswith(".") and ".mindrecord." in entry.name:
                    shutil.rmtree(entry.path, ignore_errors=True)
        yield


def read_manifest(output_dir):
    """The dataset.json of `output_dir` as a dict, or None if there is none."""
    manifest_path = Path(output_dir) / MANIFEST_FILE
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{manifest_path}: not a readable dataset description ({error})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{manifest_path}: not a readable dataset description (not a JSON object)")
    return manifest


def check_sources_to_build(dataset_dir, sources):
    """Before building the dataset `dataset_dir` lacks: DataError naming both keys when
    data.sources gives nothing to build it from."""
    if sources:
        return
    state = ("does not exist" if not os.path.exists(dataset_dir) else
             f"holds no {MANIFEST_FILE}, so no complete dataset")
    raise DataError(f"data.dataset_dir {str(dataset_dir)!r} {state}, and data.sources is "
                    f"empty: give data.sources to build it from, or point data.dataset_dir "
                    f"at a built dataset")


def built_manifest(dataset_dir) -> dict:
    """The dataset.json of the dataset in `dataset_dir`; DataError if there is none."""
    manifest = read_manifest(dataset_dir)
    if manifest is None:
        raise DataError(f"{dataset_dir}: no {MANIFEST_FILE}, so no dataset in it (build the "
                        f"dataset first)")
    return manifest


def dataset_ready(output_dir, built_with: dict, files, check_kind=None) -> bool:
    """True if `output_dir` holds a complete dataset built with `built_with` (e.g.
    {"vocab_size": 2048, "seq_length": 64}); False if it holds no dataset.json. DataError if
    `check_kind(manifest)` refuses it (another kind of dataset), if it was built with other
    settings, if one of `files` (names, or a function of the manifest giving them) is
    missing, or if a file's size differs from the recorded one."""
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    if manifest is None:
        return False
    if check_kind is not None:
        check_kind(manifest)
    check_built_with(output_dir, manifest, built_with)
    check_files(output_dir, files(manifest) if callable(files) else files)
    check_recorded_files(output_dir, manifest)
    return True


def split_path(dataset_dir, split_files: dict, split: str) -> str:
    """The file of `split` in a dataset directory whose splits are `split_files`
    ({split: file name}); DataError for an unknown split."""
    if split not in split_files:
        raise DataError(f"unknown split {split!r} (splits: {', '.join(split_files)})")
    return os.path.join(str(dataset_dir), split_files[split])


def split_paths(dataset_dir, split_files: dict, split: str) -> list:
    """The MindRecord files of `split`: those dataset.json lists for it (the pieces of a
    streamed build), else the one `split_files` ({split: file name}) names."""
    path = split_path(dataset_dir, split_files, split)
    manifest = read_manifest(dataset_dir) or {}
    names = ((manifest.get("splits") or {}).get(split) or {}).get("files")
    return [os.path.join(str(dataset_dir), name) for name in names] if names else [path]


def check_positive(name: str, value):
    """DataError unless `value` (the size called `name`) is a positive integer."""
    if not isinstance(value, int) or value < 1:
        raise DataError(f"{name} must be a positive integer, got {value!r}")


def check_no_dataset(output_dir):
    """DataError if `output_dir` already holds a complete dataset (a dataset.json)."""
    output_dir = Path(output_dir)
    if (output_dir / MANIFEST_FILE).exists():
        raise DataError(f"{output_dir} already holds a dataset ({output_dir / MANIFEST_FILE}); "
                        f"delete it or choose another output directory")


def check_built_with(output_dir, manifest, asked: dict):
    """DataError if the dataset in `output_dir` was built with other settings than `asked`
    (e.g. {"vocab_size": 2048, "seq_length": 64}): it is never silently reused or overwritten."""
    built = {key: manifest.get(key) for key in asked}
    if built != asked:
        def describe(values):
            return ", ".join(f"{key}={value}" for key, value in values.items())
        raise DataError(f"{output_dir} holds a dataset built with {describe(built)}, but "
                        f"{describe(asked)} is asked for; use another directory or delete it")


def check_files(output_dir, names):
    """DataError naming the first of `names` missing from `output_dir`; a MindRecord file
    counts with its `.db` index."""
    output_dir = Path(output_dir)
    for name in names:
        for needed in ([name, name + ".db"] if name.endswith(".mindrecord") else [name]):
            if not (output_dir / needed).is_file():
                raise DataError(f"{output_dir / needed}: missing from the dataset in {output_dir}; "
                                f"delete the directory and build it again")

