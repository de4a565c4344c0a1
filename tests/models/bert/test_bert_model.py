"""BERT's cells: losses, training, the config, and the operator strategies of BERT-large.

Numerical parity with Hugging Face (post-LN structure, exact GELU, heads) is in
test_bert_hf_parity.py; here the losses are checked against their definitions, a few
optimizer steps must lower the loss, and the strategies of the BERT-large shape are read
from cells built without weights and checked against docs/mindspore-parallel-rules.md.
"""

import math
import os

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.nn.utils import no_init_parameters

from conftest import device_matrix_size
from model_zoo.nn.backend import kernels_for
from model_zoo.models.bert.model import (BertConfig, BertForPreTraining,
                                         BertForSequenceClassification, BertLayer, LogitsCell,
                                         build_bert_network)
from model_zoo.config import TrainConfig
from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import DotProductAttention, MultiHeadAttention
from model_zoo.nn.layers import ExactGELU, LayerNorm
from model_zoo.train.schedule import WarmupCosineSchedule
from model_zoo.train.step import TrainStep, build_optimizer

BATCH, SEQ, VOCAB, PREDICTIONS = 4, 16, 64, 3


def tiny_config(**overrides) -> BertConfig:
    values = dict(num_layers=2, hidden_size=32, num_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                  dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    config = BertConfig(**values)
    config.validate()
    return config


def pretrain_batch(seed=0):
    """A fixed batch: the last sequence padded; its last prediction slot has weight 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(7, VOCAB, (BATCH, SEQ)).astype(np.int32)
    ids[:, 0] = 4
    mask = np.ones((BATCH, SEQ), np.int32)
    mask[-1, SEQ - 5:] = 0
    ids[-1, SEQ - 5:] = 0
    types = np.zeros((BATCH, SEQ), np.int32)
    types[:, SEQ // 2:] = 1
    positions = np.stack([rng.choice(np.arange(1, SEQ - 5), PREDICTIONS, replace=False)
                          for _ in range(BATCH)]).astype(np.int32)
    labels = np.take_along_axis(ids, positions, axis=1).astype(np.int32)
    ids[np.arange(BATCH)[:, None], positions] = 6
    weights = np.ones((BATCH, PREDICTIONS), np.float32)
    weights[-1, -1] = 0.0
    nsp = np.array([0, 1, 1, 0], np.int32)
    return [ids, types, mask, positions, labels, weights, nsp]


def tensors(arrays):
    return [Tensor(a) for a in arrays]


def cross_entropy(logits, labels):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels]


@pytest.fixture(autouse=True)
def graph_mode():
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=mode)


@pytest.fixture(scope="module")
def pretrain_net():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    network = BertForPreTraining(tiny_config())
    network.set_train(False)
    return network


# --- losses ---------------------------------------------------------------------------------

def test_pretraining_loss_is_weighted_mlm_mean_plus_nsp(pretrain_net):
    batch = pretrain_batch()
    loss = float(pretrain_net(*tensors(batch)).asnumpy())
    mlm, nsp = LogitsCell(pretrain_net)(*tensors(batch[:4]))
    assert mlm.shape == (BATCH * PREDICTIONS, VOCAB) and nsp.shape == (BATCH, 2)
    weights = batch[5].reshape(-1)
    mlm_ce = cross_entropy(mlm.asnumpy(), batch[4].reshape(-1))
    expected = (mlm_ce * weights).sum() / weights.sum() + cross_entropy(nsp.asnumpy(),
                                                                        batch[6]).mean()
    assert np.isfinite(loss)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_zero_weight_prediction_is_excluded(pretrain_net):
    batch = pretrain_batch()
    base = float(pretrain_net(*tensors(batch)).asnumpy())
    changed = [a.copy() for a in batch]
    changed[4][-1, -1] = (changed[4][-1, -1] + 1) % VOCAB  # weight 0 there
    assert float(pretrain_net(*tensors(changed)).asnumpy()) == base
    changed[4][0, 0] = (changed[4][0, 0] + 1) % VOCAB  # weight 1 there
    assert float(pretrain_net(*tensors(changed)).asnumpy()) != base


def test_padding_does_not_reach_real_tokens(pretrain_net):
    """Changing padded ids (attention mask 0) leaves the logits of real tokens unchanged."""
    batch = pretrain_batch()
    cell = LogitsCell(pretrain_net)
    mlm, nsp = cell(*tensors(batch[:4]))
    changed = [a.copy() for a in batch[:4]]
    changed[0][-1, SEQ - 5:] = 9
    mlm2, nsp2 = cell(*tensors(changed))
    np.testing.assert_allclose(mlm.asnumpy(), mlm2.asnumpy(), atol=1e-6)
    np.testing.assert_allclose(nsp.asnumpy(), nsp2.asnumpy(), atol=1e-6)


def test_classification_loss_is_cross_entropy_of_logits():
    ms.set_seed(0)
    network = BertForSequenceClassification(tiny_config(task="classify", num_labels=3))
    network.set_train(False)
    ids, types, mask = pretrain_batch()[:3]
    labels = np.array([0, 2, 1, 2], np.int32)
    loss = float(network(*tensors([ids, types, mask, labels])).asnumpy())
    logits = LogitsCell(network)(*tensors([ids, types, mask])).asnumpy()
    assert logits.shape == (BATCH, 3)
    assert loss == pytest.approx(cross_entropy(logits, labels).mean(), rel=1e-5)


def test_loss_decreases_with_training():
    ms.set_seed(0)
    network = BertForPreTraining(tiny_config())
    train = TrainConfig(lr=5e-3, min_lr=5e-4, warmup_steps=0, steps=6)
    schedule = WarmupCosineSchedule(train.lr, train.min_lr, train.warmup_steps, train.steps)
    step = TrainStep(network, build_optimizer(network, train, schedule), schedule,
                     grad_clip=1.0)
    step.set_train(True)
    batch = tensors(pretrain_batch())
    losses = [float(step(*batch)[0].asnumpy()) for _ in range(train.steps)]
    print("losses:", " ".join(f"{value:.4f}" for value in losses))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5


def test_build_bert_network_by_task():
    with no_init_parameters():
        assert isinstance(build_bert_network(tiny_config()), BertForPreTraining)
        assert isinstance(build_bert_network(tiny_config(task="classify")),
                          BertForSequenceClassification)


def test_exact_gelu():
    x = np.linspace(-5, 5, 41, dtype=np.float32).reshape(1, 41)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    got = ExactGELU((1, 1))(Tensor(x)).asnumpy()
    expected = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x[0]])
    np.testing.assert_allclose(got[0], expected, atol=1e-6)


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (dict(task="generate"), "model.task"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(attention_dropout=-0.1), "model.attention_dropout"),
    (dict(num_labels=1), "model.num_labels"),
    (dict(type_vocab_size=0), "model.type_vocab_size"),
    (dict(ffn_hidden_size=-1), "model.ffn_hidden_size"),
    (dict(layer_norm_eps=0.0), "model.layer_norm_eps"),
    (dict(mask_token_id=64), "model.mask_token_id"),
    (dict(sep_token_id=4), "model.sep_token_id"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(**overrides)


def test_config_defaults():
    config = BertConfig()
    assert (config.name, config.task, config.type_vocab_size, config.layer_norm_eps) == \
        ("bert", "pretrain", 2, 1e-12)
    assert (config.pad_token_id, config.cls_token_id, config.sep_token_id,
            config.mask_token_id) == (0, 4, 5, 6)
    assert config.ffn_size == 4 * config.hidden_size


# --- strategies of BERT-large ---------------------------------------------------------------

# BERT-large. The vocabulary is 30528, not the WordPiece vocab's 30522: padded to a multiple
# of 64 it divides by every model_parallel up to 64 when the embedding is split by
# vocabulary (30522 = 2 x 3 x 5087 does not even divide by 4), and gives aligned matmuls.
LARGE = dict(num_layers=24, hidden_size=1024, num_heads=16, seq_length=512, vocab_size=30528,
             ffn_hidden_size=4096)
MODEL_PARALLEL = [1, 2, 4, 8]
_BUILT = {}


def large_net(dp, mp, vocab_emb_dp):
    key = (dp, mp, vocab_emb_dp)
    if key not in _BUILT:
        parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, vocab_emb_dp=vocab_emb_dp)
        with no_init_parameters(), kernels_for("Ascend"):  # the sharded operators
            _BUILT[key] = BertForPreTraining(BertConfig(**LARGE), parallel, ms.float16)
    return _BUILT[key]


def primitives(net: nn.Cell):
    """(cell name, cell, attribute, primitive) for every primitive held by every cell."""
    found = []
    for name, cell in net.cells_and_names():
        seen = set()
        for attr, value in list(cell._primitives.items()) + list(vars(cell).items()):
            if isinstance(value, ops.Primitive) and id(value) not in seen:
                seen.add(id(value))
                found.append((name, cell, attr, value))
    return found


def strategy(prim):
    return prim.attrs.get("in_strategy")


def test_large_shape():
    net = large_net(1, 1, True)
    assert len(net.bert.encoder.layer) == 24
    assert net.bert.embeddings.word_embeddings.embedding_table.shape == (30528, 1024)
    assert net.bert.embeddings.position_embeddings.embedding_table.shape == (512, 1024)
    assert net.bert.encoder.layer[0].ffn.expand.weight.shape == (4096, 1024)
    total = sum(math.prod(p.shape) for p in net.get_parameters())
    assert 330e6 < total < 340e6  # BERT-large with its pre-training heads: about 336M


@pytest.mark.parametrize("vocab_emb_dp", [False, True])
@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_large_every_primitive_has_a_valid_strategy(mp, vocab_emb_dp):
    net = large_net(1, mp, vocab_emb_dp)
    found = primitives(net)
    names = {prim.name for _, _, _, prim in found}
    assert {"MatMul", "BatchMatMul", "Softmax", "Gather", "LayerNorm", "Erf", "OneHot",
            "Tanh"} <= names
    for cell_name, _, attr, prim in found:
        strat = strategy(prim)
        where = f"{cell_name}.{attr} ({prim.name}): {strat}"
        if prim.name == "Cast":  # strategies are ignored for Cast
            continue
        assert strat is not None, f"{where} has no strategy"
        for part in strat:
            assert all(v >= 1 and v & (v - 1) == 0 for v in part), f"{where} (rule G3)"
        assert mp % device_matrix_size(prim, strat) == 0, f"{where} (rule G4)"
        if prim.name in ("MatMul", "BatchMatMul"):
            x, w = strat
            k_x = x[-2] if prim.attrs.get("transpose_a") else x[-1]
            k_w = w[-1] if prim.attrs.get("transpose_b") else w[-2]
            assert k_x == k_w, f"{where}: contracted dimension split differs"
        if prim.name == "Softmax":
            assert strat[0][-1] == 1, where
        if prim.name == "LayerNorm":
            assert strat == ((1, 1, 1), (1,), (1,)), where


@pytest.mark.parametrize("vocab_emb_dp", [False, True])
@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_large_strategies(mp, vocab_emb_dp):
    net = large_net(1, mp, vocab_emb_dp)
    heads = (1, mp, 1, 1)
    attentions = [c for _, c in net.cells_and_names() if isinstance(c, MultiHeadAttention)]
    layers = [c for _, c in net.cells_and_names() if isinstance(c, BertLayer)]
    assert len(attentions) == len(layers) == 24
    for attention in attentions:
        assert strategy(attention.core.scores) == (heads, heads)
        assert strategy(attention.core.context) == (heads, heads)
        assert strategy(attention.core.softmax) == (heads,)
        assert strategy(attention.core.add_bias) == (heads, (1, 1, 1, 1))  # padding bias
        assert not attention.core.causal
    for layer in layers:
        attention, ffn = layer.attention, layer.ffn
        for linear in (attention.qkv, ffn.expand):
            assert strategy(linear.product.matmul) == ((1, 1), (mp, 1))  # column: out split
            assert strategy(linear.product.bias_add) == ((1, mp), (mp,))
        for linear in (attention.output, ffn.project):
            assert strategy(linear.product.matmul) == ((1, mp), (1, mp))  # row: all-reduce
            assert strategy(linear.product.bias_add) == ((1, 1), (1,))
        gelu = ffn.expand.activation
        assert isinstance(gelu, ExactGELU)
        assert strategy(gelu.erf) == ((1, mp),) and strategy(gelu.mul) == ((1, mp), (1, mp))
    vocab = 1 if vocab_emb_dp else mp
    embeddings = net.bert.embeddings
    assert strategy(embeddings.word_embeddings.gather) == ((vocab, 1), (1, 1))
    assert strategy(embeddings.token_type_embeddings.gather) == ((1, 1), (1, 1))  # 2 rows
    # The tied table has one layout in both of its users.
    assert strategy(net.cls.decoder.product.matmul) == ((1, 1), (vocab, 1))
    assert strategy(net.cls.add_output_bias) == ((1, vocab), (vocab,))
    norms = [c for _, c in net.cells_and_names() if isinstance(c, LayerNorm)]
    assert len(norms) == 2 * 24 + 2  # two per layer, embeddings, MLM transform


def test_hybrid_layout_strategies():
    net = large_net(2, 4, False)
    attention = net.bert.encoder.layer[0].attention
    assert strategy(attention.core.scores) == ((2, 4, 1, 1), (2, 4, 1, 1))
    assert strategy(attention.core.add_bias) == ((2, 4, 1, 1), (2, 1, 1, 1))
    assert strategy(net.bert.embeddings.word_embeddings.gather) == ((4, 1), (2, 1))
    assert strategy(net.bert.embeddings.token_type_embeddings.gather) == ((1, 1), (2, 1))
    assert strategy(net.gather_positions.one_hot) == ((2, 1, 1), (), ())
    assert strategy(net.gather_positions.matmul) == ((2, 1, 1), (2, 1, 1))
    assert strategy(net.bert.padding_bias.invert) == ((), (2, 1))
    # vocabulary-parallel MLM loss; the 2-class NSP loss keeps its classes whole
    assert strategy(net.mlm_loss.exp) == ((2, 4),)
    assert strategy(net.mlm_loss.one_hot) == ((2, 4), (), ())
    assert strategy(net.nsp_loss.softmax_cross_entropy) == ((2, 1), (2, 1))


def test_pipeline_stages():
    parallel = ParallelConfig(pipeline_stage=4, micro_batch_num=4)
    with no_init_parameters():
        net = BertForPreTraining(tiny_config(num_layers=8), parallel)
    assert [layer.pipeline_stage for layer in net.bert.encoder.layer] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert net.bert.embeddings.pipeline_stage == 0
    assert net.bert.pooler.pipeline_stage == net.cls.pipeline_stage == 3


# --- divisibility errors at construction ----------------------------------------------------

def build_error(parallel, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        with no_init_parameters():
            BertForPreTraining(tiny_config(**overrides), parallel)
    return str(info.value)


def test_heads_not_divisible_by_model_parallel():
    message = build_error(ParallelConfig(model_parallel=4), num_heads=6, hidden_size=96)
    assert "model.num_heads=6" in message and "parallel.model_parallel=4" in message


def test_ffn_not_divisible_by_model_parallel():
    message = build_error(ParallelConfig(model_parallel=8), num_heads=8, ffn_hidden_size=100)
    assert "model.ffn_hidden_size=100" in message


def test_vocab_divisible_only_when_split():
    message = build_error(ParallelConfig(model_parallel=4, vocab_emb_dp=False), vocab_size=30522)
    assert "model.vocab_size=30522" in message and "parallel.model_parallel=4" in message
    with no_init_parameters():
        BertForPreTraining(tiny_config(vocab_size=30522),
                           ParallelConfig(model_parallel=4, vocab_emb_dp=True))


# --- strategies against real shapes ---------------------------------------------------------

@pytest.mark.parametrize("dp, mp", [(2, 2), (1, 4)])
def test_strategies_fit_real_shapes(monkeypatch, dp, mp):
    """Run a tiny model stand-alone in PyNative mode (strategies are ignored) and check every
    primitive call: one sub-strategy per tensor input with that input's rank (G1), each
    split dividing its dimension (G2). OneHot's first strategy describes its output."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, vocab_emb_dp=False)
    with kernels_for("Ascend"):  # the sharded operators, not CPU's fused kernels
        net = BertForPreTraining(tiny_config(num_layers=1, dropout=0.1, attention_dropout=0.1),
                                 parallel)
    found = primitives(net)
    owners = {id(prim): f"{name}.{attr}" for name, _, attr, prim in found}
    attention_prims = {f"{name}.{attr}" for name, cell, attr, _ in found
                       if isinstance(cell, (MultiHeadAttention, DotProductAttention))}
    calls, depth = [], []
    for cls in {type(prim) for _, _, _, prim in primitives(net)}:
        def spy(self, *args, _call=cls.__call__):
            if id(self) in owners and not depth:  # outermost call only
                calls.append((owners[id(self)], self, args))
            depth.append(1)
            try:
                return _call(self, *args)
            finally:
                depth.pop()
        monkeypatch.setattr(cls, "__call__", spy)
    net.set_train(True)
    loss = float(net(*tensors(pretrain_batch())).asnumpy())
    assert np.isfinite(loss)
    ran = {owner for owner, _, _ in calls}
    # Only attention primitives BERT does not use (causal mask, decoding cache) may stay idle.
    assert set(owners.values()) - ran <= attention_prims, set(owners.values()) - ran
    for attr in ("scores", "add_bias", "softmax", "context"):
        assert f"bert.encoder.layer.0.attention.core.{attr}" in ran, attr
    for owner, prim, args in calls:
        strat = strategy(prim)
        shapes = [tuple(a.shape) for a in args if isinstance(a, Tensor)]
        if prim.name == "OneHot":
            shapes[0] = shapes[0] + (args[1],)
        if prim.name == "Cast":
            continue
        where = f"{owner} ({prim.name}): strategy {strat}, shapes {shapes}"
        assert len(strat) == len(shapes), where
        for part, shape in zip(strat, shapes):
            assert len(part) == len(shape), where
            assert all(dim % split == 0 for dim, split in zip(shape, part)), where
