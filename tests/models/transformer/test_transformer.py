"""The Transformer: parity with torch.nn.Transformer, incremental decoding against full
recomputation, greedy and beam search, label smoothing, training (in process and through
the command line) and the layout configs' operator strategies.

Single forward passes and decoding run in PYNATIVE mode (no graph to compile for a few
calls); training runs in GRAPH mode as the trainer does. MindSpore's context is
process-wide, so every test restores the mode it found.
"""

import contextlib
import glob
import json
import math
import os
import re
import warnings

import numpy as np
import pytest
import yaml
import mindspore as ms
from mindspore import Tensor, nn
from mindspore.nn.utils import no_init_parameters

from conftest import run_cli, write_pairs
from model_zoo.nn.backend import kernels_for
from model_zoo.config import TrainConfig, load_config
from model_zoo.nn.attention import MultiHeadAttention, fuse_head_projections
from model_zoo.nn.layers import sinusoid_table
from model_zoo.nn.loss import CrossEntropy
from model_zoo.layout.rules import check_recording
from model_zoo.layout.trace import record
from model_zoo.train.schedule import build_schedule
from model_zoo.train.step import TrainStep, build_optimizer
from model_zoo.models.transformer import data as tdata
from model_zoo.models.transformer.decode import Translator
from model_zoo.models.transformer.pairs import CATALOG_ROOT, message_catalog_pairs
from model_zoo.models.transformer.model import (Transformer, TransformerConfig,
                                                TransformerForTraining)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CONFIG_DIR = os.path.join(ROOT, "model_zoo", "models", "transformer", "configs")
LAYOUT_DIR = os.path.join(CONFIG_DIR, "plan")
LAYOUT_CONFIGS = sorted(os.path.basename(path)
                        for path in glob.glob(os.path.join(LAYOUT_DIR, "transformer-*.yaml")))
PAD, BOS, EOS = 0, 2, 3


@contextlib.contextmanager
def mode(value):
    previous = ms.get_context("mode")
    ms.set_context(mode=value, device_target="CPU")
    try:
        yield
    finally:
        ms.set_context(mode=previous)


@pytest.fixture
def pynative():
    with mode(ms.PYNATIVE_MODE):
        yield


def tiny_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, seq_length=10,
                  vocab_size=23, dropout=0.0, attention_dropout=0.0, label_smoothing=0.0,
                  max_decode_extra=4)
    values.update(overrides)
    return TransformerConfig(**values)


def log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def padded_sources(rng, lengths, vocab, width):
    """Random sources (tokens 4.., then eos) padded to `width`, and their masks."""
    ids = np.zeros((len(lengths), width), np.int32)
    for row, length in enumerate(lengths):
        ids[row, :length - 1] = rng.integers(4, vocab, length - 1)
        ids[row, length - 1] = EOS
    return ids, (ids != PAD).astype(np.int32)


# --- torch.nn.Transformer reference ----------------------------------------------------------

class DecoderHidden(nn.Cell):
    """The decoder's final normed hidden states (before the vocabulary projection)."""

    def __init__(self, transformer):
        super().__init__(auto_prefix=False)
        self.transformer = transformer

    def construct(self, decoder_input_ids, memory, source_bias):
        x = self.transformer.embed(decoder_input_ids, False)
        for layer in self.transformer.decoder_layers:
            x = layer(x, memory, source_bias)
        return self.transformer.decoder_norm(x)


