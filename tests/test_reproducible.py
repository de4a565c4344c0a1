"""Same config, same run: the dropout masks are a function of the seed and the step (the
keyed CPU kernel), for every model, and a resumed run repeats the uninterrupted one."""

import glob
import os

import mindspore as ms
import numpy as np
import pytest
import yaml

from conftest import write_jsonl
from model_zoo.config import load_config
from model_zoo.nn import cpu_kernels
from model_zoo.checkpoint.files import list_checkpoints, read_checkpoint
from model_zoo.train.metrics import read_metrics
from model_zoo.train.trainer import train

pytestmark = pytest.mark.slow   # the slow tier (tests/conftest.py)

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")
MASK64 = (1 << 64) - 1


def splitmix64(value):
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & MASK64
    return value ^ (value >> 31)


def reference_mask(key, count, keep):
    """The keyed dropout's mask as its comment defines it, in Python integers."""
    base = 0
    for part in key:
        base = splitmix64((base + (part & 0xFFFFFFFF)) & MASK64)
    threshold = int(keep * (1 << 24))
    return np.array([splitmix64((base + 0x9E3779B97F4A7C15 * i) & MASK64) >> 40 < threshold
                     for i in range(count)])


@needs_kernels
def test_keyed_dropout_is_a_function_of_its_key():
    dropout = cpu_kernels.keyed_dropout()
    # 64 x 3300 elements: split over the cores (each part draws its own elements' masks)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(64, 3300)).astype(np.float32))
    keep = ms.Tensor([0.9], ms.float32)

    def run(*key):
        return dropout(x, ms.Tensor(key, ms.int32), keep).asnumpy()

    first = run(1, 7, 3, 0)
    np.testing.assert_array_equal(first, run(1, 7, 3, 0))
    kept = first != 0
    np.testing.assert_array_equal(kept, reference_mask((1, 7, 3, 0), x.size, 0.9).reshape(x.shape))
    np.testing.assert_allclose(first[kept], x.asnumpy()[kept] / 0.9, rtol=1e-6)
    assert 0.87 < kept.mean() < 0.93
    for other in ((1, 7, 4, 0), (1, 7, 3, 1), (2, 7, 3, 0), (1, 8, 3, 0)):
        assert (run(*other) != 0).tolist() != kept.tolist(), other

    # the gradient is the same mask, regenerated from the key
    def doubled_sum(value):
        return (dropout(value, ms.Tensor([1, 7, 3, 0], ms.int32), keep) * 2.0).sum()

    grad = ms.grad(doubled_sum)(x).asnumpy()
    np.testing.assert_allclose(grad, np.where(kept, 2.0 / 0.9, 0.0), rtol=1e-6)


def trained(config_path, output_dir, resume=False, overrides=None):
    train(load_config(str(config_path), overrides), str(output_dir), resume=resume)
    losses = [entry["loss"] for entry in read_metrics(os.path.join(output_dir, "metrics.jsonl"))
              if "loss" in entry]
    _, newest = list_checkpoints(output_dir)[-1]
    return losses, {name: value.asnumpy() for name, value in read_checkpoint(newest).items()}


def assert_same_run(first, second):
    assert first[0] == second[0]
    assert sorted(first[1]) == sorted(second[1])
    for name, value in first[1].items():
        np.testing.assert_array_equal(second[1][name], value, err_msg=name)


def assert_other_run(first, second):
    assert first[0] != second[0]


DROPOUT = {"model.dropout": 0.1, "model.attention_dropout": 0.1}


