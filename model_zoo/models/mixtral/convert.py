"""Convert a Hugging Face Mixtral or Qwen2-MoE folder into this project's checkpoint and
config, and back.

`model-zoo convert mixtral --hf-dir DIR --output-dir OUT` reads a folder written by
`MixtralForCausalLM.save_pretrained` or `Qwen2MoeForCausalLM.save_pretrained` (`config.json`
plus `model.safetensors` or `pytorch_model.bin`, sharded or not; a tokenizer is carried
along) and writes `OUT/model.ckpt`, named like the parameters of `MixtralForTraining`, and
`OUT/config.yaml`. `model-zoo convert mixtral --to-hf --config CONFIG --ckpt CKPT
--output-dir DIR` goes the other way (`to_hf`): a Qwen2-MoE when the config has
`model.shared_expert_gate`, else a Mixtral.

The attention is LLaMA's (its `k_proj` and `v_proj` fused into `key_value`, head by head,
biases too); the experts' projections, one [out, in] matrix per expert in Hugging Face's
files (Mixtral's `block_sparse_moe.experts.<e>.w1` the gate, `w3` the up, `w2` the down
projection; Qwen2-MoE's `mlp.experts.<e>.gate_proj`, `up_proj`, `down_proj`), are stacked
into one (experts, in, out) tensor each (`gate`, `up`, `down`), and the router's
`gate.weight` (experts, hidden) is `router`. Qwen2-MoE's `shared_expert` is the block's
`shared_experts` SwiGLU (gate and up fused row by row as LLaMA's are) and its
`shared_expert_gate` the block's `shared_gate`.
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

# Defaults of transformers.MixtralConfig and Qwen2MoeConfig, for keys a config.json may omit.
HF_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1e6,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
    "mlp_bias": False, "head_dim": None, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
}
QWEN_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "rope_scaling": None, "use_sliding_window": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
    "qkv_bias": True, "head_dim": None,
}
# Hugging Face's names of a sparse layer's parts: (module, router, the experts' gate, up and
# down projections) by model_type
MOE_NAMES = {"mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2")),
             "qwen2_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj"))}


def convert_hf_mixtral(hf_dir: str, output_dir: str, overwrite: bool = False):
    """Convert the Hugging Face Mixtral or Qwen2-MoE folder `hf_dir`; returns
    (config_path, ckpt_path).

    Raises DataError for a missing folder or an unusable config.json, CheckpointError for
    missing, unreadable or mismatched weights and for an existing OUT/model.ckpt (unless
    `overwrite`). Nothing is written before everything has been read and checked.
    """
    return huggingface.import_folder(hf_dir, output_dir, overwrite, _read_hf_config,
                                     build_config, map_weights)


def _read_hf_config(hf_dir: str):
    """The folder's config.json over its model type's defaults, with the MoE keys the
    project's config needs under Mixtral's names (`_moe_keys`)."""
    raw, path = read_hf_config(hf_dir, tuple(MOE_NAMES), "Mixtral or Qwen2-MoE")
    qwen = raw["model_type"] == "qwen2_moe"
    config = {**(QWEN_DEFAULTS if qwen else HF_DEFAULTS), **raw}
    # transformers 5 keeps the rotary settings in `rope_parameters`; 4.x at the top level
    rope = raw.get("rope_parameters") or {}
    if rope:
        config["rope_theta"] = rope.get("rope_theta", config["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
    config["num_key_value_heads"] = (config["num_key_value_heads"]
                                     or config["num_attention_heads"])
    config.update(_qwen_keys(config, path) if qwen else {
        "num_experts": config["num_local_experts"],
        "moe_intermediate_size": config["intermediate_size"], "num_shared_experts": 0,
        "shared_expert_gate": False, "normalize_top_k": True, "moe_layer_freq": 1,
        "attention_bias": bool(config["attention_bias"])})
    _check_supported(config, path)
    return config, path


def _qwen_keys(config: dict, path: str) -> dict:
    """Qwen2-MoE's config keys as the project's (its shared expert as that many experts'
    width); DataError for what the model does not implement."""
    problems = []
    expert, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    if not shared or shared % expert:
        problems.append(f"shared_expert_intermediate_size={shared} (only a multiple of "
                        f"moe_intermediate_size={expert})")
    if config["mlp_only_layers"]:
        problems.append(f"mlp_only_layers={config['mlp_only_layers']} (dense layers only "
                        f"every decoder_sparse_step)")
    if config["use_sliding_window"]:
        problems.append("use_sliding_window=true (full causal attention only)")
    if problems:
        raise DataError(f"{path!r} uses Qwen2-MoE options this model does not support: "
                        + "; ".join(problems))
    return {"moe_intermediate_size": expert, "num_shared_experts": shared // expert,
            "shared_expert_gate": True, "normalize_top_k": bool(config["norm_topk_prob"]),
            "moe_layer_freq": config["decoder_sparse_step"],
            "attention_bias": bool(config["qkv_bias"]), "sliding_window": None,
            "router_jitter_noise": 0.0, "mlp_bias": False}


def _check_supported(config: dict, path: str):
    """DataError for options the model does not implement."""
    problems = []
    if config["hidden_act"] != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (only silu, SwiGLU's gate)")
    if config["rope_scaling"]:
        problems.append(f"rope_scaling={config['rope_scaling']!r} (plain rotary positions "
                        f"only)")
    if config["mlp_bias"]:
        problems.append("mlp_bias=true (bias-free feed-forward projections)")
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
        raise DataError(f"{path!r} uses options this model does not support: "
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
            "num_experts": hf_config["num_experts"],
            "num_experts_per_tok": hf_config["num_experts_per_tok"],
            "router_aux_loss_coef": float(hf_config["router_aux_loss_coef"]),
            **{key: hf_config[key] for key in (
                "moe_intermediate_size", "num_shared_experts", "shared_expert_gate",
                "normalize_top_k", "moe_layer_freq", "attention_bias")},
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
    """Hugging Face Mixtral or Qwen2-MoE tensors (numpy) -> {project parameter name: float32
    array}. CheckpointError names the first missing, misshapen or unexpected tensor."""
    # rotary frequencies are computed from rope_theta, not read (older versions saved them)
    tensors = {name: value for name, value in tensors.items()
               if not name.endswith("rotary_emb.inv_freq")}
    source = TensorSource(tensors, weight_file)
    take = source.take
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    vocab, dense = hf_config["vocab_size"], hf_config["intermediate_size"]
    experts, ffn = hf_config["num_experts"], hf_config["moe_intermediate_size"]
    shared = hf_config["num_shared_experts"] * ffn
    moe, router, projections = MOE_NAMES[hf_config["model_type"]]
    kv_width = kv_heads * (hidden // heads)
    sparse = [(i + 1) % hf_config["moe_layer_freq"] == 0 for i in range(layers)]
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
        if hf_config["attention_bias"]:
            params[ours + "attention.query.bias"] = take(theirs + "self_attn.q_proj.bias",
                                                         (hidden,))
            params[ours + "attention.key_value.bias"] = fuse_head_projections(
                [take(theirs + f"self_attn.{name}_proj.bias", (kv_width,))
                 for name in ("k", "v")], kv_heads)
        params[ours + "attention.output.weight"] = take(theirs + "self_attn.o_proj.weight",
                                                        (hidden, hidden))
        if not sparse[i]:
            params.update(_take_swiglu(take, theirs + "mlp.", ours + "mlp.", hidden, dense))
            continue
        params[ours + "mlp.router"] = take(f"{theirs}{moe}{router}.weight", (experts, hidden))
        for ours_name, theirs_name, shape in zip(("gate", "up", "down"), projections,
                                                 ((ffn, hidden), (ffn, hidden), (hidden, ffn))):
            params[ours + "mlp." + ours_name] = np.stack(   # (E, in, out)
                [np.asarray(take(f"{theirs}{moe}experts.{e}.{theirs_name}.weight", shape)).T
                 for e in range(experts)])
        if shared:
            params.update(_take_swiglu(take, f"{theirs}{moe}shared_expert.",
                                       ours + "shared_experts.", hidden, shared))
            params[ours + "shared_gate.weight"] = take(f"{theirs}{moe}shared_expert_gate.weight",
                                                       (1, hidden))
    if not hf_config["tie_word_embeddings"]:
        params[HEAD] = take("lm_head.weight", (vocab, hidden))
    elif "lm_head.weight" in tensors:   # a tied head saved anyway: the same table
        take("lm_head.weight", (vocab, hidden))
    source.check_all_used(("model.", "lm_head."), f"num_hidden_layers={layers}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}


def _take_swiglu(take, theirs: str, ours: str, hidden: int, width: int) -> dict:
    """A Hugging Face SwiGLU (`gate_proj`, `up_proj`, `down_proj`) as a `GatedFeedForward`'s
    parameters (gate and up fused row by row)."""
    return {ours + "gate_up.weight": fuse_head_projections(
                [take(theirs + f"{name}_proj.weight", (width, hidden)) for name in ("gate", "up")],
                width),
            ours + "down.weight": take(theirs + "down_proj.weight", (hidden, width))}


def _give_swiglu(params: dict, ours: str, theirs: str, width: int) -> dict:
    """The inverse of `_take_swiglu`."""
    gate, up = split_head_projections(params[ours + "gate_up.weight"], width, 2)
    return {theirs + "gate_proj.weight": gate, theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": params[ours + "down.weight"]}


def _hf_target(model) -> str:
    """The Hugging Face model_type `--to-hf` writes: Qwen2-MoE for a config with its shared
    expert gate, else Mixtral; ConfigError for what neither has."""
    if model.shared_expert_gate:
        return "qwen2_moe"
    differs = [f"model.{key}={getattr(model, key)}" for key, mixtral in (
        ("num_shared_experts", 0), ("moe_layer_freq", 1), ("normalize_top_k", True),
        ("attention_bias", False)) if getattr(model, key) != mixtral]
    if differs:
        raise ConfigError(f"{', '.join(differs)}: Hugging Face's Mixtral has no such option "
                          f"(Qwen2-MoE has them with model.shared_expert_gate: true)")
    return "mixtral"


def to_hf(config, network) -> tuple:
    """`model-zoo convert mixtral --to-hf`: (config.json of a MixtralForCausalLM or a
    Qwen2MoeForCausalLM, its tensors) for our network, the inverse of `map_weights`."""
    model = config.model
    target = _hf_target(model)
    moe, router, projections = MOE_NAMES[target]
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
        if model.attention_bias:
            tensors[theirs + "self_attn.q_proj.bias"] = params[ours + "attention.query.bias"]
            key, value = split_head_projections(params[ours + "attention.key_value.bias"],
                                                model.kv_heads, 2)
            tensors[theirs + "self_attn.k_proj.bias"] = key
            tensors[theirs + "self_attn.v_proj.bias"] = value
        if not model.has_experts(i):
            tensors.update(_give_swiglu(params, ours + "mlp.", theirs + "mlp.", model.ffn_size))
            continue
        tensors[f"{theirs}{moe}{router}.weight"] = params[ours + "mlp.router"]
        for ours_name, theirs_name in zip(("gate", "up", "down"), projections):
            for e, matrix in enumerate(params[ours + "mlp." + ours_name]):
                tensors[f"{theirs}{moe}experts.{e}.{theirs_name}.weight"] = \
                    np.ascontiguousarray(matrix.T)
        if model.num_shared_experts:
            tensors.update(_give_swiglu(params, ours + "shared_experts.",
                                        f"{theirs}{moe}shared_expert.",
                                        model.num_shared_experts * model.expert_size))
            tensors[f"{theirs}{moe}shared_expert_gate.weight"] = params[ours + "shared_gate.weight"]
    hf_config = _qwen_hf_config(model) if target == "qwen2_moe" else {
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


def _qwen_hf_config(model) -> dict:
    """config.json of a Qwen2MoeForCausalLM for the `model` section."""
    return {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size, "moe_intermediate_size": model.expert_size,
        "shared_expert_intermediate_size": model.num_shared_experts * model.expert_size,
        "num_experts": model.num_experts, "num_experts_per_tok": model.num_experts_per_tok,
        "norm_topk_prob": model.normalize_top_k, "decoder_sparse_step": model.moe_layer_freq,
        "mlp_only_layers": [], "router_aux_loss_coef": model.router_aux_loss_coef,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": model.seq_length, "initializer_range": model.init_std,
        "rms_norm_eps": model.rms_norm_eps, "tie_word_embeddings": model.tie_word_embeddings,
        # transformers 5 reads `rope_parameters`, 4.x `rope_theta`; 4.x always has the biases
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
        "rope_theta": model.rope_theta, "qkv_bias": model.attention_bias,
        "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": model.attention_dropout, "bos_token_id": None,
        "eos_token_id": None,
    }


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert mixtral`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face Mixtral or Qwen2-MoE folder (config.json and "
                "model.safetensors or pytorch_model.bin, as MixtralForCausalLM or "
                "Qwen2MoeForCausalLM.save_pretrained writes them)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert mixtral` (either way); returns the exit status."""
    return huggingface.run_convert(args, convert_hf_mixtral, to_hf)