def copy_torch_weights(ours: Transformer, reference):
    """torch.nn.Transformer's weights into our cells (same layout: weight (out, in))."""

    def put(param, value):
        value = value.detach().numpy() if hasattr(value, "detach") else value
        param.set_data(Tensor(np.asarray(value, np.float32)))

    def attention(cell, module):
        weights = [w.detach().numpy() for w in module.in_proj_weight.chunk(3)]
        biases = [b.detach().numpy() for b in module.in_proj_bias.chunk(3)]
        heads = cell.num_heads
        if cell.cross:  # query, and keys and values fused head by head
            put(cell.query.weight, weights[0])
            put(cell.query.bias, biases[0])
            put(cell.key_value.weight, fuse_head_projections(weights[1:], heads))
            put(cell.key_value.bias, fuse_head_projections(biases[1:], heads))
        else:
            put(cell.qkv.weight, fuse_head_projections(weights, heads))
            put(cell.qkv.bias, fuse_head_projections(biases, heads))
        put(cell.output.weight, module.out_proj.weight)
        put(cell.output.bias, module.out_proj.bias)

    def feed_forward(cell, layer):
        put(cell.expand.weight, layer.linear1.weight)
        put(cell.expand.bias, layer.linear1.bias)
        put(cell.project.weight, layer.linear2.weight)
        put(cell.project.bias, layer.linear2.bias)

    def norm(cell, module):
        put(cell.gamma, module.weight)
        put(cell.beta, module.bias)

    for ours_layer, layer in zip(ours.encoder_layers, reference.encoder.layers):
        attention(ours_layer.self_attention.function, layer.self_attn)
        norm(ours_layer.self_attention.norm, layer.norm1)
        feed_forward(ours_layer.feed_forward.function, layer)
        norm(ours_layer.feed_forward.norm, layer.norm2)
    for ours_layer, layer in zip(ours.decoder_layers, reference.decoder.layers):
        attention(ours_layer.self_attention.function, layer.self_attn)
        norm(ours_layer.self_attention.norm, layer.norm1)
        attention(ours_layer.cross_attention.function, layer.multihead_attn)
        norm(ours_layer.cross_attention.norm, layer.norm2)
        feed_forward(ours_layer.feed_forward.function, layer)
        norm(ours_layer.feed_forward.norm, layer.norm3)
    norm(ours.encoder_norm, reference.encoder.norm)
    norm(ours.decoder_norm, reference.decoder.norm)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_matches_torch_transformer(placement, pynative):
    torch = pytest.importorskip("torch")
    config = tiny_config(vocab_size=50, seq_length=12, layer_norm_eps=1e-5,
                         norm_placement=placement)
    ours = Transformer(config)
    ours.set_train(False)
    torch.manual_seed(0)
    with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first"
        warnings.simplefilter("ignore")
        reference = torch.nn.Transformer(
            d_model=config.hidden_size, nhead=config.num_heads,
            num_encoder_layers=config.num_layers, num_decoder_layers=config.num_layers,
            dim_feedforward=config.ffn_size, dropout=0.0, activation="relu",
            batch_first=True, norm_first=placement == "pre",
            layer_norm_eps=config.layer_norm_eps).eval()
    # torch initialises biases to 0 and norms to (1, 0): perturb every parameter so the
    # mapping of biases and norms is checked too.
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.1 * torch.randn_like(param))
    copy_torch_weights(ours, reference)

    rng = np.random.default_rng(1)
    source_ids, source_mask = padded_sources(rng, [9, 5, 2], config.vocab_size, 9)
    target_ids = np.concatenate([np.full((3, 1), BOS), rng.integers(4, 50, (3, 6))],
                                axis=1).astype(np.int32)
    # Both stacks take the same inputs: our embedding (scaled by sqrt(hidden)) plus the
    # sinusoids, computed in numpy for torch.
    table = ours.embedding.embedding_table.asnumpy()
    positions = sinusoid_table(32, config.hidden_size)

    def embedded(ids):
        return torch.from_numpy(table[ids] * math.sqrt(config.hidden_size)
                                + positions[:ids.shape[1]])

    memory, source_bias = ours.encode(Tensor(source_ids), Tensor(source_mask))
    hidden = DecoderHidden(ours)(Tensor(target_ids), memory, source_bias).asnumpy()
    logits = ours.decode(Tensor(target_ids), memory, source_bias).asnumpy()

    padding = torch.from_numpy(source_mask == 0)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(target_ids.shape[1])
    # Gradients stay enabled: torch's inference fast path (nested tensors) would zero the
    # padded positions instead of computing them.
    their_memory = reference.encoder(embedded(source_ids), src_key_padding_mask=padding)
    their_hidden = reference.decoder(embedded(target_ids), their_memory, tgt_mask=causal,
                                     tgt_is_causal=True, memory_key_padding_mask=padding)
    their_memory = their_memory.detach().numpy()
    their_hidden = their_hidden.detach().numpy()
    their_logits = their_hidden.reshape(-1, config.hidden_size) @ table.T

    memory_diff = np.abs(memory.asnumpy() - their_memory).max()
    hidden_diff = np.abs(hidden - their_hidden).max()
    logits_diff = np.abs(logits - their_logits).max()
    print(f"{placement}: max |difference| memory {memory_diff:.2e}, decoder hidden "
          f"{hidden_diff:.2e}, logits {logits_diff:.2e}")
    assert np.abs(their_hidden).max() > 0.5  # not a degenerate comparison
    assert memory_diff < 1e-4 and hidden_diff < 1e-4 and logits_diff < 1e-4


