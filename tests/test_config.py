"""Typed config: loading, `--set` overrides, every kind of user error, save/load, the CLI."""

import dataclasses
import os

import pytest

from conftest import run_cli
from model_zoo import cli
from model_zoo.config import Config, TrainConfig, load_config, save_config
from model_zoo.errors import ConfigError
from model_zoo.models.gpt2.model import GPT2Config
from model_zoo.models.gpt2.tasks import GPT2DataConfig
from model_zoo.parallel.config import ParallelConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "model_zoo", "models", "gpt2",
                          "configs")
TINY = os.path.join(CONFIG_DIR, "tiny.yaml")
MINIMAL = "model:\n  name: gpt2\ndata:\n  dataset_dir: datasets/x\n"


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def config_error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# --- loading ----------------------------------------------------------------------------

def test_tiny_loads_into_typed_sections():
    config = load_config(TINY)
    assert isinstance(config, Config)
    assert isinstance(config.model, GPT2Config)
    assert isinstance(config.parallel, ParallelConfig)
    assert isinstance(config.train, TrainConfig)
    assert isinstance(config.data, GPT2DataConfig)
    assert config.model.name == "gpt2"
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_heads) == (2, 128, 4)
    assert config.model.ffn_size == 4 * 128
    assert config.train.lr == pytest.approx(3e-3) and isinstance(config.train.lr, float)
    assert isinstance(config.train.steps, int) and config.train.steps > 0
    assert config.parallel.vocab_emb_dp is True
    assert config.data.sources == ["builtin:python-docs"]


@pytest.mark.parametrize("name", ["tiny", "gpt2-small", "gpt2-medium", "gpt2-1024"])
def test_every_shipped_config_loads(name):
    config = load_config(os.path.join(CONFIG_DIR, f"{name}.yaml"))
    assert config.model.name == "gpt2"
    if name != "tiny":
        # Megatron's padding of GPT-2's 50257 tokens to a multiple of 128.
        assert config.model.vocab_size == 50304 and config.model.vocab_size % 128 == 0
        assert config.model.seq_length == 1024
        assert config.train.precision == "fp16"
        assert 0 < config.train.warmup_steps < config.train.steps
        assert config.train.min_lr < config.train.lr


def test_named_shapes():
    small = load_config(os.path.join(CONFIG_DIR, "gpt2-small.yaml")).model
    medium = load_config(os.path.join(CONFIG_DIR, "gpt2-medium.yaml")).model
    bench = load_config(os.path.join(CONFIG_DIR, "gpt2-1024.yaml")).model
    assert (small.num_layers, small.hidden_size, small.num_heads) == (12, 768, 12)
    assert (medium.num_layers, medium.hidden_size, medium.num_heads) == (24, 1024, 16)
    assert (bench.num_layers, bench.hidden_size, bench.num_heads) == (24, 1024, 16)


# --- overrides --------------------------------------------------------------------------

def test_overrides_apply_with_types():
    config = load_config(TINY, [
        "train.steps=7",
        "train.lr=1e-3",             # YAML 1.1 reads this as the string '1e-3'
        "train.min_lr=0",            # an int where a float is expected
        "parallel.recompute=true",
        "data.sources=[a.txt, b.txt]",
        "model.dropout=0.1",
    ])
    assert config.train.steps == 7 and isinstance(config.train.steps, int)
    assert config.train.lr == 1e-3 and isinstance(config.train.lr, float)
    assert config.train.min_lr == 0.0 and isinstance(config.train.min_lr, float)
    assert config.parallel.recompute is True
    assert config.data.sources == ["a.txt", "b.txt"]
    assert config.model.dropout == pytest.approx(0.1)
    # Untouched keys keep the file's values.
    assert config.train.global_batch_size == 16


def test_override_single_value_for_a_list():
    assert load_config(TINY, ["data.sources=notes.txt"]).data.sources == ["notes.txt"]


def test_override_later_wins_and_adds_missing_sections(tmp_path):
    path = write(tmp_path, MINIMAL)
    config = load_config(path, ["train.steps=3", "train.steps=4", "parallel.data_parallel=2"])
    assert config.train.steps == 4
    assert config.parallel.data_parallel == 2


def test_override_into_an_empty_section(tmp_path):
    # `train:` with nothing under it is None in YAML; the file loads, so must an override.
    path = write(tmp_path, MINIMAL + "train:\n")
    assert load_config(path).train.steps == TrainConfig().steps
    assert load_config(path, ["train.steps=5"]).train.steps == 5


# --- errors -----------------------------------------------------------------------------

