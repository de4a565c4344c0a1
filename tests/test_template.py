"""A model folder is a template: a copy of `model_zoo/models/gpt2` under a new name trains as is.

The copy is made inside a copy of the package in a temporary folder, where the commands
here run (the current directory comes first on Python's path), so the tests never write
into the installed package."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import model_zoo
from conftest import run_cli, write_tiny_config

NAME = "gpt2_copy"


@dataclass
class Copy:
    root: Path    # holds the copied model_zoo package
    name: str     # the copied folder's model name

    @property
    def folder(self) -> Path:
        return self.root / "model_zoo" / "models" / self.name

    def run(self, script: str) -> subprocess.CompletedProcess:
        """`script` in a Python process that imports the copied package."""
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=300, cwd=self.root, env=dict(os.environ, GLOG_v="3"))


@pytest.fixture(scope="module")
def copied_model(tmp_path_factory):
    """The package copied to a temporary folder, with its models/gpt2 copied as gpt2_copy."""
    root = tmp_path_factory.mktemp("site")
    package = root / "model_zoo"
    shutil.copytree(os.path.dirname(model_zoo.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(package / "models" / "gpt2", package / "models" / NAME)
    return Copy(root, NAME)


def test_copy_imports_nothing_from_the_original(copied_model):
    pattern = re.compile(r"model_zoo\.models\.gpt2\b"
                         r"|from\s+model_zoo\.models\s+import\s+.*\bgpt2\b")
    for path in copied_model.folder.rglob("*.py"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not pattern.search(line), f"{path.name}:{number}: {line.strip()}"


@pytest.mark.slow
def test_copy_trains_and_evaluates_through_the_cli(copied_model, tiny_dataset, tmp_path):
    config = write_tiny_config(tmp_path / "copy.yaml", tiny_dataset,
                               {"model.name": copied_model.name, "train.steps": 3,
                                "train.save_steps": 3})
    run_dir = tmp_path / "run"
    result = run_cli("train", config, "--output-dir", run_dir, cwd=copied_model.root)
    assert result.returncode == 0, result.stderr
    assert os.listdir(run_dir / "checkpoints") == ["step_00000003.ckpt"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in metrics] == [1, 2, 3]
    assert f"model:\n  name: {copied_model.name}\n" in (run_dir / "config.yaml").read_text()

    result = run_cli("eval", config, "--ckpt", run_dir / "checkpoints" / "step_00000003.ckpt",
                     cwd=copied_model.root)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip())
    assert report["perplexity"] > 1


def test_copy_trains_with_the_original_unimportable(copied_model, tiny_dataset, tmp_path):
    """With `model_zoo.models.gpt2` blocked, the copy still imports, trains and evaluates."""
    config = write_tiny_config(tmp_path / "copy.yaml", tiny_dataset,
                               {"model.name": copied_model.name, "train.steps": 2,
                                "train.save_steps": 2})
    result = copied_model.run(
        "import sys\n"
        "sys.modules['model_zoo.models.gpt2'] = None  # any import of the original now fails\n"
        "import model_zoo\n"
        f"assert model_zoo.__file__.startswith({str(copied_model.root)!r}), model_zoo.__file__\n"
        "from model_zoo.config import load_config\n"
        "from model_zoo.train.trainer import train\n"
        f"result = train(load_config({config!r}), {str(tmp_path / 'run')!r})\n"
        "print('RESULT', result['loss'])\n")
    assert result.returncode == 0, result.stderr
    assert "RESULT " in result.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000002.ckpt").is_file()


def test_copied_converter_names_the_copy(copied_model):
    """A config converted by the copy's converter (and the copy's default model name) names
    the copy, not the original."""
    result = copied_model.run(
        "import importlib\n"
        "import transformers\n"
        f"convert = importlib.import_module('model_zoo.models.{copied_model.name}.convert')\n"
        "hf_config = dict(convert.HF_DEFAULTS)\n"
        "hf_config.update(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,\n"
        "                                         n_positions=16, vocab_size=64).to_dict())\n"
        f"model = importlib.import_module('model_zoo.models.{copied_model.name}.model')\n"
        "print(convert.build_config(hf_config).model.name, model.GPT2Config().name)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == [copied_model.name] * 2