# --- incremental decoding ---------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["pre", "post"])
def test_incremental_decoder_matches_full_recomputation(placement, pynative):
    ms.set_seed(3)
    config = tiny_config(norm_placement=placement)
    transformer = Transformer(config)
    translator = Translator(transformer)
    rng = np.random.default_rng(2)
    source_ids, source_mask = padded_sources(rng, [7, 3], config.vocab_size, 7)
    prefix = np.concatenate([np.full((2, 1), BOS), rng.integers(4, config.vocab_size, (2, 5))],
                            axis=1)
    memory, source_bias = transformer.encode(Tensor(source_ids), Tensor(source_mask))

    caches, cross = translator.prepare(source_ids, source_mask, 1)
    rows = np.arange(2)
    worst = 0.0
    for position in range(prefix.shape[1]):
        values, ids, caches = translator._step(prefix[:, position], rows, position, caches,
                                               cross, config.vocab_size)
        assert (np.diff(values, axis=1) <= 0).all()  # sorted, best first
        incremental = np.full((2, config.vocab_size), np.nan)
        np.put_along_axis(incremental, ids.astype(np.int64), values, axis=1)
        assert not np.isnan(incremental).any()  # top_k = vocab: every id once
        logits = transformer.decode(Tensor(prefix[:, :position + 1].astype(np.int32)), memory,
                                    source_bias).asnumpy()
        full = log_softmax(logits.reshape(2, position + 1, -1)[:, -1])
        worst = max(worst, np.abs(incremental - full).max())
    print(f"{placement}: max |log-prob difference| incremental vs full {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.slow
def test_greedy_steps_match_full_recomputation():
    """The greedy path's steps (one continuation, no cache reordering: the decoding-step
    attention kernel on CPU, which writes the caches in place) choose the argmax of a full
    recomputation of the prefix at every position, with its log-probability."""
    ms.set_seed(3)
    config = tiny_config()
    transformer = Transformer(config)
    translator = Translator(transformer)
    rng = np.random.default_rng(4)
    source_ids, source_mask = padded_sources(rng, [7, 3], config.vocab_size, 7)
    memory, source_bias = transformer.encode(Tensor(source_ids), Tensor(source_mask))
    caches, cross = translator.prepare(source_ids, source_mask, 1)
    tokens, prefix = np.full(2, BOS), np.full((2, 1), BOS)
    for position in range(6):
        values, ids, caches = translator._step(tokens, np.arange(2), position, caches, cross, 1)
        logits = transformer.decode(Tensor(prefix.astype(np.int32)), memory,
                                    source_bias).asnumpy()
        full = log_softmax(logits.reshape(2, position + 1, -1)[:, -1])
        np.testing.assert_array_equal(ids[:, 0], full.argmax(axis=1))
        np.testing.assert_allclose(values[:, 0], full.max(axis=1), atol=1e-4)
        tokens = ids[:, 0]
        prefix = np.concatenate([prefix, tokens[:, None]], axis=1)


# --- search on a model trained to copy ----------------------------------------------------------

COPY_VOCAB, COPY_SEQ, COPY_STEPS = 20, 10, 300


def copy_batch(rng, batch=32):
    """The copy task: the target is the source. BATCH_COLUMNS as numpy arrays."""
    lengths = rng.integers(3, COPY_SEQ, batch)  # with eos
    source_ids, source_mask = padded_sources(rng, lengths, COPY_VOCAB, COPY_SEQ)
    decoder_input_ids = np.zeros_like(source_ids)
    decoder_input_ids[:, 0] = BOS
    decoder_input_ids[:, 1:] = np.where(source_ids[:, :-1] == EOS, PAD, source_ids[:, :-1])
    return (source_ids, source_mask, decoder_input_ids, source_mask.copy(), source_ids.copy())


@pytest.fixture(scope="module")
def copy_model():
    """A 2+2-layer Transformer trained (GRAPH mode, as the trainer) to copy its source."""
    ms.set_seed(0)
    config = tiny_config(vocab_size=COPY_VOCAB, seq_length=COPY_SEQ, label_smoothing=0.1)
    network = TransformerForTraining(config)
    train_config = TrainConfig(steps=COPY_STEPS, lr=5e-3, warmup_steps=20,
                               lr_schedule="inverse_sqrt", weight_decay=0.0, adam_beta2=0.98)
    schedule = build_schedule(train_config)
    step = TrainStep(network, build_optimizer(network, train_config, schedule), schedule,
                     grad_clip=1.0)
    step.set_train(True)
    rng = np.random.default_rng(0)
    losses = []
    with mode(ms.GRAPH_MODE):
        for _ in range(COPY_STEPS):
            losses.append(float(step(*map(Tensor, copy_batch(rng)))[0].asnumpy()))
    network.set_train(False)
    return network.transformer, losses


def test_training_loss_falls(copy_model):
    losses = copy_model[1]
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"copy task loss: {first:.3f} -> {last:.3f} in {COPY_STEPS} steps")
    assert all(math.isfinite(loss) for loss in losses)
    assert first > math.log(COPY_VOCAB) - 0.5  # starts near chance
    assert last < 1.0, f"loss did not fall enough: {first:.3f} -> {last:.3f}"


