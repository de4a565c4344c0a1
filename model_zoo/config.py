"""Typed configuration: YAML with sections `model`, `parallel`, `train` and `data`.

The `model` and `data` sections are typed by the model folder named in `model.name`
(its `ModelConfig` and `DataConfig`), so a copied model folder brings its own keys.
Unknown keys, wrong types and bad values raise ConfigError naming the key.
"""

import dataclasses
import importlib
import math
import os
import pkgutil
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

import yaml

from model_zoo.errors import ConfigError
from model_zoo.files import check_file, write_atomically
from model_zoo.parallel.config import ParallelConfig

SECTIONS = ("model", "parallel", "train", "data")


@dataclass
class ModelConfig:
    """Keys every model has; a model folder extends this with its own."""

    name: str = ""
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 2
    seq_length: int = 64
    vocab_size: int = 1000
    # attention through Ascend 910B's FlashAttentionScore: no (seq, seq) tensor is kept
    # (attention.MultiHeadAttention, `flash`); refused on CPU
    flash_attention: bool = False
    # the feed-forward width; 0: the model's rule (`ffn_size`)
    ffn_hidden_size: int = 0

    def validate(self):
        for key in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size"):
            _check_positive(self, "model", key)
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_heads={self.num_heads}")
        if self.ffn_hidden_size < 0:
            raise ConfigError(f"model.ffn_hidden_size must be >= 0, got {self.ffn_hidden_size}")

    @property
    def ffn_size(self) -> int:
        """The feed-forward width: ffn_hidden_size, else 4 x hidden_size."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def pipeline_blocks(self) -> int:
        """The blocks the pipeline stages share (`parallel.stage_blocks` adds up to it)."""
        return self.num_layers

    def check_fractions(self, *keys):
        """Rates such as dropout must lie in [0, 1); ConfigError naming the key."""
        check_fractions(self, "model", keys)


@dataclass
class DataConfig:
    """Where a model's dataset lives; a model folder extends this with its own keys."""

    dataset_dir: str = ""
    shuffle: bool = True

    def validate(self):
        if not self.dataset_dir:
            raise ConfigError("data.dataset_dir is empty: give the directory of the dataset")
        # read on every load, also when the dataset is already built and the key unused
        if hasattr(self, "heldout_fraction"):
            check_fractions(self, "data", ["heldout_fraction"])


