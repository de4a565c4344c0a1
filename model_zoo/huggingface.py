"""Reading Hugging Face `save_pretrained` folders for the converters.

A model's `convert.py` maps a folder written by `save_pretrained` (`config.json` plus
`model.safetensors` or `pytorch_model.bin`, or their sharded `.index.json` forms) onto its
own parameters. What does not depend on the model lives here: reading config.json, finding
and loading the weights as float32 numpy arrays, the kinds of entry of a converter's name
table and reading a table both ways, and writing the converted checkpoint and config whole
or not at all. The model-specific defaults, checks and name table stay in each model's
`convert.py`.
"""

import json
import os
from dataclasses import dataclass

import numpy as np

from model_zoo.errors import CheckpointError, ConfigError, DataError, UserInputError
from model_zoo.nn.attention import fuse_head_projections, split_head_projections

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
CHECKPOINT_FILE = "model.ckpt"
CONFIG_YAML = "config.yaml"
# The converted config's data.dataset_dir, inside the output dir: it holds the imported
# tokenizer (tokenizer.json) when the Hugging Face folder has one, and a dataset built
# there with that tokenizer (`model-zoo data ... --tokenizer hf:DIR`) for fine-tuning.
DATASET_SUBDIR = "dataset"


def read_hf_config(hf_dir: str, model_type: str, model_name: str):
    """The raw config.json of the folder `hf_dir` as a dict, and its path.

    DataError if the folder or its config.json is missing or unreadable, or if its
    `model_type` is not `model_type` (or one of a tuple of them; `model_name` is how the
    message names the model).
    """
    if not os.path.isdir(hf_dir):
        raise DataError(f"Hugging Face model directory {hf_dir!r} does not exist")
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise DataError(f"{path!r} does not exist: {hf_dir!r} is not a Hugging Face model "
                        "directory (expected config.json written by save_pretrained)")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path!r} is not a readable JSON file: {err}") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path!r} must hold a JSON object")
    expected = model_type if isinstance(model_type, tuple) else (model_type,)
    if raw.get("model_type") not in expected:
        raise DataError(f"{path!r} is not a {model_name} config: model_type is "
                        f"{raw.get('model_type')!r}, expected "
                        f"{' or '.join(map(repr, expected))}")
    return raw, path


def refuse_unsupported(problems: list, path: str, model_name: str):
    """DataError listing the options of config.json `path` the model does not implement."""
    if problems:
        raise DataError(f"{path!r} uses {model_name} options this model does not support: "
                        + "; ".join(problems))


def project_config(model: dict, origin: str, dataset_dir: str, model_name: str):
    """The project's full validated `Config` whose `model` section is `model` (the rest
    defaults, the dataset in `dataset_dir`); DataError naming `origin` if it is invalid."""
    from model_zoo.config import config_from_dict

    raw = {"model": model, "parallel": {}, "train": {}, "data": {"dataset_dir": dataset_dir}}
    try:
        return config_from_dict(raw, origin=origin)
    except ConfigError as err:
        raise DataError(f"{origin!r} does not give a valid {model_name} config: {err}") from None


def output_paths(output_dir: str, overwrite: bool = False):
    """(config_path, ckpt_path) of a conversion into `output_dir`.

    CheckpointError if the checkpoint already exists and `overwrite` is false.
    """
    ckpt_path = os.path.join(output_dir, CHECKPOINT_FILE)
    config_path = os.path.join(output_dir, CONFIG_YAML)
    if os.path.exists(ckpt_path) and not overwrite:
        raise CheckpointError(f"{ckpt_path!r} already exists: pass --overwrite to replace it")
    return config_path, ckpt_path


def write_converted(params: dict, config, config_path: str, ckpt_path: str):
    """Write `params` ({name: array}) to `ckpt_path` atomically, then `config` as YAML."""
    write_checkpoint(params, ckpt_path)
    from model_zoo.config import save_config
    save_config(config, config_path)