def sequence_score(transformer, source_ids, source_mask, outputs, alpha):
    """Model log-probability of each output followed by eos, divided by the GNMT length
    penalty ((5 + length) / 6) ** alpha, length counting eos (as beam_search scores)."""
    scores = []
    for row, output in enumerate(outputs):
        target = list(output) + [EOS]
        decoder_input = np.array([[BOS] + target[:-1]], np.int32)
        memory, bias = transformer.encode(Tensor(source_ids[row:row + 1]),
                                          Tensor(source_mask[row:row + 1]))
        logits = transformer.decode(Tensor(decoder_input), memory, bias).asnumpy()
        logp = log_softmax(logits)[np.arange(len(target)), target].sum()
        scores.append(logp / ((5.0 + len(target)) / 6.0) ** alpha)
    return np.array(scores)


@pytest.fixture(scope="module")
def searched(copy_model):
    """Greedy, beam 1 and beam 4 outputs for six held-out sources."""
    transformer = copy_model[0]
    source_ids, source_mask, *_ = copy_batch(np.random.default_rng(7), batch=6)
    translator = Translator(transformer)
    with mode(ms.PYNATIVE_MODE):
        return {"sources": (source_ids, source_mask),
                "greedy": translator.greedy(source_ids, source_mask),
                "beam1": translator.beam_search(source_ids, source_mask, 1, 0.0),
                "beam1_lp": translator.beam_search(source_ids, source_mask, 1, 0.6),
                "beam4": translator.beam_search(source_ids, source_mask, 4, 0.6),
                "limit": translator._length_limit(source_mask)}


def test_greedy_copies_the_source(searched):
    source_ids, source_mask = searched["sources"]
    expected = [row[:mask.sum() - 1].tolist() for row, mask in zip(source_ids, source_mask)]
    copied = sum(output == want for output, want in zip(searched["greedy"], expected))
    print(f"greedy copies {copied} of {len(expected)} sources exactly")
    assert all(searched["greedy"]), "an empty output: the model only says eos"
    assert copied >= len(expected) // 2


