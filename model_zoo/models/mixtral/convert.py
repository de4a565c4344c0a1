"""Convert a Hugging Face Mixtral folder into this project's checkpoint and config, and back.

`model-zoo convert mixtral --hf-dir DIR --output-dir OUT` reads a folder written by
`MixtralForCausalLM.save_pretrained` (`config.json` plus `model.safetensors` or
`pytorch_model.bin`, sharded or not; a tokenizer is carried along) and writes
`OUT/model.ckpt`, named like the parameters of `MixtralForTraining`, and `OUT/config.yaml`.
`model-zoo convert mixtral --to-hf --config CONFIG --ckpt CKPT --output-dir DIR` goes the
other way (`to_hf`).

The attention is LLaMA's (its `k_proj` and `v_proj` fused into `key_value`, head by head);
the experts' projections, one [out, in] matrix per expert in Hugging Face's files
(`block_sparse_moe.experts.<e>.w1` the gate, `w3` the up, `w2` the down projection),
are stacked into one (experts, in, out) tensor each (`gate`, `up`, `down`), and the
router's `gate.weight` (experts, hidden) is `router`.
"""

import numpy as np

from model_zoo import huggingface
from model_zoo.errors import ConfigError, DataError
from model_zoo.huggingface import (CONFIG_FILE, DATASET_SUBDIR, TensorSource,
                                   read_hf_config)
from model_zoo.models.base import folder_name
from model_zoo.nn.attention import fuse_head_projections, split_head_projections

PREFIX = "lm.model."
HEAD = "lm.head.weight"

# Defaults of transformers.MixtralConfig, for keys a config.json may omit.
HF_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1e6,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
    "mlp_bias": False, "head_dim": None, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
}


def convert_hf_mixtral(hf_dir: str, output_dir: str, overwrite: bool = False):
    """Convert the Hugging Face Mixtral folder `hf_dir`; returns (config_path, ckpt_path).

    Raises DataError for a missing folder or an unusable config.json, CheckpointError for
    missing, unreadable or mismatched weights and for an existing OUT/model.ckpt (unless
    `overwrite`). Nothing is written before everything has been read and checked.
    """
    return huggingface.import_folder(hf_dir, output_dir, overwrite, _read_hf_config,
                                     build_config, map_weights)


