"""The model-folder contract (model_zoo/models/base.py) holds for every folder, and the
command line builds without importing MindSpore or any model's code."""

import argparse
import importlib
import inspect
import subprocess
import sys

import pytest

from model_zoo.cli import MODEL_SUBCOMMANDS, folder_verbs
from model_zoo.config import available_models, import_model, import_model_commands
from model_zoo.models.base import REQUIRED_HOOKS, FolderCommands, ModelFolder

MODELS = available_models()


def test_the_three_models_are_found():
    assert {"gpt2", "bert", "transformer"} <= set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_folder_provides_every_required_hook(name):
    module = import_model(name)
    for hook in REQUIRED_HOOKS:
        assert hasattr(module, hook), f"{name} lacks {hook}"
        value = getattr(module, hook)
        if hook in ("ModelConfig", "DataConfig"):
            assert inspect.isclass(value), hook
            continue
        check_signature(name, hook, value, getattr(ModelFolder, hook))
    assert module.ModelConfig().name == name
    commands = import_model_commands(name)
    check_signature(name, "add_commands", commands.add_commands, FolderCommands.add_commands)
    assert set(commands.SUBCOMMANDS) <= set(MODEL_SUBCOMMANDS), (name, commands.SUBCOMMANDS)


def check_signature(folder, hook, value, reference):
    """`value` takes the parameters of `reference` (a ModelFolder method without self, or a
    list of names), in order; any further ones have defaults."""
    expected = (reference if isinstance(reference, list)
                else list(inspect.signature(reference).parameters)[1:])
    found = list(inspect.signature(value).parameters.values())
    assert [p.name for p in found[:len(expected)]] == expected, (folder, hook, found)
    extra = [p.name for p in found[len(expected):] if p.default is inspect.Parameter.empty]
    assert not extra, f"{folder}.{hook}: parameters without defaults beyond the contract: {extra}"


class HookNames:
    """A stand-in for a folder's tasks.py whose every hook returns its own name."""

    def __getattr__(self, hook):
        return lambda config, ckpt, args: hook


def verb_hook(run) -> str:
    """The name of the folder's hook that a verb's run (`cli.Commands.verb`) calls."""
    return run(HookNames(), None, argparse.Namespace(ckpt=None))


@pytest.mark.parametrize("name", MODELS)
def test_every_verb_and_subcommand_has_its_hook(name):
    """Each verb runs a hook the folder defines, of the verbs' signature, and each of
    `model-zoo data|convert` the folder serves has both of its hooks."""
    module = import_model(name)
    for verb, run in folder_verbs(name).items():
        hook = verb_hook(run)
        assert hasattr(module, hook), (name, verb, hook)
        check_signature(name, hook, getattr(module, hook), ["config", "ckpt", "args"])
    served = import_model_commands(name).SUBCOMMANDS
    for command, arguments, run in (("data", "add_data_arguments", "run_data_command"),
                                    ("convert", "add_convert_arguments", "run_convert_command")):
        assert hasattr(module, arguments) == hasattr(module, run) == (command in served), \
            (name, command)
        if command in served:
            check_signature(name, arguments, getattr(module, arguments), ["parser"])
            check_signature(name, run, getattr(module, run), ["args"])


def test_command_line_and_launch_import_no_mindspore():
    """`model-zoo --help` lists every command, and neither it nor the rank-table module
    imports MindSpore or a model's code (the launch scripts run them on every server)."""
    script = ("import sys, contextlib, io\n"
              "import model_zoo.launch.rank_table\n"
              "from model_zoo.cli import build_parser\n"
              "help_text = build_parser().format_help()\n"
              "heavy = [m for m in sys.modules if m == 'mindspore'\n"
              "         or m.endswith(('.model', '.tasks'))]\n"
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


def _verb_arguments():
    """(argv, module, hook) of every command that runs a network, one config each: eval and
    export for every model, and each verb for every folder that serves it."""
    cases = []
    for name in MODELS:
        config = f"model_zoo/models/{name}/configs/tiny.yaml"
        cases.append((["eval", config, "--ckpt", "x.ckpt"], "model_zoo.checkpoint.files",
                      "evaluate_checkpoint"))
        cases.append((["export", config, "--ckpt", "x.ckpt"], "model_zoo.train.export",
                      "export_checkpoint"))
        required = {"generate": ["--prompt-ids", "1 2"], "fill-mask": ["--ids", "4 5"],
                    "translate": ["--input", "x.txt"]}
        for verb, run in sorted(folder_verbs(name).items()):
            cases.append(([verb, config, "--ckpt", "x.ckpt"] + required[verb],
                          f"model_zoo.models.{name}.tasks", verb_hook(run)))
    return cases


@pytest.mark.parametrize("argv, module, hook", _verb_arguments(),
                         ids=lambda value: value if isinstance(value, str) else None)
def test_every_command_that_runs_a_network_runs_it_compiled(argv, module, hook, monkeypatch):
    """Each command sets graph mode (and the device) before it loads a network: in PyNative
    a decoding step runs operator by operator, ten times as slow. The hook records the
    mode it is called in; the process starts in PyNative."""
    import mindspore as ms
    from model_zoo.cli import main
    modes = []
    monkeypatch.setattr(importlib.import_module(module), hook,
                        lambda *args, **kwargs: modes.append(ms.get_context("mode")) or {})
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        assert main(argv) == 0
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert modes == [ms.GRAPH_MODE]
