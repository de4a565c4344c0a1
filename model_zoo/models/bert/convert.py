"""Convert a Hugging Face BERT folder into this project's checkpoint and config.

`model-zoo convert bert --hf-dir DIR --output-dir OUT` reads a folder written by
`save_pretrained` for `BertForPreTraining` or `BertForMaskedLM` (`config.json` plus
`model.safetensors` or `pytorch_model.bin`, sharded or not; keys with or without the
`bert.` prefix; old `LayerNorm.gamma/beta` names too) and writes `OUT/model.ckpt`, named
like the parameters of `BertForPreTraining`, and `OUT/config.yaml`, a full validated config
whose `model` section describes the same network (task "pretrain").

Both use torch's Linear layout [out, in], so weights are copied as they are. The MLM
decoder is tied to the word embeddings (`cls.predictions.decoder.weight` is not stored, or
must equal them); its bias is `cls.predictions.bias`. A `BertForMaskedLM` has no pooler and
no next-sentence head: those are written at this project's initialisation (normal weights
with the config's init_std from a fixed seed, zero biases) and the conversion says so.
"""

import os

import numpy as np

from model_zoo.models.base import folder_name
from model_zoo.errors import CheckpointError, UserInputError
from model_zoo import huggingface
from model_zoo.huggingface import (CONFIG_FILE, DATASET_SUBDIR, TensorSource, output_paths,
                                   read_hf_config, read_weights, write_converted)
from model_zoo.nn.attention import fuse_head_projections, split_head_projections

# BERT's usual special ids ([PAD], [CLS], [SEP], [MASK] of the uncased/cased vocab.txt),
# used unless config.json names them.
BERT_SPECIAL_IDS = {"pad_token_id": 0, "cls_token_id": 101, "sep_token_id": 102,
                    "mask_token_id": 103}
# Seed of the heads a BertForMaskedLM lacks (pooler and next-sentence classifier).
INIT_SEED = 0

# Defaults of transformers.BertConfig, for keys a config.json may omit.
HF_DEFAULTS = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
    "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512, "type_vocab_size": 2, "initializer_range": 0.02,
    "layer_norm_eps": 1e-12, "position_embedding_type": "absolute", "is_decoder": False,
    "add_cross_attention": False, "tie_word_embeddings": True,
}
# Both are the exact (erf) GELU, which the model computes.
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_python")
# Buffers that carry no weight.
IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
OUR_PREFIX = "bert."
HEADS_PREFIX = "cls."


def convert_hf_bert(hf_dir: str, output_dir: str, overwrite: bool = False, *, log=print):
    """Convert the Hugging Face BERT folder `hf_dir`; returns (config_path, ckpt_path).

    `log` receives one line per note (heads left at their initialisation); pass None to
    stay quiet. Raises DataError for a missing folder or an unusable config.json,
    CheckpointError for missing, unreadable or mismatched weights and for an existing
    OUT/model.ckpt (unless `overwrite`). Nothing is written before everything has been
    read and checked.
    """
    hf_config, config_file = _read_hf_config(hf_dir)
    config = build_config(hf_config, config_file,
                          dataset_dir=os.path.join(output_dir, DATASET_SUBDIR))
    config_path, ckpt_path = output_paths(output_dir, overwrite)
    tensors, weight_file = read_weights(hf_dir, floating_only=True)
    params, notes = map_weights(tensors, hf_config, weight_file)
    write_converted(params, config, config_path, ckpt_path)
    for note in notes:
        if log is not None:
            log(note)
    return config_path, ckpt_path


def _read_hf_config(hf_dir: str):
    raw, path = read_hf_config(hf_dir, "bert", "BERT")
    config = dict(HF_DEFAULTS)
    config.update(raw)
    _check_supported(config, path)
    return config, path


