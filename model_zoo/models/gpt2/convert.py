"""Convert a Hugging Face GPT-2 folder into this project's checkpoint and config.

`model-zoo convert gpt2 --hf-dir DIR --output-dir OUT` reads a folder written by
`save_pretrained` (`config.json` plus `model.safetensors` or `pytorch_model.bin`, sharded
or not) and writes `OUT/model.ckpt`, named like the parameters of `GPT2ForTraining`, and
`OUT/config.yaml`, a full validated config whose `model` section describes the same network.
`model-zoo convert gpt2 --to-hf --config CONFIG --ckpt CKPT --output-dir DIR` goes the other
way (`to_hf`): a folder `GPT2LMHeadModel.from_pretrained` loads.

Hugging Face's Conv1D stores weights as [in, out]; this project's Linear stores [out, in],
so every projection is transposed, and the fused `c_attn` [H, 3H], whose columns are
[q | k | v], is laid out head by head for the fused `attention.qkv` projection
(`attention.fuse_head_projections`). The language-model head is tied to the token embedding, so
`lm_head.weight` is not stored.
"""

from dataclasses import dataclass

import numpy as np

from model_zoo.models.base import folder_name
from model_zoo import huggingface
from model_zoo.huggingface import (CONFIG_FILE, DATASET_SUBDIR, Same, TensorSource, Transposed,
                                   read_hf_config)
from model_zoo.nn.attention import fuse_head_projections, split_head_projections

PREFIX = "lm.transformer."

# Defaults of transformers.GPT2Config, for keys a config.json may omit.
HF_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1,
    "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    "add_cross_attention": False, "tie_word_embeddings": True,
}
# Hugging Face's generic names for the same keys (GPT2Config.attribute_map).
HF_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
              "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
# Both are the tanh approximation of GELU, which is what the model computes.
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Buffers and heads that carry no transformer weight.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def convert_hf_gpt2(hf_dir: str, output_dir: str, overwrite: bool = False):
    """Convert the Hugging Face GPT-2 folder `hf_dir` as `huggingface.import_folder`
    does; returns (config_path, ckpt_path)."""
    return huggingface.import_folder(hf_dir, output_dir, overwrite, _read_hf_config,
                                     build_config, map_weights)


def _read_hf_config(hf_dir: str):
    raw, path = read_hf_config(hf_dir, "gpt2", "GPT-2")
    config = dict(HF_DEFAULTS)
    for alias, key in HF_ALIASES.items():
        if alias in raw and key not in raw:
            config[key] = raw[alias]
    config.update({k: v for k, v in raw.items() if k not in HF_ALIASES})
    _check_supported(config, path)
    return config, path