def write_checkpoint(params: dict, ckpt_path: str):
    """Save `params` ({name: array}) as a MindSpore checkpoint via a temporary file."""
    import mindspore as ms

    output_dir = os.path.dirname(ckpt_path)
    os.makedirs(output_dir or ".", exist_ok=True)
    # save_checkpoint appends ".ckpt" to names without it, so the temporary name ends in it.
    tmp = os.path.join(output_dir, f".{os.path.basename(ckpt_path)}.tmp.ckpt")
    try:
        ms.save_checkpoint([{"name": name, "data": ms.Tensor(value)}
                            for name, value in params.items()], tmp)
        os.replace(tmp, ckpt_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def add_convert_arguments(parser, folder: str):
    """The arguments every `model-zoo convert MODEL` takes; `folder` describes --hf-dir."""
    parser.add_argument("--hf-dir", help=folder + " (to import it)")
    parser.add_argument("--to-hf", action="store_true",
                        help="the other way: write --ckpt of --config as a Hugging Face "
                             "folder (config.json and model.safetensors)")
    parser.add_argument("--config", help="with --to-hf: the checkpoint's YAML config")
    parser.add_argument("--ckpt", help="with --to-hf: the checkpoint to export")
    parser.add_argument("--output-dir", required=True,
                        help="where to write model.ckpt and config.yaml (with --to-hf: the "
                             "Hugging Face folder)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing OUTPUT_DIR/model.ckpt")
    return parser


def import_folder(hf_dir: str, output_dir: str, overwrite: bool, read_config, build_config,
                  map_weights):
    """A converter's import of the Hugging Face folder `hf_dir`: `read_config(hf_dir)` ->
    (config dict, its path), `build_config(that dict, path, dataset_dir=...)` -> the
    project's Config, `map_weights(tensors, config dict, weight file)` -> {name: array};
    returns (config_path, ckpt_path).

    Raises DataError for a missing folder or an unusable config.json, CheckpointError for
    missing, unreadable or mismatched weights and for an existing OUT/model.ckpt (unless
    `overwrite`). Nothing is written before everything has been read and checked."""
    hf_config, config_file = read_config(hf_dir)
    config = build_config(hf_config, config_file,
                          dataset_dir=os.path.join(output_dir, DATASET_SUBDIR))
    config_path, ckpt_path = output_paths(output_dir, overwrite)
    tensors, weight_file = read_weights(hf_dir)
    write_converted(map_weights(tensors, hf_config, weight_file), config, config_path,
                    ckpt_path)
    return config_path, ckpt_path


def run_convert(args, from_hf, to_hf) -> int:
    """`model-zoo convert MODEL`: `from_hf(hf_dir, output_dir, overwrite)` ->
    (config_path, ckpt_path), or with --to-hf `to_hf(config, network)` -> (config.json
    dict, {Hugging Face name: array}) written to --output-dir."""
    if not args.to_hf:
        if not args.hf_dir:
            raise UserInputError("give --hf-dir to import a Hugging Face folder, or --to-hf "
                                 "--config CONFIG --ckpt CKPT to export one")
        config_path, ckpt_path = from_hf(args.hf_dir, args.output_dir, args.overwrite)
        report_converted(config_path, ckpt_path)
        return report_tokenizer(args.hf_dir, os.path.join(args.output_dir, DATASET_SUBDIR))
    missing = [flag for flag, value in (("--config", args.config), ("--ckpt", args.ckpt))
               if not value]
    if missing or args.hf_dir:
        raise UserInputError("--to-hf takes --config and --ckpt (and no --hf-dir)")
    from model_zoo.config import load_config
    from model_zoo.checkpoint.files import load_network
    config = load_config(args.config)
    hf_config, tensors = to_hf(config, load_network(config, args.ckpt))
    write_hf_folder(args.output_dir, hf_config, tensors, args.overwrite)
    print(f"wrote {os.path.join(args.output_dir, CONFIG_FILE)} and "
          f"{os.path.join(args.output_dir, SAFETENSORS_FILE)}")
    return 0


def write_hf_folder(output_dir: str, hf_config: dict, tensors: dict, overwrite: bool = False):
    """A `save_pretrained`-style folder: config.json and model.safetensors (metadata format
    "pt", which `transformers` expects), both renamed into place once written."""
    from safetensors.numpy import save_file
    from model_zoo.files import write_atomically
    weights = os.path.join(output_dir, SAFETENSORS_FILE)
    if os.path.exists(weights) and not overwrite:
        raise CheckpointError(f"{weights!r} already exists: pass --overwrite to replace it")
    os.makedirs(output_dir, exist_ok=True)
    partial = weights + ".tmp"
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, partial,
              metadata={"format": "pt"})
    os.replace(partial, weights)
    write_atomically(os.path.join(output_dir, CONFIG_FILE),
                     json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def parameters_of(network) -> dict:
    """{parameter name: float32 numpy value} of a network (what the exporters map)."""
    return {param.name: param.asnumpy().astype(np.float32) for param in network.get_parameters()}


def report_converted(config_path: str, ckpt_path: str) -> int:
    """What `model-zoo convert` prints when it is done; returns the exit status."""
    print(f"wrote {ckpt_path}")
    print(f"wrote {config_path}")
    return 0


def report_tokenizer(hf_dir: str, dataset_dir: str) -> int:
    """Import the Hugging Face folder's tokenizer into the converted dataset directory (so
    prompts and masks can be given as text) and say so; returns the exit status."""
    from model_zoo.data.tokenizer import import_hf_tokenizer
    try:
        print(f"wrote {import_hf_tokenizer(hf_dir, dataset_dir)}")
    except DataError as error:
        print(f"no tokenizer imported ({error}): give prompts as token ids")
    return 0


# A converter's name table is a list of entries, each one of our parameters and the Hugging
# Face tensor(s) it is made of; `take_table` reads a table one way, `give_table` the other.

@dataclass(frozen=True)
class Same:
    """One of ours is one of theirs (of `shape`) as it is."""

    ours: str
    theirs: str
    shape: tuple

    def take(self, take, prefix: str):
        return take(prefix + self.theirs, self.shape)

    def give(self, value, prefix: str) -> dict:
        return {prefix + self.theirs: value}


@dataclass(frozen=True)
class Transposed(Same):
    """One of ours [out, in] is one of theirs stored [in, out] (`shape`: GPT-2's Conv1D)."""

    def take(self, take, prefix: str):
        return np.ascontiguousarray(take(prefix + self.theirs, self.shape).T)

    def give(self, value, prefix: str) -> dict:
        return {prefix + self.theirs: np.ascontiguousarray(value.T)}


@dataclass(frozen=True)
class Fused:
    """One of ours fuses several of theirs (each of `shape`) head by head over `heads` groups
    (`fuse_head_projections`), so that a column split over mp gives each device whole heads
    with all their parts: k and v as `key_value`, gate and up as `gate_up`."""

    ours: str
    theirs: tuple
    shape: tuple
    heads: int

    def take(self, take, prefix: str):
        return fuse_head_projections([take(prefix + name, self.shape) for name in self.theirs],
                                     self.heads)

    def give(self, value, prefix: str) -> dict:
        parts = split_head_projections(value, self.heads, len(self.theirs))
        return {prefix + name: part for name, part in zip(self.theirs, parts)}


@dataclass(frozen=True)
class Stacked:
    """One of ours (count, in, out) stacks `count` of theirs, each [out, in] of `shape` and
    named `theirs.format(index)`: a MoE layer's experts."""

    ours: str
    theirs: str
    shape: tuple
    count: int

    def take(self, take, prefix: str):
        return np.stack([np.asarray(take(prefix + self.theirs.format(index), self.shape)).T
                         for index in range(self.count)])

    def give(self, value, prefix: str) -> dict:
        return {prefix + self.theirs.format(index): np.ascontiguousarray(matrix.T)
                for index, matrix in enumerate(value)}


def take_table(take, table: list, ours: str = "", theirs: str = "") -> dict:
    """{our name: value} of every entry of `table`, its tensors read with `take(name,
    shape)`; `ours` and `theirs` prefix the table's names."""
    return {ours + entry.ours: entry.take(take, theirs) for entry in table}


def give_table(params: dict, table: list, ours: str = "", theirs: str = "") -> dict:
    """The inverse of `take_table`: {Hugging Face name: array} of our `params`."""
    tensors = {}
    for entry in table:
        tensors.update(entry.give(params[ours + entry.ours], theirs))
    return tensors


class TensorSource:
    """A Hugging Face checkpoint's tensors as a converter takes them one by one: `take`
    checks each name and shape, `check_all_used` that no tensor the config does not account
    for is left over. Errors name tensors as `display(name)` (Hugging Face's own names)."""

    def __init__(self, tensors: dict, weight_file: str, display=lambda name: name):
        self.tensors, self.weight_file, self.display = tensors, weight_file, display
        self.used = set()

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __getitem__(self, name):
        return self.tensors[name]

    def take(self, name: str, shape) -> np.ndarray:
        """The tensor `name`, which must have `shape`; CheckpointError otherwise."""
        if name not in self.tensors:
            raise CheckpointError(f"weight file {self.weight_file!r} lacks the tensor "
                                  f"{self.display(name)!r}")
        value = self.tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"tensor {self.display(name)!r} in {self.weight_file!r} has "
                                  f"shape {tuple(value.shape)}, expected {tuple(shape)} from "
                                  f"{CONFIG_FILE}")
        self.used.add(name)
        return value

    def mark_used(self, name: str):
        """Count `name` as converted (a tied copy checked by hand)."""
        self.used.add(name)

    def check_all_used(self, prefixes: tuple, layers: str):
        """CheckpointError naming the first tensor under `prefixes` nothing took; `layers`
        names the config's layer count (the usual cause)."""
        unexpected = sorted(name for name in self.tensors
                            if name.startswith(prefixes) and name not in self.used)
        if unexpected:
            raise CheckpointError(f"weight file {self.weight_file!r} has tensors {CONFIG_FILE} "
                                  f"does not account for, e.g. {self.display(unexpected[0])!r} "
                                  f"({layers})")