def test_beam_search_is_the_same_without_the_cpu_kernels(searched, copy_model):
    """The one-pass cache reordering and top-k kernels give what MindSpore's Gather,
    ScatterNdUpdate, LogSoftmax and TopK give."""
    transformer = copy_model[0]
    layers = [layer.self_attention.function for layer in transformer.decoder_layers]
    kernels = [layer.reorder_kernel for layer in layers]
    assert all(kernel is not None for kernel in kernels)
    try:
        for layer in layers:
            layer.reorder_kernel = None
        translator = Translator(transformer)
        translator.step_cell(8).fused_top = None
        with mode(ms.PYNATIVE_MODE):
            assert translator.beam_search(*searched["sources"], 4, 0.6) == searched["beam4"]
    finally:
        for layer, kernel in zip(layers, kernels):
            layer.reorder_kernel = kernel


def test_beam_of_one_is_greedy(searched):
    assert searched["beam1"] == searched["greedy"]


def test_beam_search_ends_before_the_limit_and_scores_at_least_greedy(searched, copy_model,
                                                                      pynative):
    limit = searched["limit"]
    for output in searched["beam4"]:
        assert 0 < len(output) < limit  # ended with eos, not cut at the limit
        assert EOS not in output and PAD not in output and BOS not in output
    source_ids, source_mask = searched["sources"]
    beam4 = sequence_score(copy_model[0], source_ids, source_mask, searched["beam4"], 0.6)
    beam1 = sequence_score(copy_model[0], source_ids, source_mask, searched["beam1_lp"], 0.6)
    print(f"normalised log-prob: beam 4 {beam4.round(3)}, beam 1 {beam1.round(3)}")
    assert (beam4 >= beam1 - 1e-5).all()


def test_fp16_decoding(copy_model, searched, pynative):
    """With fp16 precision (the base and big configs) the cached keys and values are fp16
    like the queries, and the trained model decodes as in fp32."""
    fp32 = copy_model[0]
    fp16 = Transformer(fp32.config, compute_dtype=ms.float16)
    for target, source in zip(fp16.get_parameters(), fp32.get_parameters()):
        assert source.name.endswith(target.name)
        target.set_data(source.data.copy())
    translator = Translator(fp16)
    source_ids, source_mask = searched["sources"]
    assert translator.greedy(source_ids, source_mask) == searched["greedy"]
    assert translator.beam_search(source_ids, source_mask, 4, 0.6) == searched["beam4"]


# --- label smoothing --------------------------------------------------------------------------

def smoothed_loss(logits, labels, mask, smoothing):
    """(1 - e) NLL + e * mean over classes of -log p, averaged over the masked tokens."""
    logp = log_softmax(logits)
    nll = -logp[np.arange(len(labels)), labels]
    per_token = (1.0 - smoothing) * nll + smoothing * (-logp.mean(axis=-1))
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_cross_entropy(smoothing, pynative):
    from model_zoo.parallel.config import ParallelConfig
    rng = np.random.default_rng(4)
    logits = rng.normal(0.0, 3.0, (12, 17)).astype(np.float32)
    labels = rng.integers(0, 17, 12).astype(np.int32)
    mask = (rng.random(12) < 0.7).astype(np.float32)
    loss = CrossEntropy(parallel_config=ParallelConfig(), label_smoothing=smoothing,
                        num_classes=17)(Tensor(logits), Tensor(labels), Tensor(mask))
    assert float(loss.asnumpy()) == pytest.approx(smoothed_loss(logits, labels, mask, smoothing),
                                                  abs=1e-5)


def test_training_loss_is_the_smoothed_loss_of_the_logits(pynative):
    ms.set_seed(5)
    config = tiny_config(vocab_size=COPY_VOCAB, seq_length=COPY_SEQ, label_smoothing=0.1)
    network = TransformerForTraining(config)
    network.set_train(False)
    batch = copy_batch(np.random.default_rng(5), batch=4)
    loss = float(network(*map(Tensor, batch)).asnumpy())
    logits = network.transformer(*map(Tensor, batch[:3])).asnumpy()
    expected = smoothed_loss(logits, batch[4].reshape(-1), batch[3].reshape(-1), 0.1)
    assert loss == pytest.approx(expected, abs=1e-5)


# --- the command line on a tiny slice of the message-catalog pairs -----------------------------