def _check_supported(config: dict, path: str):
    """DataError for options the model does not implement."""
    problems = []
    if config["activation_function"] not in SUPPORTED_ACTIVATIONS:
        problems.append(f"activation_function={config['activation_function']!r} (only "
                        f"{' or '.join(SUPPORTED_ACTIVATIONS)}, the tanh GELU, is supported)")
    if not config["scale_attn_weights"]:
        problems.append("scale_attn_weights=false (attention is always scaled by "
                        "1/sqrt(head_dim))")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                "add_cross_attention"):
        if config[key]:
            problems.append(f"{key}=true")
    if not config["tie_word_embeddings"]:
        problems.append("tie_word_embeddings=false (the head is tied to the token embedding)")
    huggingface.refuse_unsupported(problems, path, "GPT-2")


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face GPT-2 config dict (validated)."""
    return huggingface.project_config({
        "name": folder_name(__name__),
        "num_layers": hf_config["n_layer"],
        "hidden_size": hf_config["n_embd"],
        "num_heads": hf_config["n_head"],
        "seq_length": hf_config["n_positions"],
        "vocab_size": hf_config["vocab_size"],
        "ffn_hidden_size": hf_config["n_inner"] or 0,
        "layer_norm_eps": hf_config["layer_norm_epsilon"],
        "dropout": hf_config["resid_pdrop"],
        "attention_dropout": hf_config["attn_pdrop"],
        "init_std": hf_config.get("initializer_range", 0.02),
    }, origin, dataset_dir, "GPT-2")


@dataclass(frozen=True)
class ColumnsByHead:
    """Ours, laid out head by head, is one of theirs whose last axis is `parts` projections
    side by side (c_attn's columns [q | k | v], weight [in, 3 out] or bias [3 out])."""

    ours: str
    theirs: str
    shape: tuple
    heads: int
    parts: int = 3

    def take(self, take, prefix: str):
        fused = take(prefix + self.theirs, self.shape)
        return fuse_head_projections([part.T for part in np.split(fused, self.parts, axis=-1)],
                                     self.heads)

    def give(self, value, prefix: str) -> dict:
        parts = split_head_projections(value, self.heads, self.parts)
        return {prefix + self.theirs: np.concatenate([part.T for part in parts], axis=-1)}


def name_table(config: dict) -> list:
    """Which of our parameters (under `lm.transformer.`) is which of the Hugging Face
    tensors (under `transformer.`), for a read config.json; every projection is a Conv1D
    [in, out] there."""
    hidden, heads = config["n_embd"], config["n_head"]
    inner = config["n_inner"] or 4 * hidden
    table = [Same("wte.embedding_table", "wte.weight", (config["vocab_size"], hidden)),
             Same("wpe.embedding_table", "wpe.weight", (config["n_positions"], hidden))]
    for i in range(config["n_layer"]):
        ours, theirs = f"blocks.{i}.", f"h.{i}."
        table += [Same(f"{ours}{norm}.{ours_name}", f"{theirs}{norm}.{their_name}", (hidden,))
                  for norm in ("ln_1", "ln_2")
                  for ours_name, their_name in (("gamma", "weight"), ("beta", "bias"))]
        table += [ColumnsByHead(ours + "attention.qkv.weight", theirs + "attn.c_attn.weight",
                                (hidden, 3 * hidden), heads),
                  ColumnsByHead(ours + "attention.qkv.bias", theirs + "attn.c_attn.bias",
                                (3 * hidden,), heads)]
        for ours_name, their_name, n_in, n_out in (
                ("attention.output", "attn.c_proj", hidden, hidden),
                ("mlp.expand", "mlp.c_fc", hidden, inner),
                ("mlp.project", "mlp.c_proj", inner, hidden)):
            table += [Transposed(f"{ours}{ours_name}.weight", f"{theirs}{their_name}.weight",
                                 (n_in, n_out)),
                      Same(f"{ours}{ours_name}.bias", f"{theirs}{their_name}.bias", (n_out,))]
    return table + [Same("ln_f.gamma", "ln_f.weight", (hidden,)),
                    Same("ln_f.beta", "ln_f.bias", (hidden,))]


def map_weights(tensors: dict, hf_config: dict, weight_file: str = "<weights>") -> dict:
    """Hugging Face GPT-2 tensors (numpy) -> {project parameter name: float32 array}.

    Keys may carry the `transformer.` prefix or not. CheckpointError names the first
    missing, misshapen or unexpected transformer tensor.
    """
    short_names = {}
    for key, value in tensors.items():
        short = key[len("transformer."):] if key.startswith("transformer.") else key
        if not short.endswith(IGNORED_SUFFIXES):
            short_names[short] = value
    source = TensorSource(short_names, weight_file, lambda name: "transformer." + name)
    params = huggingface.take_table(source.take, name_table(hf_config), ours=PREFIX)
    source.check_all_used(("wte.", "wpe.", "h.", "ln_f."), f"n_layer={hf_config['n_layer']}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}


def to_hf(config, network) -> tuple:
    """`model-zoo convert gpt2 --to-hf`: (config.json of a GPT2LMHeadModel, its tensors)
    for our network, the inverse of `map_weights` (the head stays tied to `wte`)."""
    model = config.model
    hf_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": model.vocab_size, "n_positions": model.seq_length,
        "n_embd": model.hidden_size, "n_layer": model.num_layers, "n_head": model.num_heads,
        "n_inner": model.ffn_hidden_size or None, "activation_function": "gelu_new",  # 0: 4 x
        "resid_pdrop": model.dropout, "embd_pdrop": model.dropout,
        "attn_pdrop": model.attention_dropout, "layer_norm_epsilon": model.layer_norm_eps,
        "initializer_range": model.init_std, "tie_word_embeddings": True,
        "bos_token_id": None, "eos_token_id": None,
    }
    tensors = huggingface.give_table(huggingface.parameters_of(network), name_table(hf_config),
                                     ours=PREFIX, theirs="transformer.")
    return hf_config, tensors


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert gpt2`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face GPT-2 folder (config.json and model.safetensors or "
                "pytorch_model.bin, as written by save_pretrained)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert gpt2` (either way); returns the exit status."""
    return huggingface.run_convert(args, convert_hf_gpt2, to_hf)
