"""The model-folder contract (model_zoo/models/base.py) holds for every folder, and the
command line builds without importing MindSpore or any model's code."""

import argparse
import inspect
import subprocess
import sys

import pytest

from model_zoo.cli import Commands
from model_zoo.config import available_models, import_model
from model_zoo.models.base import REQUIRED_HOOKS, ModelFolder

MODELS = available_models()


def test_the_three_models_are_found():
    assert {"gpt2", "bert", "transformer"} <= set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_folder_provides_every_required_hook(name):
    module = import_model(name)
    for hook in REQUIRED_HOOKS:
        assert hook in dir(module), f"{name} lacks {hook}"
        value = getattr(module, hook)
        if hook in ("ModelConfig", "DataConfig"):
            assert inspect.isclass(value), hook
            continue
        expected = list(inspect.signature(getattr(ModelFolder, hook)).parameters)[1:]
        found = list(inspect.signature(value).parameters)
        assert found[:len(expected)] == expected, f"{name}.{hook}{tuple(found)}"
    assert module.ModelConfig().name == name
    for hook in dir(module):  # every name the folder lists resolves
        assert getattr(module, hook) is not None, hook


@pytest.mark.parametrize("name", MODELS)
def test_every_verb_and_subcommand_has_its_hook(name):
    module = import_model(name)
    parser = argparse.ArgumentParser()
    registry = Commands(parser.add_subparsers())
    module.add_commands(registry)
    for verb in registry.verbs:
        assert "run_" + verb.replace("-", "_") in dir(module), (name, verb)
    for command in ("data", "convert"):
        assert (f"add_{command}_arguments" in dir(module)) == (
            f"run_{command}_command" in dir(module)), (name, command)


def test_command_line_and_launch_import_no_mindspore():
    """`model-zoo --help` lists every command, and neither it nor the rank-table module
    imports MindSpore or a model's code (the launch scripts run them on every server)."""
    script = ("import sys, contextlib, io\n"
              "import model_zoo.launch.rank_table\n"
              "from model_zoo.cli import build_parser\n"
              "help_text = build_parser().format_help()\n"
              "heavy = [m for m in sys.modules if m == 'mindspore' or m.endswith('.model')]\n"
              "print(heavy)\n"
              "print(help_text)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    heavy, _, help_text = result.stdout.partition("\n")
    assert heavy == "[]"
    for command in ("train", "eval", "generate", "fill-mask", "translate", "data", "convert",
                    "rank-table", "plan"):
        assert f"    {command}" in help_text, command
