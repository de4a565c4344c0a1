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

from model_zoo import huggingface
from model_zoo.causal_lm import convert
from model_zoo.errors import ConfigError
from model_zoo.huggingface import CONFIG_FILE, DATASET_SUBDIR, Same, Stacked, read_hf_config
from model_zoo.models.base import folder_name

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
    """Convert the Hugging Face Mixtral or Qwen2-MoE folder `hf_dir` as
    `huggingface.import_folder` does; returns (config_path, ckpt_path)."""
    return huggingface.import_folder(hf_dir, output_dir, overwrite, _read_hf_config,
                                     build_config, map_weights)


def _read_hf_config(hf_dir: str):
    raw, path = read_hf_config(hf_dir, tuple(MOE_NAMES), "Mixtral or Qwen2-MoE")
    return _complete(raw, path), path


def _complete(raw: dict, path: str) -> dict:
    """config.json over its model type's defaults, with the MoE keys the project's config
    needs under Mixtral's names; DataError for options the model does not build."""
    qwen = raw["model_type"] == "qwen2_moe"
    config = convert.read_rotary_config(raw, QWEN_DEFAULTS if qwen else HF_DEFAULTS)
    config.update(_qwen_keys(config, path) if qwen else {
        "num_experts": config["num_local_experts"],
        "moe_intermediate_size": config["intermediate_size"], "num_shared_experts": 0,
        "shared_expert_gate": False, "normalize_top_k": True, "moe_layer_freq": 1,
        "attention_bias": bool(config["attention_bias"])})
    problems = convert.rotary_problems(config)
    if config["mlp_bias"]:
        problems.append("mlp_bias=true (bias-free feed-forward projections)")
    if config["sliding_window"]:
        problems.append(f"sliding_window={config['sliding_window']} (full causal attention "
                        f"only)")
    if config["router_jitter_noise"]:
        problems.append(f"router_jitter_noise={config['router_jitter_noise']} (no jitter)")
    huggingface.refuse_unsupported(problems, path, "Qwen2-MoE" if qwen else "Mixtral")
    return config


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
    huggingface.refuse_unsupported(problems, path, "Qwen2-MoE")
    return {"moe_intermediate_size": expert, "num_shared_experts": shared // expert,
            "shared_expert_gate": True, "normalize_top_k": bool(config["norm_topk_prob"]),
            "moe_layer_freq": config["decoder_sparse_step"],
            "attention_bias": bool(config["qkv_bias"]), "sliding_window": None,
            "router_jitter_noise": 0.0, "mlp_bias": False}


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face Mixtral config dict (validated)."""
    return huggingface.project_config({
        "name": folder_name(__name__), **convert.rotary_model_keys(hf_config),
        **{key: hf_config[key] for key in (
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
            "shared_expert_gate", "normalize_top_k", "moe_layer_freq", "attention_bias")},
        "router_aux_loss_coef": float(hf_config["router_aux_loss_coef"]),
    }, origin, dataset_dir, "Mixtral")


def name_table(config: dict) -> list:
    """Which of our parameters (under `lm.`) is which of the Hugging Face tensors, for a
    read config.json: a sparse layer's experts stacked (experts, in, out), its router
    (experts, hidden), Qwen2-MoE's shared expert a SwiGLU with its gate."""
    hidden, experts = config["hidden_size"], config["num_experts"]
    ffn = config["moe_intermediate_size"]
    moe, router, projections = MOE_NAMES[config["model_type"]]
    table = convert.embedding_names(config)
    for i in range(config["num_hidden_layers"]):
        ours, theirs = f"model.blocks.{i}.", f"model.layers.{i}."
        table += convert.block_norm_names(ours, theirs, config)
        table += convert.attention_names(ours + "attention.", theirs + "self_attn.", config,
                                         bias=config["attention_bias"])
        if (i + 1) % config["moe_layer_freq"]:      # a dense layer
            table += convert.swiglu_names(ours + "mlp.", theirs + "mlp.", hidden,
                                          config["intermediate_size"])
            continue
        sparse = theirs + moe
        table.append(Same(ours + "mlp.router", f"{sparse}{router}.weight", (experts, hidden)))
        table += [Stacked(f"{ours}mlp.{name}", f"{sparse}experts.{{}}.{their_name}.weight",
                          shape, experts)
                  for name, their_name, shape in zip(("gate", "up", "down"), projections,
                                                     ((ffn, hidden), (ffn, hidden), (hidden, ffn)))]
        if config["num_shared_experts"]:
            table += convert.swiglu_names(ours + "shared_experts.", sparse + "shared_expert.",
                                          hidden, config["num_shared_experts"] * ffn)
            table.append(Same(ours + "shared_gate.weight", sparse + "shared_expert_gate.weight",
                              (1, hidden)))
    return table + convert.head_names(config)


def map_weights(tensors: dict, hf_config: dict, weight_file: str = "<weights>") -> dict:
    """Hugging Face Mixtral or Qwen2-MoE tensors (numpy) -> {project parameter name: float32
    array}. CheckpointError names the first missing, misshapen or unexpected tensor."""
    return convert.take_weights(name_table(hf_config), tensors, hf_config, weight_file)


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
    hf_config = _qwen_hf_config(model) if _hf_target(model) == "qwen2_moe" else {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        **convert.rotary_hf_config(model), "intermediate_size": model.expert_size,
        "num_local_experts": model.num_experts,
        "num_experts_per_tok": model.num_experts_per_tok,
        "router_aux_loss_coef": model.router_aux_loss_coef, "router_jitter_noise": 0.0,
        "sliding_window": None, "attention_bias": False, "mlp_bias": False,
    }
    table = name_table(_complete(hf_config, CONFIG_FILE))
    return hf_config, convert.give_weights(table, network)


def _qwen_hf_config(model) -> dict:
    """config.json of a Qwen2MoeForCausalLM for the `model` section."""
    return {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
        **convert.rotary_hf_config(model),
        "intermediate_size": model.ffn_size, "moe_intermediate_size": model.expert_size,
        "shared_expert_intermediate_size": model.num_shared_experts * model.expert_size,
        "num_experts": model.num_experts, "num_experts_per_tok": model.num_experts_per_tok,
        "norm_topk_prob": model.normalize_top_k, "decoder_sparse_step": model.moe_layer_freq,
        "mlp_only_layers": [], "router_aux_loss_coef": model.router_aux_loss_coef,
        # transformers 4.x always has the biases
        "qkv_bias": model.attention_bias, "use_sliding_window": False, "sliding_window": None,
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