def _check_supported(config: dict, path: str):
    """DataError for options the model does not implement."""
    problems = []
    if config["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        problems.append(f"hidden_act={config['hidden_act']!r} (only 'gelu', the exact erf "
                        "GELU, is supported)")
    if config["position_embedding_type"] != "absolute":
        problems.append(f"position_embedding_type={config['position_embedding_type']!r} "
                        "(only 'absolute' learned positions are supported)")
    for key in ("is_decoder", "add_cross_attention"):
        if config[key]:
            problems.append(f"{key}=true (BERT here is an encoder without cross attention)")
    if not config["tie_word_embeddings"]:
        problems.append("tie_word_embeddings=false (the MLM decoder is tied to the word "
                        "embeddings)")
    huggingface.refuse_unsupported(problems, path, "BERT")


def build_config(hf_config: dict, origin: str = CONFIG_FILE, dataset_dir: str = DATASET_SUBDIR):
    """The project's full `Config` for a Hugging Face BERT config dict (validated)."""
    model = {
        "name": folder_name(__name__),
        "task": "pretrain",
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "num_heads": hf_config["num_attention_heads"],
        "seq_length": hf_config["max_position_embeddings"],
        "vocab_size": hf_config["vocab_size"],
        "ffn_hidden_size": hf_config["intermediate_size"],
        "type_vocab_size": hf_config["type_vocab_size"],
        "layer_norm_eps": hf_config["layer_norm_eps"],
        "dropout": hf_config["hidden_dropout_prob"],
        "attention_dropout": hf_config["attention_probs_dropout_prob"],
        "init_std": hf_config["initializer_range"],
    }
    for key, default in BERT_SPECIAL_IDS.items():
        value = hf_config.get(key)
        model[key] = default if value is None else value
    return huggingface.project_config(model, origin, dataset_dir, "BERT")


def _normalise_keys(tensors: dict) -> dict:
    """Strip the `bert.` prefix and rename old `LayerNorm.gamma/beta` to weight/bias."""
    source = {}
    for key, value in tensors.items():
        short = key[len("bert."):] if key.startswith("bert.") else key
        short = short.replace("LayerNorm.gamma", "LayerNorm.weight")
        short = short.replace("LayerNorm.beta", "LayerNorm.bias")
        if short in IGNORED_KEYS:
            continue
        source[short] = value
    return source


def _display(name: str) -> str:
    """A normalised key as Hugging Face names it in BertForPreTraining."""
    return name if name.startswith(HEADS_PREFIX) else "bert." + name


def map_weights(tensors: dict, hf_config: dict, weight_file: str = "<weights>"):
    """Hugging Face BERT tensors (numpy) -> ({parameter name: float32 array}, notes).

    The names are those of `BertForPreTraining`. Missing pooler and next-sentence head (a
    BertForMaskedLM) are initialised as the model would be and reported in `notes`.
    CheckpointError names the first missing, misshapen or unexpected tensor.
    """
    source = TensorSource(_normalise_keys(tensors), weight_file, _display)
    take = source.take
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    vocab, positions = hf_config["vocab_size"], hf_config["max_position_embeddings"]
    types, inner = hf_config["type_vocab_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]

    def linear(ours, theirs, n_in, n_out):
        params[ours + ".weight"] = take(theirs + ".weight", (n_out, n_in))
        params[ours + ".bias"] = take(theirs + ".bias", (n_out,))

    def norm(ours, theirs):
        params[ours + ".gamma"] = take(theirs + ".weight", (hidden,))
        params[ours + ".beta"] = take(theirs + ".bias", (hidden,))

    params = {}
    emb = OUR_PREFIX + "embeddings."
    params[emb + "word_embeddings.embedding_table"] = take("embeddings.word_embeddings.weight",
                                                           (vocab, hidden))
    params[emb + "position_embeddings.embedding_table"] = take(
        "embeddings.position_embeddings.weight", (positions, hidden))
    params[emb + "token_type_embeddings.embedding_table"] = take(
        "embeddings.token_type_embeddings.weight", (types, hidden))
    norm(emb + "layer_norm", "embeddings.LayerNorm")
    for i in range(layers):
        ours, theirs = f"{OUR_PREFIX}encoder.layer.{i}.", f"encoder.layer.{i}."
        # separate query, key and value -> the fused projection, laid out head by head
        attention = [f"{theirs}attention.self.{part}" for part in ("query", "key", "value")]
        params[ours + "attention.qkv.weight"] = fuse_head_projections(
            [take(name + ".weight", (hidden, hidden)) for name in attention], heads)
        params[ours + "attention.qkv.bias"] = fuse_head_projections(
            [take(name + ".bias", (hidden,)) for name in attention], heads)
        linear(ours + "attention.output", theirs + "attention.output.dense", hidden, hidden)
        norm(ours + "attention_layer_norm", theirs + "attention.output.LayerNorm")
        linear(ours + "ffn.expand", theirs + "intermediate.dense", hidden, inner)
        linear(ours + "ffn.project", theirs + "output.dense", inner, hidden)
        norm(ours + "output_layer_norm", theirs + "output.LayerNorm")

    # Masked-LM head: transform, tied decoder, output bias.
    linear(HEADS_PREFIX + "transform", "cls.predictions.transform.dense", hidden, hidden)
    norm(HEADS_PREFIX + "transform_layer_norm", "cls.predictions.transform.LayerNorm")
    bias_key, decoder_bias = "cls.predictions.bias", "cls.predictions.decoder.bias"
    if bias_key not in source and decoder_bias in source:  # some versions store only this
        bias_key = decoder_bias
    params[HEADS_PREFIX + "output_bias"] = take(bias_key, (vocab,))
    if decoder_bias in source and decoder_bias not in source.used:
        if not np.array_equal(source[decoder_bias], params[HEADS_PREFIX + "output_bias"]):
            raise CheckpointError(f"tensor {decoder_bias!r} in {weight_file!r} differs from "
                                  f"{bias_key!r}: an untied decoder bias is not supported")
        source.mark_used(decoder_bias)
    decoder = "cls.predictions.decoder.weight"
    if decoder in source:
        word = params[emb + "word_embeddings.embedding_table"]
        if source[decoder].shape != word.shape or not np.array_equal(source[decoder], word):
            raise CheckpointError(f"tensor {decoder!r} in {weight_file!r} differs from the word "
                                  "embeddings: an untied MLM decoder is not supported")
        source.mark_used(decoder)

    # Pooler and next-sentence head: absent from a BertForMaskedLM.
    notes = []
    rng = np.random.default_rng(INIT_SEED)
    std = hf_config["initializer_range"]
    for ours, theirs, n_out, what in (
            (OUR_PREFIX + "pooler.dense", "pooler.dense", hidden, "pooler"),
            (HEADS_PREFIX + "seq_relationship", "cls.seq_relationship", 2,
             "next-sentence head")):
        present = [theirs + suffix in source for suffix in (".weight", ".bias")]
        if any(present):
            linear(ours, theirs, hidden, n_out)
            continue
        params[ours + ".weight"] = rng.normal(0.0, std, (n_out, hidden))
        params[ours + ".bias"] = np.zeros((n_out,))
        notes.append(f"{weight_file} has no {what} ({_display(theirs)}.weight; a "
                     f"BertForMaskedLM has none): {ours} is left at its initialisation "
                     f"(normal std={std}, seed {INIT_SEED}; bias 0) and needs training "
                     "before use")

    source.check_all_used(("embeddings.", "encoder.", "pooler.", "cls."),
                          f"num_hidden_layers={layers}")
    return {name: np.asarray(value, dtype=np.float32) for name, value in params.items()}, notes


def to_hf(config, network) -> tuple:
    """`model-zoo convert bert --to-hf`: (config.json of a BertForPreTraining, its tensors)
    for our pretraining network, the inverse of `map_weights` (the MLM decoder stays tied to
    the word embeddings)."""
    model = config.model
    if model.task != "pretrain":
        raise UserInputError(f"--to-hf exports BertForPreTraining checkpoints (model.task: "
                             f"pretrain), not model.task={model.task!r}")
    params = huggingface.parameters_of(network)
    tensors = {}

    def linear(ours, theirs):
        tensors[theirs + ".weight"] = params[ours + ".weight"]
        tensors[theirs + ".bias"] = params[ours + ".bias"]

    def norm(ours, theirs):
        tensors[theirs + ".weight"] = params[ours + ".gamma"]
        tensors[theirs + ".bias"] = params[ours + ".beta"]

    emb = OUR_PREFIX + "embeddings."
    for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        tensors[f"bert.embeddings.{table}.weight"] = params[f"{emb}{table}.embedding_table"]
    norm(emb + "layer_norm", "bert.embeddings.LayerNorm")
    for i in range(model.num_layers):
        ours, theirs = f"{OUR_PREFIX}encoder.layer.{i}.", f"bert.encoder.layer.{i}."
        fused = [split_head_projections(params[ours + f"attention.qkv.{kind}"],
                                        model.num_heads, 3) for kind in ("weight", "bias")]
        for part, (weight, bias) in zip(("query", "key", "value"), zip(*fused)):
            tensors[f"{theirs}attention.self.{part}.weight"] = weight
            tensors[f"{theirs}attention.self.{part}.bias"] = bias
        linear(ours + "attention.output", theirs + "attention.output.dense")
        norm(ours + "attention_layer_norm", theirs + "attention.output.LayerNorm")
        linear(ours + "ffn.expand", theirs + "intermediate.dense")
        linear(ours + "ffn.project", theirs + "output.dense")
        norm(ours + "output_layer_norm", theirs + "output.LayerNorm")
    linear(OUR_PREFIX + "pooler.dense", "bert.pooler.dense")
    linear(HEADS_PREFIX + "transform", "cls.predictions.transform.dense")
    norm(HEADS_PREFIX + "transform_layer_norm", "cls.predictions.transform.LayerNorm")
    tensors["cls.predictions.bias"] = params[HEADS_PREFIX + "output_bias"]
    linear(HEADS_PREFIX + "seq_relationship", "cls.seq_relationship")
    hf_config = {
        "model_type": "bert", "architectures": ["BertForPreTraining"],
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "intermediate_size": model.ffn_size,
        "hidden_act": "gelu", "hidden_dropout_prob": model.dropout,
        "attention_probs_dropout_prob": model.attention_dropout,
        "max_position_embeddings": model.seq_length, "type_vocab_size": model.type_vocab_size,
        "initializer_range": model.init_std, "layer_norm_eps": model.layer_norm_eps,
        "tie_word_embeddings": True,
        **{key: getattr(model, key) for key in BERT_SPECIAL_IDS},
    }
    return hf_config, tensors


def add_convert_arguments(parser):
    """Arguments of `model-zoo convert bert`."""
    return huggingface.add_convert_arguments(
        parser, "Hugging Face BertForPreTraining or BertForMaskedLM folder (config.json and "
                "model.safetensors or pytorch_model.bin, as written by save_pretrained)")


def run_convert_command(args) -> int:
    """Run `model-zoo convert bert`; returns the exit status."""
    return huggingface.run_convert(
        args, lambda hf_dir, output_dir, overwrite: convert_hf_bert(hf_dir, output_dir,
                                                                    overwrite, log=print),
        to_hf)