def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    message = config_error(path)
    assert path in message and "does not exist" in message


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  name: gpt2\n  num_layers: [1, 2\ntrain:\n  steps: 3\n")
    message = config_error(path)
    assert path in message and "not valid YAML" in message
    assert "line 4" in message


def test_a_key_written_twice_is_refused_with_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys silently; the config refuses them."""
    path = write(tmp_path, "model:\n  name: gpt2\ntrain:\n  lr: 1.0e-3\n  steps: 5\n"
                           "  lr: 2.0e-3\n")
    message = config_error(path)
    assert "key 'lr' appears twice" in message and "line 6" in message


def test_bad_indentation_line(tmp_path):
    path = write(tmp_path, "model:\n  name: gpt2\n   bad: 1\n")
    assert "line 3" in config_error(path)


@pytest.mark.parametrize("text", ["- model\n- train\n", "just a string\n", ""])
def test_top_level_not_a_mapping(tmp_path, text):
    path = write(tmp_path, text)
    message = config_error(path)
    assert path in message and "mapping" in message


def test_unknown_section(tmp_path):
    path = write(tmp_path, MINIMAL + "optimizer:\n  lr: 1\n")
    message = config_error(path)
    assert "unknown section 'optimizer'" in message and path in message


def test_section_not_a_mapping(tmp_path):
    path = write(tmp_path, MINIMAL + "train: 5\n")
    message = config_error(path)
    assert "'train'" in message and "mapping" in message


def test_unknown_key():
    message = config_error(TINY, ["train.stpes=5"])
    assert "train.stpes" in message
    assert "steps" in message  # the known keys are listed


def test_unknown_key_in_the_file(tmp_path):
    path = write(tmp_path, "model:\n  name: gpt2\n  hidden: 64\n")
    assert "model.hidden" in config_error(path)


def test_unknown_override_section():
    message = config_error(TINY, ["optim.lr=1"])
    assert "'optim'" in message


@pytest.mark.parametrize("override, shown", [
    ("train.steps=abc", "'abc'"),
    ("train.steps=true", "True"),
    ("train.steps=2.5", "2.5"),
    ("train.lr=fast", "'fast'"),
    ("train.lr=nan", "nan"),
    ("parallel.recompute=maybe", "'maybe'"),
    ("parallel.data_parallel=[1, 2]", "[1, 2]"),
    ("model.name=[gpt2]", None),
])
def test_wrong_type_names_key(override, shown):
    key = override.split("=")[0]
    message = config_error(TINY, [override])
    if shown is None:
        assert "model.name" in message
    else:
        assert key in message and shown in message


@pytest.mark.parametrize("override, expected", [
    ("train.precision=fp8", "train.precision"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-1e-3", "train.lr"),
    ("train.steps=0", "train.steps"),
    ("train.min_lr=1.0", "train.min_lr"),
    ("train.device_target=GPU", "train.device_target"),
    ("model.num_heads=3", "model.num_heads"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.ffn_hidden_size=-1", "model.ffn_hidden_size"),
    ("data.dataset_dir=''", "data.dataset_dir"),
    ("data.heldout_fraction=1.5", "data.heldout_fraction must be in [0, 1), got 1.5"),
    ("parallel.data_parallel=0", "parallel.data_parallel"),
    ("parallel.micro_batch_num=0", "parallel.micro_batch_num"),
])
def test_bad_values_name_key(override, expected):
    assert expected in config_error(TINY, [override])


def test_heads_not_dividing_hidden_names_both():
    message = config_error(TINY, ["model.num_heads=3"])
    assert "model.hidden_size=128" in message and "model.num_heads=3" in message


def test_parallel_checks_run_on_load():
    message = config_error(TINY, ["parallel.pipeline_stage=2", "parallel.micro_batch_num=1"])
    assert "parallel.micro_batch_num=1" in message and "parallel.pipeline_stage=2" in message
    message = config_error(TINY, ["parallel.pipeline_stage=3", "parallel.micro_batch_num=4"])
    assert "the model's 2 blocks" in message and "pipeline_stage=3" in message
    message = config_error(TINY, ["parallel.data_parallel=3"])
    assert "train.global_batch_size=16" in message


def test_missing_model_name(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 2\n")
    message = config_error(path)
    assert "model.name" in message and path in message
    assert "model.name" in config_error(write(tmp_path, "train:\n  steps: 2\n", "b.yaml"))


def test_model_name_without_folder():
    message = config_error(TINY, ["model.name=gpt3"])
    assert "model.name='gpt3'" in message and "gpt2" in message  # lists the folders found


def test_model_name_that_is_a_package_without_a_model():
    # `parallel` is a sub-package of model_zoo but not a model folder.
    assert "model.name='parallel'" in config_error(TINY, ["model.name=parallel"])


@pytest.mark.parametrize("override, shown", [
    ("train.steps", "section.key=value"),
    ("steps=5", "section.key"),
    ("train.opt.lr=5", "section.key"),
    ("train.=5", "section.key"),
])
def test_malformed_override(override, shown):
    message = config_error(TINY, [override])
    assert repr(override) in message and shown in message


# --- save / load ------------------------------------------------------------------------

def test_save_then_load_round_trip(tmp_path):
    config = load_config(TINY, ["train.lr=1e-3", "parallel.recompute=true",
                                "data.sources=[a.txt, b.txt]"])
    path = str(tmp_path / "resolved.yaml")
    save_config(config, path)
    assert not os.path.exists(path + ".tmp")
    loaded = load_config(path)
    assert loaded == config
    assert loaded.to_dict() == config.to_dict()
    assert isinstance(loaded.model, GPT2Config) and isinstance(loaded.data, GPT2DataConfig)


def test_save_round_trip_of_every_shipped_config(tmp_path):
    for name in ("gpt2-small", "gpt2-medium", "gpt2-1024"):
        config = load_config(os.path.join(CONFIG_DIR, f"{name}.yaml"))
        path = str(tmp_path / f"{name}.yaml")
        save_config(config, path)
        assert load_config(path) == config


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["train", "{missing}"],
    ["train", TINY, "--set", "train.stpes=5"],
    ["eval", TINY, "--ckpt", "x.ckpt", "--set", "train.precision=fp8"],
    ["generate", TINY, "--ckpt", "x.ckpt", "--prompt-ids", "1 2", "--set", "train.steps"],
    ["train", "{malformed}"],
])
def test_cli_reports_config_errors_as_one_line(tmp_path, capsys, argv):
    missing = str(tmp_path / "missing.yaml")
    malformed = write(tmp_path, "model: [\n", "malformed.yaml")
    argv = [arg.format(missing=missing, malformed=malformed) for arg in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in captured.err and "Traceback" not in captured.out


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.recompute=full"], "parallel.recompute must be false, true or selective"),
    (["parallel.recompute_blocks=[1]"], "needs parallel.recompute true or selective"),
    (["parallel.stage_blocks=[1,1]"], "one count for each of the 1 pipeline stages"),
    (["parallel.stage_blocks=[1]"], "holds 1 blocks but the model has 2"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.stage_blocks=[2,1]"], "holds 3 blocks but the model has 2"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.stage_blocks=[2,0]"], "parallel.stage_blocks must list one count"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2", "parallel.recompute=true",
      "parallel.recompute_blocks=[2,0]"], "recompute_blocks[0]=2 is more than the 1 blocks"),
    (["parallel.recompute_blocks=[-1]", "parallel.recompute=true"], "0 or more each"),
])
def test_per_stage_knobs_are_checked_on_load(overrides, expected):
    assert expected in config_error(TINY, overrides)


def test_per_stage_knobs_count_blocks_as_mindformers_does():
    parallel = load_config(TINY, ["parallel.recompute=selective"]).parallel
    assert parallel.blocks_per_stage(2) == [2] and parallel.recomputed_blocks(2) == [2]
    parallel = dataclasses.replace(parallel, pipeline_stage=3, stage_blocks=[3, 4, 5],
                                   recompute_blocks=[3, 1, 0], micro_batch_num=3)
    assert parallel.blocks_per_stage(12) == [3, 4, 5]
    assert parallel.recomputed_blocks(12) == [3, 1, 0]
    assert dataclasses.replace(parallel, recompute=False,
                               recompute_blocks=None).recomputed_blocks(12) == [0, 0, 0]
    with pytest.raises(ConfigError, match="needs parallel.recompute true or selective"):
        dataclasses.replace(parallel, recompute=False).recomputed_blocks(12)
    assert dataclasses.replace(parallel, recompute_blocks=None).recomputed_blocks(12) == \
        [3, 4, 5]


def test_bf16_is_a_precision_the_cpu_refuses_in_one_line(tmp_path):
    assert load_config(TINY, ["train.precision=bf16"]).train.precision == "bf16"
    result = run_cli("train", TINY, "--output-dir", str(tmp_path / "out"),
                     "--set", "train.precision=bf16")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "bf16 runs on Ascend 910B only" in lines[-1]
    assert "Traceback" not in result.stderr


def test_the_transformers_stages_share_its_encoder_and_decoder_layers():
    """The Transformer's pipeline blocks are its encoder and then its decoder layers."""
    path = os.path.join(os.path.dirname(CONFIG_DIR), "..", "transformer", "configs",
                        "tiny.yaml")
    layers = load_config(path).model.num_layers
    base = ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2"]
    config = load_config(path, base + [f"parallel.stage_blocks=[{layers + 1},{layers - 1}]"])
    assert config.parallel.blocks_per_stage(config.model.pipeline_blocks) == [layers + 1,
                                                                               layers - 1]
    assert f"but the model has {2 * layers}" in config_error(
        path, base + [f"parallel.stage_blocks=[{layers},1]"])
