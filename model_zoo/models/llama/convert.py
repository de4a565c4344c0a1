"""Convert a Hugging Face LLaMA folder into this project's checkpoint and config, and back.

`model-zoo convert llama --hf-dir DIR --output-dir OUT` reads a folder written by
`LlamaForCausalLM.save_pretrained` (`config.json` plus `model.safetensors` or
`pytorch_model.bin`, sharded or not; a tokenizer is carried along) and writes
`OUT/model.ckpt`, named like the parameters of `LlamaForTraining`, and `OUT/config.yaml`.
`model-zoo convert llama --to-hf --config CONFIG --ckpt CKPT --output-dir DIR` goes the other
way (`to_hf`).

The weights copy as they are but for two fused projections, `k_proj` and `v_proj` as
`key_value` and `gate_proj` and `up_proj` as `gate_up` (`causal_lm.convert`); `name_table`
is the one list of which of our parameters is which of theirs, read both ways.
"""

from model_zoo import huggingface
from model_zoo.causal_lm import convert
from model_zoo.huggingface import CONFIG_FILE, DATASET_SUBDIR, read_hf_config
from model_zoo.models.base import folder_name

# Defaults of transformers.LlamaConfig, for keys a config.json may omit.
HF_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
    "mlp_bias": False, "head_dim": None,
}


def convert_hf_llama(hf_dir: str, output_dir: str, overwrite: bool = False):
    """Convert the Hugging Face LLaMA folder `hf_dir` as `huggingface.import_folder`
    does; returns (config_path, ckpt_path)."""
    return huggingface.import_folder(hf_dir, output_dir, overwrite, _read_hf_config,
                                     build_config, map_weights)


def _read_hf_config(hf_dir: str):
    raw, path = read_hf_config(hf_dir, "llama", "LLaMA")
    return _complete(raw, path), path


def _complete(raw: dict, path: str) -> dict:
    """config.json over LLaMA's defaults; DataError for options the model does not build."""
    config = convert.read_rotary_config(raw, HF_DEFAULTS)
    problems = convert.rotary_problems(config)
    for key in ("attention_bias", "mlp_bias"):
        if config[key]:
            problems.append(f"{key}=true (bias-free projections; a biased variant is a copy "
                            f"of this folder)")
    huggingface.refuse_unsupported(problems, path, "LLaMA")
    return config


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face LLaMA config dict (validated)."""
    return huggingface.project_config(
        {"name": folder_name(__name__), **convert.rotary_model_keys(hf_config)},
        origin, dataset_dir, "LLaMA")


def name_table(config: dict) -> list:
    """Which of our parameters (under `lm.`) is which of the Hugging Face tensors, for a
    read config.json."""
    hidden = config["hidden_size"]
    table = convert.embedding_names(config)
    for i in range(config["num_hidden_layers"]):
        ours, theirs = f"model.blocks.{i}.", f"model.layers.{i}."
        table += convert.block_norm_names(ours, theirs, config)
        table += convert.attention_names(ours + "attention.", theirs + "self_attn.", config)
        table += convert.swiglu_names(ours + "mlp.", theirs + "mlp.", hidden,
                                      config["intermediate_size"])
    return table + convert.head_names(config)


def map_weights(tensors: dict, hf_config: dict, weight_file: str = "<weights>") -> dict:
    """Hugging Face LLaMA tensors (numpy) -> {project parameter name: float32 array}.
    CheckpointError names the first missing, misshapen or unexpected tensor."""
    return convert.take_weights(name_table(hf_config), tensors, hf_config, weight_file)


def to_hf(config, network) -> tuple:
    """`model-zoo convert llama --to-hf`: (config.json of a LlamaForCausalLM, its tensors)
    for our network, the inverse of `map_weights`."""
    model = config.model
    hf_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                 **convert.rotary_hf_config(model), "intermediate_size": model.ffn_size,
                 "attention_bias": False, "mlp_bias": False}
    table = name_table(_complete(hf_config, CONFIG_FILE))
    return hf_config, convert.give_weights(table, network)


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert llama`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face LLaMA folder (config.json and model.safetensors or "
                "pytorch_model.bin, as LlamaForCausalLM.save_pretrained writes them)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert llama` (either way); returns the exit status."""
    return huggingface.run_convert(args, convert_hf_llama, to_hf)
