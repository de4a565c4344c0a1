"""What the Hugging Face converters of the LLaMA family share (LLaMA, Mixtral / Qwen2-MoE and
the families after them): how their config.json is read and written, the name-table parts of
a `*ForCausalLM` decoder (embedding, norms, grouped-query attention, SwiGLU, head), and the
conversion of a whole table both ways. A folder's `convert.py` keeps its defaults, its
checks and its name table, composed from these parts as its block is from `model_zoo.nn`.

Both sides store projections as [out, in], and Hugging Face's rotary layout (the two halves of
a head rotate together) is the one `nn.rotary.rotary_tables` uses, so weights copy as they
are, except the fused projections (`huggingface.Fused`): `k_proj` and `v_proj` as
`key_value`, `gate_proj` and `up_proj` as `gate_up`.
"""

import numpy as np

from model_zoo import huggingface
from model_zoo.huggingface import Fused, Same, TensorSource

# Our parameters are those of `<Model>ForTraining`, whose language model is `lm`.
PREFIX = "lm."


def read_rotary_config(raw: dict, defaults: dict) -> dict:
    """A config.json (`raw`) over its model type's `defaults`, read as transformers 4.x and 5
    write it: the rotary settings at the top level (4.x) or in `rope_parameters` (5), the
    key/value heads defaulting to the query heads."""
    config = {**defaults, **raw}
    rope = raw.get("rope_parameters") or {}
    if rope:
        config["rope_theta"] = rope.get("rope_theta", config["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
    config["num_key_value_heads"] = (config["num_key_value_heads"]
                                     or config["num_attention_heads"])
    return config


def rotary_problems(config: dict) -> list:
    """What of a read config (`read_rotary_config`) the shared decoder parts do not build."""
    problems = []
    if config["hidden_act"] != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (only silu, SwiGLU's gate)")
    if config["rope_scaling"]:
        problems.append(f"rope_scaling={config['rope_scaling']!r} (plain rotary positions "
                        f"only)")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] not in (None, head_dim):
        problems.append(f"head_dim={config['head_dim']} (only hidden_size / "
                        f"num_attention_heads = {head_dim})")
    return problems


def rotary_model_keys(config: dict) -> dict:
    """The `model` keys of `RotaryDecoderConfig` from a read config."""
    return {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "ffn_hidden_size": config["intermediate_size"],
        "seq_length": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "rope_theta": float(config["rope_theta"]),
        "rms_norm_eps": float(config["rms_norm_eps"]),
        "tie_word_embeddings": bool(config["tie_word_embeddings"]),
        "attention_dropout": float(config["attention_dropout"]),
        "init_std": config["initializer_range"],
    }


def rotary_hf_config(model) -> dict:
    """The config.json keys a `RotaryDecoderConfig` gives every family (the inverse of
    `rotary_model_keys`); a folder adds its model_type, architecture and its own keys."""
    return {
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": model.seq_length, "initializer_range": model.init_std,
        "rms_norm_eps": model.rms_norm_eps, "tie_word_embeddings": model.tie_word_embeddings,
        # transformers 5 reads `rope_parameters`, 4.x `rope_theta`
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
        "rope_theta": model.rope_theta,
        "attention_dropout": model.attention_dropout,
        "bos_token_id": None, "eos_token_id": None,
    }


# The parts of a name table (`huggingface.Same`, `Fused`, ...), under our `lm.` and their
# top level; `ours` and `theirs` are the part's prefixes.

def embedding_names(config: dict) -> list:
    """The token embedding and the final norm."""
    hidden = config["hidden_size"]
    return [Same("model.embed.embedding_table", "model.embed_tokens.weight",
                 (config["vocab_size"], hidden)),
            Same("model.norm.weight", "model.norm.weight", (hidden,))]


def head_names(config: dict) -> list:
    """The language-model head, unless it is the embedding (`tie_word_embeddings`)."""
    if config["tie_word_embeddings"]:
        return []
    return [Same("head.weight", "lm_head.weight", (config["vocab_size"],
                                                  config["hidden_size"]))]


def block_norm_names(ours: str, theirs: str, config: dict) -> list:
    """A block's two RMSNorms, before its attention and before its feed-forward."""
    hidden = (config["hidden_size"],)
    return [Same(ours + "input_norm.weight", theirs + "input_layernorm.weight", hidden),
            Same(ours + "post_attention_norm.weight", theirs + "post_attention_layernorm.weight",
                 hidden)]


def attention_names(ours: str, theirs: str, config: dict, bias: bool = False) -> list:
    """`GroupedQueryAttention` from `q_proj`, `k_proj`, `v_proj` (and their biases) and
    `o_proj`."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    kv_width = kv_heads * (hidden // heads)
    names = [Same(ours + "query.weight", theirs + "q_proj.weight", (hidden, hidden)),
             Fused(ours + "key_value.weight", (theirs + "k_proj.weight", theirs + "v_proj.weight"),
                   (kv_width, hidden), kv_heads),
             Same(ours + "output.weight", theirs + "o_proj.weight", (hidden, hidden))]
    if bias:
        names += [Same(ours + "query.bias", theirs + "q_proj.bias", (hidden,)),
                  Fused(ours + "key_value.bias", (theirs + "k_proj.bias", theirs + "v_proj.bias"),
                        (kv_width,), kv_heads)]
    return names


def swiglu_names(ours: str, theirs: str, hidden: int, width: int) -> list:
    """`GatedFeedForward` of `width` from `gate_proj`, `up_proj` and `down_proj`."""
    return [Fused(ours + "gate_up.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
                  (width, hidden), width),
            Same(ours + "down.weight", theirs + "down_proj.weight", (hidden, width))]


def take_weights(table: list, tensors: dict, config: dict, weight_file: str) -> dict:
    """Hugging Face tensors (numpy) -> {our parameter name: float32 array} by the folder's
    name table. CheckpointError names the first missing, misshapen or unexpected tensor."""
    # rotary frequencies are computed from rope_theta, not read (older versions saved them)
    source = TensorSource({name: value for name, value in tensors.items()
                           if not name.endswith("rotary_emb.inv_freq")}, weight_file)
    params = huggingface.take_table(source.take, table, ours=PREFIX)
    if config["tie_word_embeddings"] and "lm_head.weight" in source:
        # a tied head saved anyway: the same table
        source.take("lm_head.weight", (config["vocab_size"], config["hidden_size"]))
    source.check_all_used(("model.", "lm_head."),
                          f"num_hidden_layers={config['num_hidden_layers']}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}


def give_weights(table: list, network) -> dict:
    """The inverse of `take_weights`: {Hugging Face name: array} of our network."""
    return huggingface.give_table(huggingface.parameters_of(network), table, ours=PREFIX)
