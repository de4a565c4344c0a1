"""Shared fixtures: one tiny GPT-2 dataset per test session and tiny config files pointing at it.

The dataset (vocab 400, seq_length 16) is built from a slice of the standard library's
docstrings, so every test that trains reuses it instead of building its own.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")  # quiet MindSpore, here and in the subprocesses

import pytest
import yaml

TINY_VOCAB = 400
TINY_SEQ = 16
TINY_DOCUMENTS = 60

TINY_CONFIG = {
    "model": {"name": "gpt2", "num_layers": 1, "hidden_size": 32, "num_heads": 2,
              "seq_length": TINY_SEQ, "vocab_size": TINY_VOCAB, "dropout": 0.0,
              "attention_dropout": 0.0},
    "parallel": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1},
    "train": {"steps": 4, "global_batch_size": 8, "lr": 1.0e-2, "min_lr": 1.0e-3,
              "warmup_steps": 0, "grad_clip": 1.0, "precision": "fp32", "save_steps": 2,
              "keep_checkpoints": 2, "log_steps": 1, "seed": 1, "device_target": "CPU"},
    "data": {"dataset_dir": "", "sources": ["builtin:python-docs"], "heldout_fraction": 0.1},
}


def pytest_configure(config):
    # The slow tier: the dry-run compiles, launched multi-process jobs, signals, and the
    # longest trainings. `pytest -m "not slow" tests` is the fast tier for daily work; CI
    # and `pytest tests` run everything.
    config.addinivalue_line("markers", "slow: a test of the slow tier (see tests/conftest.py)")


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """Directory of a complete GPT-2 dataset: vocab 400, seq_length 16, about 700 samples."""
    from model_zoo.data import python_docstrings_corpus
    from model_zoo.data.streaming import BuildOptions
    from model_zoo.causal_lm.data import build_dataset

    directory = tmp_path_factory.mktemp("gpt2_data") / "tiny"
    corpus = write_jsonl(directory.parent / "corpus.jsonl",
                         python_docstrings_corpus()[:TINY_DOCUMENTS])
    build_dataset(directory, [corpus], vocab_size=TINY_VOCAB, seq_length=TINY_SEQ,
                  options=BuildOptions(heldout_fraction=0.1, seed=1),
                  source="python docstrings (test slice)",
                  record_sources=False)
    return str(directory)


def write_pairs(path, pairs):
    """Sentence pairs as a .tsv input file (source TAB target a line)."""
    path = Path(path)
    path.write_text("".join(f"{source}\t{target}\n" for source, target in pairs),
                    encoding="utf-8")
    return path


def write_jsonl(path, documents):
    """Documents as a JSON-lines input file (which keeps blank lines inside a document)."""
    import json
    path = Path(path)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents),
                    encoding="utf-8")
    return path


def tiny_config_dict(dataset_dir, overrides=None):
    """The tiny config as a dict, with `{"section.key": value}` overrides applied."""
    config = {section: dict(values) for section, values in TINY_CONFIG.items()}
    config["data"]["dataset_dir"] = str(dataset_dir)
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".")
        config[section][key] = value
    return config


def write_tiny_config(path, dataset_dir, overrides=None):
    """Write the tiny config (with overrides) as YAML to `path`; returns the path as a str."""
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(tiny_config_dict(dataset_dir, overrides), handle, sort_keys=False)
    return str(path)


@pytest.fixture
def write_config(tiny_dataset, tmp_path):
    """Factory: write_config({"train.steps": 8}, name="a.yaml") -> path of a tiny config YAML."""

    def write(overrides=None, name="tiny.yaml", directory=None):
        return write_tiny_config(os.path.join(str(directory or tmp_path), name), tiny_dataset,
                                 overrides)

    return write


def run_cli(*args, timeout=300, cwd=None):
    """`python -m model_zoo ARGS` in a subprocess, as a user runs it (in `cwd`, whose
    model_zoo folder then comes first); returns CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "model_zoo", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, GLOG_v="3"))


def device_matrix_size(prim, strat) -> int:
    """Devices one operator's strategy spans (rule G4): MatMul batch x m x k x n, Gather the
    table's and the ids' splits, other operators their largest input strategy."""
    if prim.name in ("MatMul", "BatchMatMul"):
        x, w = strat
        n = w[-2] if prim.attrs.get("transpose_b") else w[-1]
        return math.prod(x) * n
    if prim.name == "Gather":
        return math.prod(strat[0]) * math.prod(strat[1])
    return max(math.prod(part) for part in strat)


def snapshot(directory):
    """{relative path: (bytes, mtime_ns)} of every file under `directory`."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = (handle.read(),
                                                           os.stat(path).st_mtime_ns)
    return found