def test_gpt2_with_dropout_repeats_and_resumes_exactly(write_config, tmp_path):
    settings = {**DROPOUT, "train.steps": 8, "train.save_steps": 4, "train.log_steps": 1,
                "train.keep_checkpoints": 3, "train.warmup_steps": 20}
    config = write_config(settings)
    first = trained(config, tmp_path / "a")
    assert_same_run(first, trained(config, tmp_path / "b"))
    without = trained(write_config({**settings, "model.dropout": 0.0,
                                    "model.attention_dropout": 0.0}, name="plain.yaml"),
                      tmp_path / "plain")
    assert_other_run(first, without)   # the dropout is on

    half = write_config({**settings, "train.steps": 4}, name="half.yaml")
    trained(half, tmp_path / "resumed")
    resumed = trained(half, tmp_path / "resumed", resume=True, overrides=["train.steps=8"])
    assert resumed[0] == first[0]
    assert_same_run(first, resumed)


def test_gpt2_with_dropout_repeats_with_gradient_accumulation(write_config, tmp_path):
    config = write_config({**DROPOUT, "train.steps": 3, "train.save_steps": 3,
                           "train.grad_accumulation": 2})
    assert_same_run(trained(config, tmp_path / "a"), trained(config, tmp_path / "b"))


@pytest.fixture(scope="module")
def bert_dataset(tmp_path_factory):
    from model_zoo.data import python_docstrings_corpus
    from model_zoo.data.streaming import BuildOptions
    from model_zoo.models.bert.data import build_pretraining_dataset
    root = tmp_path_factory.mktemp("bert_repeat")
    corpus = write_jsonl(root / "corpus.jsonl", python_docstrings_corpus()[:120])
    build_pretraining_dataset(root / "data", [corpus], vocab_size=300, seq_length=32,
                              max_predictions_per_seq=5, dupe_factor=1,
                              options=BuildOptions(heldout_fraction=0.1), record_sources=False)
    return root / "data"


def test_bert_with_dropout_repeats(bert_dataset, tmp_path):
    config = {"model": {"name": "bert", "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                        "seq_length": 32, "vocab_size": 300, "dropout": 0.1,
                        "attention_dropout": 0.1},
              "train": {"steps": 5, "global_batch_size": 8, "lr": 3e-3, "save_steps": 5,
                        "log_steps": 1, "device_target": "CPU"},
              "data": {"dataset_dir": str(bert_dataset), "max_predictions_per_seq": 5}}
    path = tmp_path / "bert.yaml"
    path.write_text(yaml.safe_dump(config))
    assert_same_run(trained(path, tmp_path / "a"), trained(path, tmp_path / "b"))


CATALOGS = "/usr/share/locale/de/LC_MESSAGES"


def test_transformer_with_dropout_repeats(tmp_path):
    from conftest import write_pairs
    from model_zoo.models.transformer import data as tdata
    from model_zoo.models.transformer.pairs import message_catalog_pairs
    if not glob.glob(os.path.join(CATALOGS, "*.mo")):
        pytest.skip(f"no German message catalogs in {CATALOGS}")
    pairs = [pair for pair in message_catalog_pairs() if max(map(len, pair)) <= 24]
    tdata.build_translation_dataset(tmp_path / "data",
                                    [write_pairs(tmp_path / "pairs.tsv", pairs[::8][:400])],
                                    vocab_size=200, seq_length=16, dev_size=16, test_size=16,
                                    seed=1, buckets=[16], source="catalog slice (test)",
                                    record_sources=False)
    config = {"model": {"name": "transformer", "num_layers": 1, "hidden_size": 32,
                        "num_heads": 2, "ffn_hidden_size": 64, "seq_length": 16,
                        "vocab_size": 200, "dropout": 0.1, "attention_dropout": 0.1,
                        "beam_size": 1, "max_decode_extra": 4},
              "train": {"steps": 5, "global_batch_size": 16, "lr": 1e-2, "warmup_steps": 0,
                        "lr_schedule": "inverse_sqrt", "save_steps": 5, "log_steps": 1,
                        "device_target": "CPU"},
              "data": {"dataset_dir": str(tmp_path / "data"), "sources": ["builtin:locale-de"],
                       "dev_size": 16, "test_size": 16}}
    path = tmp_path / "transformer.yaml"
    path.write_text(yaml.safe_dump(config))
    assert_same_run(trained(path, tmp_path / "a"), trained(path, tmp_path / "b"))
