"""The dataset.json of a built dataset directory: written last, it marks a complete dataset."""

import json
import os
from pathlib import Path

from model_zoo.errors import DataError

MANIFEST_FILE = "dataset.json"


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


def dataset_ready(output_dir, built_with: dict, files, check_kind=None) -> bool:
    """True if `output_dir` holds a complete dataset built with `built_with` (e.g.
    {"vocab_size": 2048, "seq_length": 64}); False if it holds no dataset.json. DataError if
    `check_kind(manifest)` refuses it (another kind of dataset), if it was built with other
    settings, or if one of `files` (names, or a function of the manifest giving them) is
    missing."""
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    if manifest is None:
        return False
    if check_kind is not None:
        check_kind(manifest)
    check_built_with(output_dir, manifest, built_with)
    check_files(output_dir, files(manifest) if callable(files) else files)
    return True


def split_path(dataset_dir, split_files: dict, split: str) -> str:
    """The file of `split` in a dataset directory whose splits are `split_files`
    ({split: file name}); DataError for an unknown split."""
    if split not in split_files:
        raise DataError(f"unknown split {split!r} (splits: {', '.join(split_files)})")
    return os.path.join(str(dataset_dir), split_files[split])


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