def check_fractions(section_obj, section: str, keys):
    """Each of `keys` of the section must lie in [0, 1); ConfigError naming the key."""
    for key in keys:
        value = getattr(section_obj, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{section}.{key} must be in [0, 1), got {value}")


@dataclass
class TrainConfig:
    """The optimisation loop: steps, batch, AdamW, schedule, precision, outputs.

    init_checkpoint: weights to start from (e.g. a pretrained model to fine-tune); the
    parameters it lacks (a new head) keep their initialisation. A full checkpoint, or for a
    sharded run also a sliced directory (`model-zoo checkpoint split`) of any layout.
    lr_schedule_steps: the length of the cosine schedule; 0 means `steps`. A resumed run
    keeps the length of the run it continues, so `--resume --set train.steps=N` extends the
    run at the floor learning rate instead of re-stretching the cosine (the lr would jump).
    checkpoint_format: "ckpt" (MindSpore's protobuf) or "safetensors" (which MindSpore 2.10
    reads and writes too, and which MindFormers is moving to); --resume reads either.
    max_bad_steps: how many bad steps in a row are skipped (not applied) before the run
    stops with a checkpoint to resume from: a non-finite loss or gradient (fp16 overflows
    excepted while the loss scale absorbs them, above its floor of 1), or a loss spike.
    loss_spike_factor: a step whose loss is above this many times the running average of
    the applied steps' losses is a spike (0: no spike check), as MindFormers skips steps by
    global norm (`use_skip_data_by_global_norm`).
    dataset_sink: feed the batches through MindSpore's device data queue, a sink of steps
    per call (dataset sink mode, as PanGu-alpha and MindFormers train on Ascend); null (the
    default) sinks on Ascend and not on CPU, where MindSpore has no device queue (`true`
    there runs the same Model.train path fed from the host). See `loop.sink_size_of`.
    """

    steps: int = 100
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "fp32"
    loss_scale: float = 65536.0
    loss_scale_window: int = 1000
    grad_accumulation: int = 1
    save_steps: int = 100
    keep_checkpoints: int = 3
    log_steps: int = 10
    eval_steps: int = 0     # held-out evaluation every this many steps (0: at the end only)
    seed: int = 1
    device_target: str = "auto"
    init_checkpoint: str = ""
    lr_schedule_steps: int = 0
    checkpoint_format: str = "ckpt"
    max_bad_steps: int = 10
    loss_spike_factor: float = 0.0
    dataset_sink: Optional[bool] = None

    @property
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule spans."""
        return self.lr_schedule_steps or self.steps

    def validate(self):
        for key in ("steps", "global_batch_size", "save_steps", "keep_checkpoints",
                    "log_steps", "grad_accumulation", "loss_scale_window"):
            _check_positive(self, "train", key)
        for key in ("lr", "loss_scale"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key} must be > 0, got {getattr(self, key)}")
        for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "lr_schedule_steps",
                    "eval_steps", "max_bad_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.loss_spike_factor != 0 and not self.loss_spike_factor > 1:
            raise ConfigError(f"train.loss_spike_factor must be 0 (off) or above 1, got "
                              f"{self.loss_spike_factor}")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}")
        _check_choice(self, "train", "precision", ("fp32", "fp16", "bf16"))
        _check_choice(self, "train", "lr_schedule", ("cosine", "inverse_sqrt"))
        _check_choice(self, "train", "checkpoint_format", ("ckpt", "safetensors"))
        _check_choice(self, "train", "device_target", ("auto", "CPU", "Ascend"))
        if self.init_checkpoint and os.path.isdir(self.init_checkpoint):
            from model_zoo.parallel.strategy_file import STRATEGY_FILE
            if not os.path.isfile(os.path.join(self.init_checkpoint, STRATEGY_FILE)):
                raise ConfigError(f"train.init_checkpoint: {self.init_checkpoint!r} is a "
                                  f"directory without {STRATEGY_FILE}, not a sliced checkpoint "
                                  f"(write one with `model-zoo checkpoint split`)")
        elif self.init_checkpoint:
            check_file(self.init_checkpoint, "train.init_checkpoint", ConfigError, empty_ok=False)


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self):
        for section in SECTIONS:
            getattr(self, section).validate()
        self.parallel.check_batch(self.train.global_batch_size, self.train.grad_accumulation)
        self.parallel.check_sequence_split(
            self.parallel.micro_batch_size(self.train.global_batch_size,
                                           self.train.grad_accumulation),
            self.model.seq_length)
        self.parallel.recomputed_blocks(self.model.pipeline_blocks)   # and stage_blocks
        self.parallel.block_chunks(self.model.pipeline_blocks)        # and the interleave

    def to_dict(self) -> dict:
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}


def available_models() -> List[str]:
    """Model folders: every sub-package of model_zoo/models with a model.py (found without
    importing them)."""
    import model_zoo.models
    root = model_zoo.models.__path__[0]
    return sorted(info.name for info in pkgutil.iter_modules(model_zoo.models.__path__)
                  if info.ispkg and os.path.exists(os.path.join(root, info.name, "model.py")))


def import_model(name: str):
    """The hooks of the model folder `model_zoo/models/<name>`: its `tasks` module
    (models/base.py); ConfigError if there is no such folder."""
    known = available_models()
    if name not in known:
        raise ConfigError(f"model.name={name!r} is not a model folder under model_zoo/models/ "
                          f"(found: {', '.join(known) or 'none'})")
    return importlib.import_module(f"model_zoo.models.{name}.tasks")


def import_model_commands(name: str):
    """The model folder `name`'s part of the command line: its light `commands` module."""
    return importlib.import_module(f"model_zoo.models.{name}.commands")


def load_config(path: str, overrides: Optional[List[str]] = None,
                layout_checked: bool = True) -> Config:
    """Read a YAML config, apply `a.b=c` overrides, type-check and validate it (the layout
    too unless `layout_checked` is False: `config_from_dict`)."""
    raw = read_yaml(path)
    for override in overrides or []:
        apply_override(raw, override)
    return config_from_dict(raw, path, layout_checked)


def shipped_config(path: str) -> str:
    """`model_zoo/<model>/configs/X.yaml`, the short form of a shipped config, names
    `model_zoo/models/<model>/configs/X.yaml`; any other path is returned as given."""
    parts = os.path.normpath(path).split(os.sep)
    if os.path.exists(path) or len(parts) < 4 or parts[0] != "model_zoo" or \
            parts[2] != "configs":
        return path
    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", *parts[1:])
    return shipped if os.path.exists(shipped) else path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that a mapping repeats (PyYAML keeps the last
    silently, so `lr` written twice would train with the value further down)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> dict:
    path = shipped_config(path)
    check_file(path, "config file", ConfigError)
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.load(handle, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path!r} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping with sections "
                          f"{', '.join(SECTIONS)}")
    return raw


