"""BERT's user paths through the command line: pretrain, eval, fill-mask, fine-tune."""

import json
import re

import pytest
import yaml

from conftest import run_cli, write_jsonl

SEQ = 32
VOCAB = 300


@pytest.fixture(scope="module")
def pretraining_dir(tmp_path_factory):
    from model_zoo.data.streaming import BuildOptions
    from model_zoo.models.bert.data import build_pretraining_dataset
    from model_zoo.data import python_docstrings_corpus
    directory = tmp_path_factory.mktemp("bert") / "pretrain"
    corpus = write_jsonl(directory.parent / "corpus.jsonl", python_docstrings_corpus()[:150])
    build_pretraining_dataset(directory, [corpus], vocab_size=VOCAB,
                              seq_length=SEQ, max_predictions_per_seq=5, dupe_factor=1,
                              options=BuildOptions(heldout_fraction=0.1, seed=1),
                              source="test slice", record_sources=False)
    return directory


def write_config(path, task, dataset_dir, **train):
    model = {"name": "bert", "task": task, "num_layers": 1, "hidden_size": 32, "num_heads": 2,
             "seq_length": SEQ, "vocab_size": VOCAB, "dropout": 0.0, "attention_dropout": 0.0}
    data = {"dataset_dir": str(dataset_dir), "max_predictions_per_seq": 5}
    if task == "classify":
        model["num_labels"] = 4
        data = {"dataset_dir": str(dataset_dir),
                "tokenizer": str(train.pop("tokenizer"))}
    config = {"model": model, "parallel": {},
              "train": {"steps": 6, "global_batch_size": 8, "lr": 3e-3, "save_steps": 6,
                        "log_steps": 2, "device_target": "CPU", **train},
              "data": data}
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, pretraining_dir):
    """A pretraining run of 6 steps: (config path, checkpoint path)."""
    root = tmp_path_factory.mktemp("bert_run")
    config = write_config(root / "pretrain.yaml", "pretrain", pretraining_dir)
    result = run_cli("train", config, "--output-dir", root / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out evaluation" in result.stdout and "mask " in result.stdout
    return config, root / "out" / "checkpoints" / "step_00000006.ckpt"


def test_eval_prints_mlm_and_nsp_accuracy(pretrained):
    config, ckpt = pretrained
    result = run_cli("eval", config, "--ckpt", ckpt)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["split"] == "heldout" and metrics["examples"] > 0
    assert 0.0 <= metrics["mlm_accuracy"] <= 1.0 and 0.0 <= metrics["nsp_accuracy"] <= 1.0


def test_fill_mask_prints_top_k_ids_per_mask(pretrained):
    config, ckpt = pretrained
    result = run_cli("fill-mask", config, "--ckpt", ckpt, "--ids", "4 20 6 31 6 5",
                     "--top-k", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("mask ")]
    assert [line.split(":")[0] for line in lines] == ["mask 2", "mask 4"]
    for line in lines:
        ids = re.match(r"mask \d+: ([\d ]+)", line).group(1).split()
        assert len(ids) == 3 and all(0 <= int(i) < VOCAB for i in ids)

    text = run_cli("fill-mask", config, "--ckpt", ckpt, "--text", "Return the [MASK] name.")
    assert text.returncode == 0, text.stderr[-2000:]
    assert re.search(r"^mask \d+: (\d+ ){4}\d+ -> ", text.stdout, re.M)


def test_fill_mask_without_a_mask_is_refused(pretrained):
    config, ckpt = pretrained
    result = run_cli("fill-mask", config, "--ckpt", ckpt, "--ids", "4 20 31 5")
    assert result.returncode == 2
    assert "no mask token (id 6)" in result.stderr
    # a mask past the model's positions: the text is too long, not without a mask
    longer = run_cli("fill-mask", config, "--ckpt", ckpt, "--text",
                     "Return the name. " * 100 + "[MASK]")
    assert longer.returncode == 2
    assert "more than model.seq_length=" in longer.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_fine_tuning_starts_from_the_pretrained_checkpoint(tmp_path, pretraining_dir, pretrained):
    _, ckpt = pretrained
    config = write_config(tmp_path / "finetune.yaml", "classify", tmp_path / "topics",
                          tokenizer=pretraining_dir / "tokenizer.model", init_checkpoint=str(ckpt))
    result = run_cli("train", config, "--output-dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initialised from {ckpt}; new parameters: classifier" in result.stdout
    evaluation = run_cli("eval", config, "--ckpt",
                         tmp_path / "out" / "checkpoints" / "step_00000006.ckpt")
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    metrics = json.loads(evaluation.stdout.strip().splitlines()[-1])
    assert metrics["split"] == "dev" and metrics["examples"] > 100
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.25 < metrics["majority_baseline"] < 1.0


def test_fine_tuning_from_a_missing_checkpoint_is_refused(tmp_path, pretraining_dir):
    config = write_config(tmp_path / "finetune.yaml", "classify", tmp_path / "topics",
                          tokenizer=pretraining_dir / "tokenizer.model",
                          init_checkpoint=str(tmp_path / "nothing.ckpt"))
    result = run_cli("train", config, "--output-dir", tmp_path / "out")
    assert result.returncode == 2
    assert "train.init_checkpoint" in result.stderr
    assert not (tmp_path / "out").exists()