def _read_hf_config(hf_dir: str):
    raw, path = read_hf_config(hf_dir, "mixtral", "Mixtral")
    config = {**HF_DEFAULTS, **raw}
    # transformers 5 keeps the rotary settings in `rope_parameters`; 4.x at the top level
    rope = raw.get("rope_parameters") or {}
    if rope:
        config["rope_theta"] = rope.get("rope_theta", config["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
    config["num_key_value_heads"] = (config["num_key_value_heads"]
                                     or config["num_attention_heads"])
    _check_supported(config, path)
    return config, path


def _check_supported(config: dict, path: str):
    """DataError for options the model does not implement."""
    problems = []
    if config["hidden_act"] != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (only silu, SwiGLU's gate)")
    if config["rope_scaling"]:
        problems.append(f"rope_scaling={config['rope_scaling']!r} (plain rotary positions "
                        f"only)")
    for key in ("attention_bias", "mlp_bias"):
        if config[key]:
            problems.append(f"{key}=true (bias-free projections; a biased variant is a copy "
                            f"of this folder)")
    if config["sliding_window"]:
        problems.append(f"sliding_window={config['sliding_window']} (full causal attention "
                        f"only)")
    if config["router_jitter_noise"]:
        problems.append(f"router_jitter_noise={config['router_jitter_noise']} (no jitter)")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] not in (None, head_dim):
        problems.append(f"head_dim={config['head_dim']} (only hidden_size / "
                        f"num_attention_heads = {head_dim})")
    if problems:
        raise DataError(f"{path!r} uses Mixtral options this model does not support: "
                        + "; ".join(problems))


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face Mixtral config dict (validated)."""
    from model_zoo.config import config_from_dict

    raw = {
        "model": {
            "name": folder_name(__name__),
            "num_layers": hf_config["num_hidden_layers"],
            "hidden_size": hf_config["hidden_size"],
            "num_heads": hf_config["num_attention_heads"],
            "num_kv_heads": hf_config["num_key_value_heads"],
            "ffn_hidden_size": hf_config["intermediate_size"],
            "seq_length": hf_config["max_position_embeddings"],
            "vocab_size": hf_config["vocab_size"],
            "rope_theta": float(hf_config["rope_theta"]),
            "rms_norm_eps": float(hf_config["rms_norm_eps"]),
            "tie_word_embeddings": bool(hf_config["tie_word_embeddings"]),
            "attention_dropout": float(hf_config["attention_dropout"]),
            "init_std": hf_config["initializer_range"],
            "num_experts": hf_config["num_local_experts"],
            "num_experts_per_tok": hf_config["num_experts_per_tok"],
            "router_aux_loss_coef": float(hf_config["router_aux_loss_coef"]),
        },
        "parallel": {},
        "train": {},
        "data": {"dataset_dir": dataset_dir},
    }
    try:
        return config_from_dict(raw, origin=origin)
    except ConfigError as err:
        raise DataError(f"{origin!r} does not give a valid Mixtral config: {err}") from None


def map_weights(tensors: dict, hf_config: dict, weight_file: str = "<weights>") -> dict:
    """Hugging Face Mixtral tensors (numpy) -> {project parameter name: float32 array}.
    CheckpointError names the first missing, misshapen or unexpected tensor."""
    # rotary frequencies are computed from rope_theta, not read (older versions saved them)
    tensors = {name: value for name, value in tensors.items()
               if not name.endswith("rotary_emb.inv_freq")}
    source = TensorSource(tensors, weight_file)
    take = source.take
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    vocab, ffn = hf_config["vocab_size"], hf_config["intermediate_size"]
    experts = hf_config["num_local_experts"]
    kv_width = kv_heads * (hidden // heads)
    params = {PREFIX + "embed.embedding_table": take("model.embed_tokens.weight",
                                                     (vocab, hidden)),
              PREFIX + "norm.weight": take("model.norm.weight", (hidden,))}
    for i in range(layers):
        ours, theirs = f"{PREFIX}blocks.{i}.", f"model.layers.{i}."
        params[ours + "input_norm.weight"] = take(theirs + "input_layernorm.weight", (hidden,))
        params[ours + "post_attention_norm.weight"] = take(
            theirs + "post_attention_layernorm.weight", (hidden,))
        params[ours + "attention.query.weight"] = take(theirs + "self_attn.q_proj.weight",
                                                       (hidden, hidden))
        params[ours + "attention.key_value.weight"] = fuse_head_projections(
            [take(theirs + f"self_attn.{name}_proj.weight", (kv_width, hidden))
             for name in ("k", "v")], kv_heads)
        params[ours + "attention.output.weight"] = take(theirs + "self_attn.o_proj.weight",
                                                        (hidden, hidden))
        moe = theirs + "block_sparse_moe."
        params[ours + "mlp.router"] = take(moe + "gate.weight", (experts, hidden))
        for ours_name, theirs_name, shape in (("gate", "w1", (ffn, hidden)),
                                              ("up", "w3", (ffn, hidden)),
                                              ("down", "w2", (hidden, ffn))):
            params[ours + "mlp." + ours_name] = np.stack(   # (E, in, out)
                [np.asarray(take(f"{moe}experts.{e}.{theirs_name}.weight", shape)).T
                 for e in range(experts)])
    if not hf_config["tie_word_embeddings"]:
        params[HEAD] = take("lm_head.weight", (vocab, hidden))
    elif "lm_head.weight" in tensors:   # a tied head saved anyway: the same table
        take("lm_head.weight", (vocab, hidden))
    source.check_all_used(("model.", "lm_head."), f"num_hidden_layers={layers}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}


def to_hf(config, network) -> tuple:
    """`model-zoo convert mixtral --to-hf`: (config.json of a MixtralForCausalLM, its
    tensors) for our network, the inverse of `map_weights`."""
    model = config.model
    if model.num_shared_experts:
        raise ConfigError(f"model.num_shared_experts={model.num_shared_experts}: Hugging "
                          f"Face's Mixtral has no shared experts to convert them to")
    params = huggingface.parameters_of(network)
    tensors = {"model.embed_tokens.weight": params[PREFIX + "embed.embedding_table"],
               "model.norm.weight": params[PREFIX + "norm.weight"]}
    if not model.tie_word_embeddings:
        tensors["lm_head.weight"] = params[HEAD]
    for i in range(model.num_layers):
        ours, theirs = f"{PREFIX}blocks.{i}.", f"model.layers.{i}."
        tensors[theirs + "input_layernorm.weight"] = params[ours + "input_norm.weight"]
        tensors[theirs + "post_attention_layernorm.weight"] = \
            params[ours + "post_attention_norm.weight"]
        tensors[theirs + "self_attn.q_proj.weight"] = params[ours + "attention.query.weight"]
        key, value = split_head_projections(params[ours + "attention.key_value.weight"],
                                            model.kv_heads, 2)
        tensors[theirs + "self_attn.k_proj.weight"] = key
        tensors[theirs + "self_attn.v_proj.weight"] = value
        tensors[theirs + "self_attn.o_proj.weight"] = params[ours + "attention.output.weight"]
        moe = theirs + "block_sparse_moe."
        tensors[moe + "gate.weight"] = params[ours + "mlp.router"]
        for ours_name, theirs_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            for e, matrix in enumerate(params[ours + "mlp." + ours_name]):
                tensors[f"{moe}experts.{e}.{theirs_name}.weight"] = \
                    np.ascontiguousarray(matrix.T)
    hf_config = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.expert_size,
        "num_local_experts": model.num_experts,
        "num_experts_per_tok": model.num_experts_per_tok,
        "router_aux_loss_coef": model.router_aux_loss_coef, "router_jitter_noise": 0.0,
        "sliding_window": None, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "num_key_value_heads": model.kv_heads,
        "hidden_act": "silu", "max_position_embeddings": model.seq_length,
        "initializer_range": model.init_std, "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        # transformers 5 reads `rope_parameters`, 4.x `rope_theta`
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
        "rope_theta": model.rope_theta,
        "attention_bias": False, "mlp_bias": False,
        "attention_dropout": model.attention_dropout,
        "bos_token_id": None, "eos_token_id": None,
    }
    return hf_config, tensors


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert mixtral`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face Mixtral folder (config.json and model.safetensors or "
                "pytorch_model.bin, as MixtralForCausalLM.save_pretrained writes them)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert mixtral` (either way); returns the exit status."""
    return huggingface.run_convert(args, convert_hf_mixtral, to_hf)