def add_overrides_argument(parser):
    """`--set SECTION.KEY=VALUE [SECTION.KEY=VALUE ...]`, repeatable: config overrides."""
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="override config values, e.g. --set train.steps=100 "
                             "parallel.model_parallel=4 (repeatable)")


def apply_override(raw: dict, override: str):
    """Apply one `section.key=value` override; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value"
                          + (" (give the CONFIG before --set)"
                             if override.endswith((".yaml", ".yml")) else ""))
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {override!r}: the key must be section.key, e.g. train.steps")
    section, key = parts
    if section not in SECTIONS:
        raise ConfigError(f"override {override!r}: unknown section {section!r} "
                          f"(sections: {', '.join(SECTIONS)})")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if raw.get(section) is None:  # an absent or empty (`train:`) section
        raw[section] = {}
    target = raw[section]
    if not isinstance(target, dict):
        raise ConfigError(f"section {section!r} must be a mapping")
    target[key] = value


def config_from_dict(raw: dict, origin: str = "<dict>", layout_checked: bool = True) -> Config:
    """A typed config from its sections, every value and the layout validated. With
    `layout_checked` False only the model and train sections are: the plan reports the
    parallel layout's and the batch's problems itself, all of them in one run."""
    config = typed_config(raw, origin)
    if layout_checked:
        config.validate()
    else:
        config.model.validate()
        config.train.validate()
    return config


def typed_config(raw: dict, origin: str = "<dict>") -> Config:
    """The sections typed key by key (model and data by the model folder), not yet
    validated as a whole: the plan check reports layout problems itself."""
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section {sorted(unknown)[0]!r} in {origin} "
                          f"(sections: {', '.join(SECTIONS)})")
    for section in SECTIONS:
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise ConfigError(f"section {section!r} in {origin} must be a mapping")
    model_raw = raw.get("model") or {}
    name = model_raw.get("name")
    if not name or not isinstance(name, str):
        raise ConfigError(f"model.name is missing in {origin}: name the model folder, e.g. gpt2")
    module = import_model(name)
    config = Config(
        model=build_section(module.ModelConfig, model_raw, "model"),
        parallel=build_section(ParallelConfig, raw.get("parallel") or {}, "parallel"),
        train=build_section(TrainConfig, raw.get("train") or {}, "train"),
        data=build_section(module.DataConfig, raw.get("data") or {}, "data"),
    )
    return config


def build_section(cls, values: dict, section: str):
    """Build the dataclass `cls` from a mapping, checking every key and type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key '{section}.{key}' (known keys: "
                              f"{', '.join(sorted(fields))})")
        hint = typing.get_type_hints(cls)[key]
        kwargs[key] = coerce(value, hint, f"{section}.{key}")
    return cls(**kwargs)


INT32_MAX = 2**31 - 1   # every integer of a config: steps, sizes, seeds


def coerce(value: Any, hint, key: str):
    """Check `value` against a type hint; ints pass as floats, and YAML's '1e-3' strings too."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None:
            return None
        for option in options[:-1]:
            try:
                return coerce(value, option, key)
            except ConfigError:
                continue
        return coerce(value, options[-1], key)
    if origin in (list, List):
        (item,) = typing.get_args(hint) or (Any,)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT32_MAX:
                raise ConfigError(f"{key}={value} is out of range: at most {INT32_MAX} "
                                  f"(MindSpore counts steps and sizes in 32-bit integers)")
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):  # NaN passes every `<`/`>` check
            return number
        if number is not None:
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def save_config(config: Config, path: str):
    """Write the resolved config as YAML (atomically) beside a run's outputs."""
    write_atomically(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


def _check_positive(section_obj, section: str, key: str):
    value = getattr(section_obj, key)
    if value < 1:
        raise ConfigError(f"{section}.{key} must be >= 1, got {value}")


def _check_choice(section_obj, section: str, key: str, choices):
    value = getattr(section_obj, key)
    if value not in choices:
        raise ConfigError(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