def read_weights(hf_dir: str, floating_only: bool = False):
    """All tensors of the folder as float32 numpy arrays, and the file (or index) read.

    With `floating_only`, tensors that are not floating point (integer buffers) are skipped.
    """
    def safetensors_loader(path):
        return load_safetensors(path, floating_only)

    def torch_loader(path):
        return load_torch(path, floating_only)

    candidates = [
        (SAFETENSORS_FILE, safetensors_loader),
        ("model.safetensors.index.json", None),
        ("pytorch_model.bin", torch_loader),
        ("pytorch_model.bin.index.json", None),
    ]
    for name, loader in candidates:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            continue
        if loader is not None:
            return loader(path), path
        shard_loader = safetensors_loader if name.startswith("model.") else torch_loader
        return load_sharded(path, shard_loader), path
    raise CheckpointError(f"no weight file in {hf_dir!r}: expected model.safetensors or "
                          "pytorch_model.bin (or their .index.json for sharded weights)")


def load_sharded(index_path: str, loader) -> dict:
    """The tensors of every shard named by the `.index.json` file, each read by `loader`."""
    try:
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"weight index {index_path!r} cannot be read: {err}") from None
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(os.path.dirname(index_path), shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(f"weight shard {shard_path!r} named by {index_path!r} "
                                  "does not exist")
        tensors.update(loader(shard_path))
    return tensors


def load_safetensors(path: str, floating_only: bool = False) -> dict:
    """The tensors of a .safetensors file as float32 numpy arrays."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise CheckpointError(f"reading {path!r} needs the safetensors package "
                              "(pip install safetensors)") from None
    try:
        loaded = load_file(path)
    except Exception as err:  # safetensors raises its own error types on bad files
        raise CheckpointError(f"weight file {path!r} cannot be read: {first_line(err)}") from None
    return {name: np.asarray(value, dtype=np.float32) for name, value in loaded.items()
            if not floating_only or np.issubdtype(value.dtype, np.floating)}


def load_torch(path: str, floating_only: bool = False) -> dict:
    """The tensors of a pytorch_model.bin state dict as float32 numpy arrays."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"reading {path!r} needs PyTorch; convert it to "
                              "model.safetensors or install torch") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle/zip errors of all kinds
        raise CheckpointError(f"weight file {path!r} cannot be read: {first_line(err)}") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"weight file {path!r} does not hold a state dict")
    return {name: value.detach().to(torch.float32).numpy()
            for name, value in loaded.items()
            if isinstance(value, torch.Tensor)
            and (not floating_only or value.is_floating_point())}


def first_line(err: Exception) -> str:
    """The first line of an exception's message, or its type name if it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
