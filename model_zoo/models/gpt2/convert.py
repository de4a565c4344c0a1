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

import numpy as np

from model_zoo.models.base import folder_name
from model_zoo.errors import ConfigError, DataError
from model_zoo import huggingface
from model_zoo.huggingface import (CONFIG_FILE, DATASET_SUBDIR, TensorSource,
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
    """Convert the Hugging Face GPT-2 folder `hf_dir`; returns (config_path, ckpt_path).

    Raises DataError for a missing folder or an unusable config.json, CheckpointError for
    missing, unreadable or mismatched weights and for an existing OUT/model.ckpt (unless
    `overwrite`). Nothing is written before everything has been read and checked.
    """
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
    if problems:
        raise DataError(f"{path!r} uses GPT-2 options this model does not support: "
                        + "; ".join(problems))


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face GPT-2 config dict (validated)."""
    from model_zoo.config import config_from_dict

    raw = {
        "model": {
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
        },
        "parallel": {},
        "train": {},
        "data": {"dataset_dir": dataset_dir},
    }
    try:
        return config_from_dict(raw, origin=origin)
    except ConfigError as err:
        raise DataError(f"{origin!r} does not give a valid GPT-2 config: {err}") from None


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
    take = source.take
    hidden, layers = hf_config["n_embd"], hf_config["n_layer"]
    vocab, positions = hf_config["vocab_size"], hf_config["n_positions"]
    inner = hf_config["n_inner"] or 4 * hidden
    heads = hf_config["n_head"]

    def linear(name, n_in, n_out):
        """Conv1D [in, out] -> Linear [out, in], and its bias."""
        weight = take(f"{name}.weight", (n_in, n_out))
        bias = take(f"{name}.bias", (n_out,))
        return np.ascontiguousarray(weight.T), bias

    params = {
        PREFIX + "wte.embedding_table": take("wte.weight", (vocab, hidden)),
        PREFIX + "wpe.embedding_table": take("wpe.weight", (positions, hidden)),
    }
    for i in range(layers):
        block = f"{PREFIX}blocks.{i}."
        params[block + "ln_1.gamma"] = take(f"h.{i}.ln_1.weight", (hidden,))
        params[block + "ln_1.beta"] = take(f"h.{i}.ln_1.bias", (hidden,))
        qkv_weight = take(f"h.{i}.attn.c_attn.weight", (hidden, 3 * hidden))
        qkv_bias = take(f"h.{i}.attn.c_attn.bias", (3 * hidden,))
        # c_attn holds [q | k | v] by columns; ours is laid out head by head
        parts = [slice(j * hidden, (j + 1) * hidden) for j in range(3)]
        params[block + "attention.qkv.weight"] = fuse_head_projections(
            [qkv_weight[:, cols].T for cols in parts], heads)
        params[block + "attention.qkv.bias"] = fuse_head_projections(
            [qkv_bias[cols] for cols in parts], heads)
        (params[block + "attention.output.weight"],
         params[block + "attention.output.bias"]) = linear(f"h.{i}.attn.c_proj", hidden, hidden)
        params[block + "ln_2.gamma"] = take(f"h.{i}.ln_2.weight", (hidden,))
        params[block + "ln_2.beta"] = take(f"h.{i}.ln_2.bias", (hidden,))
        (params[block + "mlp.expand.weight"],
         params[block + "mlp.expand.bias"]) = linear(f"h.{i}.mlp.c_fc", hidden, inner)
        (params[block + "mlp.project.weight"],
         params[block + "mlp.project.bias"]) = linear(f"h.{i}.mlp.c_proj", inner, hidden)
    params[PREFIX + "ln_f.gamma"] = take("ln_f.weight", (hidden,))
    params[PREFIX + "ln_f.beta"] = take("ln_f.bias", (hidden,))

    source.check_all_used(("wte.", "wpe.", "h.", "ln_f."), f"n_layer={layers}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}


def to_hf(config, network) -> tuple:
    """`model-zoo convert gpt2 --to-hf`: (config.json of a GPT2LMHeadModel, its tensors)
    for our network, the inverse of `map_weights` (the head stays tied to `wte`)."""
    model = config.model
    params = huggingface.parameters_of(network)
    hidden, heads = model.hidden_size, model.num_heads
    tensors = {"transformer.wte.weight": params[PREFIX + "wte.embedding_table"],
               "transformer.wpe.weight": params[PREFIX + "wpe.embedding_table"],
               "transformer.ln_f.weight": params[PREFIX + "ln_f.gamma"],
               "transformer.ln_f.bias": params[PREFIX + "ln_f.beta"]}
    for i in range(model.num_layers):
        ours, theirs = f"{PREFIX}blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            tensors[f"{theirs}{norm}.weight"] = params[f"{ours}{norm}.gamma"]
            tensors[f"{theirs}{norm}.bias"] = params[f"{ours}{norm}.beta"]
        # head by head -> [q | k | v] by columns, and every Linear [out, in] -> Conv1D [in, out]
        q_k_v = split_head_projections(params[ours + "attention.qkv.weight"], heads, 3)
        tensors[theirs + "attn.c_attn.weight"] = np.concatenate([w.T for w in q_k_v], axis=1)
        tensors[theirs + "attn.c_attn.bias"] = np.concatenate(
            split_head_projections(params[ours + "attention.qkv.bias"], heads, 3))
        for ours_name, theirs_name in (("attention.output", "attn.c_proj"),
                                       ("mlp.expand", "mlp.c_fc"),
                                       ("mlp.project", "mlp.c_proj")):
            tensors[f"{theirs}{theirs_name}.weight"] = params[f"{ours}{ours_name}.weight"].T
            tensors[f"{theirs}{theirs_name}.bias"] = params[f"{ours}{ours_name}.bias"]
    hf_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": model.vocab_size, "n_positions": model.seq_length, "n_embd": hidden,
        "n_layer": model.num_layers, "n_head": heads,
        "n_inner": model.ffn_hidden_size or None, "activation_function": "gelu_new",  # 0: 4 x
        "resid_pdrop": model.dropout, "embd_pdrop": model.dropout,
        "attn_pdrop": model.attention_dropout, "layer_norm_epsilon": model.layer_norm_eps,
        "initializer_range": model.init_std, "tie_word_embeddings": True,
        "bos_token_id": None, "eos_token_id": None,
    }
    return hf_config, tensors


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert gpt2`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face GPT-2 folder (config.json and model.safetensors or "
                "pytorch_model.bin, as written by save_pretrained)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert gpt2` (either way); returns the exit status."""
    return huggingface.run_convert(args, convert_hf_gpt2, to_hf)