CATALOGS = os.path.join(CATALOG_ROOT, "de", "LC_MESSAGES")
CLI_VOCAB, CLI_SEQ = 300, 16


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A tiny dataset (600 short catalog pairs, vocab 300, one bucket of 16 tokens, 16 dev
    and 16 test pairs before the length filter), a 6-step `train` run on it, its config
    and checkpoint."""
    if not glob.glob(os.path.join(CATALOGS, "*.mo")):
        pytest.skip(f"no German message catalogs in {CATALOGS}")
    root = tmp_path_factory.mktemp("transformer_cli")
    pairs = [pair for pair in message_catalog_pairs() if max(map(len, pair)) <= 24]
    dataset_dir = root / "data"
    manifest = tdata.build_translation_dataset(
        dataset_dir, [write_pairs(root / "pairs.tsv", pairs[::8][:600])], vocab_size=CLI_VOCAB,
        seq_length=CLI_SEQ, dev_size=16, test_size=16, seed=1, buckets=[CLI_SEQ],
        source="catalog slice (test)", record_sources=False)
    config = {
        "model": {"name": "transformer", "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                  "ffn_hidden_size": 64, "seq_length": CLI_SEQ, "vocab_size": CLI_VOCAB,
                  "dropout": 0.0, "attention_dropout": 0.0, "beam_size": 1,
                  "max_decode_extra": 4},
        "parallel": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1},
        "train": {"steps": 6, "global_batch_size": 16, "lr": 1.0e-2, "warmup_steps": 0,
                  "lr_schedule": "inverse_sqrt", "precision": "fp32", "save_steps": 6,
                  "log_steps": 1, "seed": 1, "device_target": "CPU"},
        "data": {"dataset_dir": str(dataset_dir), "sources": ["builtin:locale-de"],
                 "dev_size": 16, "test_size": 16},
    }
    config_path = root / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = root / "run"
    result = run_cli("train", config_path, "--output-dir", run_dir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {"root": root, "config": config_path, "manifest": manifest, "run_dir": run_dir,
            "stdout": result.stdout, "ckpt": run_dir / "checkpoints" / "step_00000006.ckpt"}


def test_cli_train_runs_and_evaluates(cli_run):
    metrics = [json.loads(line)
               for line in (cli_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in metrics] == list(range(1, 7))
    assert all(math.isfinite(entry["loss"]) for entry in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert cli_run["ckpt"].is_file()
    printed = re.search(r"held-out evaluation: (\{.*\})", cli_run["stdout"])
    assert printed and "bleu" in json.loads(printed.group(1))


def test_cli_eval_prints_bleu(cli_run):
    result = run_cli("eval", cli_run["config"], "--ckpt", cli_run["ckpt"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    report = json.loads(lines[0])
    assert math.isfinite(report["bleu"]) and 0.0 <= report["bleu"] <= 100.0
    assert report["split"] == "test" and report["sentences"] == \
        cli_run["manifest"]["splits"]["test"]["kept"] > 10
    # the checkpoint holds the final weights: the score the training run printed
    printed = re.search(r"held-out evaluation: (\{.*\})", cli_run["stdout"]).group(1)
    assert report == json.loads(printed)


def test_cli_translate_prints_one_line_per_input_line(cli_run):
    lines = ["Could not open the file", "", "Show hidden files", "Delete the selected items"]
    source = cli_run["root"] / "input.en"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run_cli("translate", cli_run["config"], "--ckpt", cli_run["ckpt"],
                     "--input", source, "--beam", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout.split("\n")
    assert output[-1] == ""  # print's newline
    assert len(output[:-1]) == len(lines), result.stdout
    assert output[1] == ""  # a blank line stays blank


# --- layout configs --------------------------------------------------------------------------

def test_configs_for_the_layout_table():
    for name in ("transformer-base.yaml", "transformer-big.yaml"):
        assert os.path.isfile(os.path.join(CONFIG_DIR, name))
    expected = {f"transformer-base-dp{n}.yaml" for n in (8, 16, 32, 64)} | {
        f"transformer-base-dp{dp}-mp{mp}.yaml" for dp, mp in ((2, 4), (4, 4), (4, 8), (8, 8))}
    assert set(LAYOUT_CONFIGS) == expected
    base = load_config(os.path.join(CONFIG_DIR, "transformer-base.yaml"))
    model, train = base.model, base.train
    assert (model.num_layers, model.hidden_size, model.num_heads, model.ffn_size,
            model.seq_length, model.vocab_size) == (6, 512, 8, 2048, 128, 32000)
    assert (model.dropout, model.label_smoothing, model.norm_placement) == (0.1, 0.1, "post")
    assert (train.lr_schedule, train.warmup_steps, train.adam_beta2, train.precision) == \
        ("inverse_sqrt", 4000, 0.98, "fp16")
    # the peak lr is the paper's d_model^-0.5 * warmup^-0.5
    assert train.lr == pytest.approx(512 ** -0.5 * 4000 ** -0.5, rel=0.01)
    big = load_config(os.path.join(CONFIG_DIR, "transformer-big.yaml")).model
    assert (big.hidden_size, big.num_heads, big.ffn_size, big.dropout) == (1024, 16, 4096, 0.3)


def strategy(prim):
    return prim.attrs.get("in_strategy")


@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_layout_config_builds_with_its_strategies(name):
    config = load_config(os.path.join(LAYOUT_DIR, name))
    parallel = config.parallel
    dp, mp = parallel.dp, parallel.mp
    match = re.fullmatch(r"transformer-base-dp(\d+)(?:-mp(\d+))?\.yaml", name)
    if match:  # the name says the layout
        assert (dp, mp) == (int(match.group(1)), int(match.group(2) or 1))
        assert config.data.dataset_dir == "datasets/transformer-base"
        assert parallel.vocab_emb_dp == (mp == 1)
    parallel.check_batch(config.train.global_batch_size, config.train.grad_accumulation)
    with no_init_parameters(), kernels_for("Ascend"):  # the sharded operators
        network = TransformerForTraining(config.model, parallel, ms.float16)
    transformer = network.transformer

    heads = (dp, mp, 1, 1)
    attentions = [cell for _, cell in network.cells_and_names()
                  if isinstance(cell, MultiHeadAttention)]
    assert len(attentions) == 3 * config.model.num_layers  # encoder self, decoder self + cross
    for layer in transformer.decoder_layers:
        assert layer.cross_attention.function in attentions
    for attention in attentions:
        assert strategy(attention.core.scores) == (heads, heads)
        assert strategy(attention.core.context) == (heads, heads)
        assert strategy(attention.core.softmax) == (heads,)
        projections = ((attention.query, attention.key_value) if attention.cross
                       else (attention.qkv,))
        for projection in projections:
            assert strategy(projection.product.matmul) == ((dp, 1), (mp, 1))
        assert strategy(attention.core.take_part) == ((dp, 1, mp, 1),)
        assert strategy(attention.output.product.matmul) == ((dp, mp), (1, mp))
    for layer in transformer.encoder_layers:
        assert strategy(layer.feed_forward.function.expand.product.matmul) == ((dp, 1), (mp, 1))
    if parallel.vocab_emb_dp:
        assert strategy(transformer.embedding.gather) == ((1, 1), (dp, 1))
        assert strategy(transformer.projection.product.matmul) == ((dp, 1), (1, 1))
    else:  # the vocabulary is split over mp
        assert strategy(transformer.embedding.gather) == ((mp, 1), (dp, 1))
        assert strategy(transformer.projection.product.matmul) == ((dp, 1), (mp, 1))
    assert config.model.vocab_size % mp == 0

    # Every strategy against the shapes its operator really receives (the offline plan
    # check: one forward pass with the shapes inferred, nothing computed), at the micro
    # batch MindSpore sees and the longest bucket.
    micro_batch = config.train.global_batch_size // config.train.grad_accumulation
    inputs = [((micro_batch, config.model.seq_length), ms.int32)] * 5
    recording = record(network, inputs, dataset_layout=parallel.devices_per_stage)
    assert len([call for call in recording.calls if call.name == "BatchMatMul"]) == \
        2 * 3 * config.model.num_layers
    violations = check_recording(recording, parallel, parallel.device_num)
    assert not violations, "\n".join(map(str, violations))
