"""A model folder is a template: a copy of `model_zoo/models/gpt2` under a new name trains as is."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import model_zoo.models
from conftest import run_cli, write_tiny_config

PACKAGE_DIR = model_zoo.models.__path__[0]


@pytest.fixture(scope="module")
def copied_model():
    """model_zoo/models/gpt2 copied to model_zoo/models/gpt2_copy_<pid>; removed afterwards, even
    on failure."""
    name = f"gpt2_copy_{os.getpid()}"
    target = os.path.join(PACKAGE_DIR, name)
    assert not os.path.exists(target)
    try:
        shutil.copytree(os.path.join(PACKAGE_DIR, "gpt2"), target,
                        ignore=shutil.ignore_patterns("__pycache__"))
        yield name
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_copy_imports_nothing_from_the_original(copied_model):
    pattern = re.compile(r"model_zoo\.models\.gpt2\b"
                         r"|from\s+model_zoo\.models\s+import\s+.*\bgpt2\b")
    folder = os.path.join(PACKAGE_DIR, copied_model)
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as handle:
                    for number, line in enumerate(handle, 1):
                        assert not pattern.search(line), f"{name}:{number}: {line.strip()}"


@pytest.mark.slow
def test_copy_trains_and_evaluates_through_the_cli(copied_model, tiny_dataset, tmp_path):
    config = write_tiny_config(tmp_path / "copy.yaml", tiny_dataset,
                               {"model.name": copied_model, "train.steps": 3,
                                "train.save_steps": 3})
    run_dir = tmp_path / "run"
    result = run_cli("train", config, "--output-dir", run_dir)
    assert result.returncode == 0, result.stderr
    assert os.listdir(run_dir / "checkpoints") == ["step_00000003.ckpt"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in metrics] == [1, 2, 3]
    assert f"model:\n  name: {copied_model}\n" in (run_dir / "config.yaml").read_text()

    result = run_cli("eval", config, "--ckpt", run_dir / "checkpoints" / "step_00000003.ckpt")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip())
    assert report["perplexity"] > 1


def test_copy_trains_with_the_original_unimportable(copied_model, tiny_dataset, tmp_path):
    """With `model_zoo.models.gpt2` blocked, the copy still imports, trains and evaluates."""
    config = write_tiny_config(tmp_path / "copy.yaml", tiny_dataset,
                               {"model.name": copied_model, "train.steps": 2,
                                "train.save_steps": 2})
    script = (
        "import sys\n"
        "sys.modules['model_zoo.models.gpt2'] = None  # any import of the original now fails\n"
        "from model_zoo.config import load_config\n"
        "from model_zoo.train.trainer import train\n"
        f"result = train(load_config({config!r}), {str(tmp_path / 'run')!r})\n"
        "print('RESULT', result['loss'])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert result.returncode == 0, result.stderr
    assert "RESULT " in result.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000002.ckpt").is_file()


def test_copied_converter_names_the_copy(copied_model):
    """A config converted by the copy's converter (and the copy's default model name) names
    the copy, not the original."""
    import importlib
    import transformers
    convert = importlib.import_module(f"model_zoo.models.{copied_model}.convert")
    hf_config = dict(convert.HF_DEFAULTS)
    hf_config.update(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16,
                                             vocab_size=64).to_dict())
    assert convert.build_config(hf_config).model.name == copied_model
    model = importlib.import_module(f"model_zoo.models.{copied_model}.model")
    assert model.GPT2Config().name == copied_model
