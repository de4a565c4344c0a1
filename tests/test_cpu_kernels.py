"""The fused CPU kernels against torch's layer norm, GELU, cross-entropy, linear layer and
top-k, both directions, through the layers that use them; and the fallback to MindSpore's
operators."""

from pathlib import Path

import numpy as np
import pytest
import torch
import mindspore as ms
from mindspore import Tensor, nn

from model_zoo.nn import cpu_kernels
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import DotProductAttention, FusedCpuAttention, MultiHeadAttention
from model_zoo.nn.backend import (AddKernel, DenseProduct, FewRowsProduct, NormKernel,
                                  kernels_for)
from model_zoo.nn.layers import (GatedFeedForward, LayerNorm, Linear, MatMulProduct,
                                  PositionEmbedding, ResidualAdd, RMSNorm)
from model_zoo.nn.loss import CrossEntropy

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")
RNG = np.random.default_rng(0)


def parts(layer) -> set:
    """The classes of the cells a linear layer's product is made of (`backend.linear_product`)."""
    return {type(cell) for _, cell in layer.product.cells_and_names()}


def operators_of(layer) -> MatMulProduct:
    """A linear layer's product on operators, where it has one."""
    return next(cell for _, cell in layer.product.cells_and_names()
                if isinstance(cell, MatMulProduct))


class Weighted(nn.Cell):
    """sum(layer(*inputs) * weights): a scalar whose gradient is `weights` at the output."""

    def __init__(self, layer, weights):
        super().__init__()
        self.layer, self.weights = layer, Tensor(weights)

    def construct(self, *inputs):
        return (self.layer(*inputs) * self.weights).sum()


def value_and_grads(layer, weights, *inputs):
    """Graph-mode output and gradients with respect to the first input and the parameters."""
    loss = Weighted(layer, weights)
    grad = ms.jit(ms.grad(loss, grad_position=0, weights=layer.trainable_params()))
    dx, dparams = grad(*inputs)
    return ms.jit(layer)(*inputs).asnumpy(), dx.asnumpy(), [g.asnumpy() for g in dparams]


def test_layer_norm_matches_torch():
    # 2,000 rows: split over the cores, each part summing its own dgamma and dbeta
    x = RNG.normal(size=(40, 50, 48)).astype(np.float32) * 3 + 1
    weights = RNG.normal(size=x.shape).astype(np.float32)
    layer = LayerNorm(48, parallel_config=ParallelConfig(), eps=1e-5)
    assert isinstance(layer.normalize, NormKernel)
    gamma, beta = RNG.normal(size=48).astype(np.float32), RNG.normal(size=48).astype(np.float32)
    layer.gamma.set_data(Tensor(gamma))
    layer.beta.set_data(Tensor(beta))
    y, dx, (dgamma, dbeta) = value_and_grads(layer, weights, Tensor(x))

    tx, tgamma, tbeta = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    ty = torch.nn.functional.layer_norm(tx, (48,), tgamma, tbeta, 1e-5)
    (ty * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=2e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(dgamma, tgamma.grad.numpy(), atol=1e-4)
    np.testing.assert_allclose(dbeta, tbeta.grad.numpy(), atol=1e-4)


def test_rms_norm_matches_torch():
    # 2,000 rows: split over the cores, each part summing its own weight gradient
    x = RNG.normal(size=(40, 50, 48)).astype(np.float32) * 3 + 1
    weights = RNG.normal(size=x.shape).astype(np.float32)
    layer = RMSNorm(48, parallel_config=ParallelConfig(), eps=1e-6)
    assert isinstance(layer.normalize, NormKernel)
    weight = RNG.normal(size=48).astype(np.float32)
    layer.weight.set_data(Tensor(weight))
    y, dx, (dweight,) = value_and_grads(layer, weights, Tensor(x))

    tx, tweight = (torch.tensor(a, requires_grad=True) for a in (x, weight))
    ty = torch.nn.functional.rms_norm(tx, (48,), tweight, 1e-6)
    (ty * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=2e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(dweight, tweight.grad.numpy(), atol=1e-4)


def test_swiglu_matches_the_operators():
    """The gated feed-forward with the SwiGLU kernel against the same cell built from
    MindSpore's operators: output, input gradient and both projections' gradients."""
    x = RNG.normal(size=(3, 5, 16)).astype(np.float32) * 2
    weights = RNG.normal(size=x.shape).astype(np.float32)
    built = []
    for target in ("CPU", "Ascend"):
        with kernels_for(target):
            layer = GatedFeedForward(16, 24, parallel_config=ParallelConfig())
        layer.gate_up.weight.set_data(Tensor(RNG.normal(size=(48, 16)).astype(np.float32)))
        layer.down.weight.set_data(Tensor(RNG.normal(size=(16, 24)).astype(np.float32)))
        built.append(layer)
    built[1].gate_up.weight.set_data(built[0].gate_up.weight.data)
    built[1].down.weight.set_data(built[0].down.weight.data)
    assert built[0].kernel is not None and built[1].kernel is None
    fused, plain = (value_and_grads(layer, weights, Tensor(x)) for layer in built)
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[1], plain[1], rtol=1e-5, atol=1e-4)
    for ours, theirs in zip(fused[2], plain[2]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)


def test_rotary_matches_the_operators_and_hugging_face():
    """The rotary kernel against the same cell built from MindSpore's operators (forward and
    gradient) and against Hugging Face's apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from model_zoo.nn.rotary import RotaryEmbedding, rotary_tables
    x = RNG.normal(size=(3, 4, 7, 16)).astype(np.float32)
    weights = RNG.normal(size=x.shape).astype(np.float32)
    cos, sin = rotary_tables(16, 7, 500000.0)
    with kernels_for("CPU"):
        fused = RotaryEmbedding(16, parallel_config=ParallelConfig())
    with kernels_for("Ascend"):
        plain = RotaryEmbedding(16, parallel_config=ParallelConfig())
    assert fused.kernel is not None and plain.kernel is None
    found = [value_and_grads(cell, weights, Tensor(x), Tensor(cos), Tensor(sin))
             for cell in (fused, plain)]
    np.testing.assert_allclose(found[0][0], found[1][0], atol=1e-6)
    np.testing.assert_allclose(found[0][1], found[1][1], atol=1e-6)
    theirs, _ = apply_rotary_pos_emb(torch.tensor(x), torch.tensor(x), torch.tensor(cos)[None],
                                     torch.tensor(sin)[None])
    np.testing.assert_allclose(found[0][0], theirs.numpy(), atol=1e-6)


@pytest.mark.parametrize("activation, approximate", [("gelu", "tanh"), ("gelu_exact", "none")])
def test_gelu_matches_torch(activation, approximate):
    # an identity linear layer, so the activation sees x itself, over a wide range
    layer = Linear(64, 64, activation=activation, has_bias=False, parallel_config=ParallelConfig())
    assert isinstance(layer.activation, cpu_kernels.GELU)
    layer.weight.set_data(Tensor(np.eye(64, dtype=np.float32)))
    # 77k elements: split over the cores
    x = np.concatenate([np.linspace(-12, 12, 64 * 6), RNG.normal(size=64 * 1200)])
    x = x.astype(np.float32).reshape(-1, 64)
    weights = RNG.normal(size=x.shape).astype(np.float32)
    y, dx, _ = value_and_grads(layer, weights, Tensor(x))

    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=2e-6 * np.abs(weights).max(), rtol=1e-5)


def test_linear_bias_matches_torch():
    layer = Linear(24, 40, parallel_config=ParallelConfig())
    layer.set_train()   # in eval mode these 14 rows would take the few-rows kernel
    assert DenseProduct in parts(layer) or not isinstance(operators_of(layer).bias_add, ms.ops.Add)
    weight = RNG.normal(size=(40, 24)).astype(np.float32)
    bias = RNG.normal(size=40).astype(np.float32)
    layer.weight.set_data(Tensor(weight))
    layer.bias.set_data(Tensor(bias))
    x = RNG.normal(size=(2, 7, 24)).astype(np.float32)
    weights = RNG.normal(size=(2, 7, 40)).astype(np.float32)
    y, dx, (dweight, dbias) = value_and_grads(layer, weights, Tensor(x))

    tx, tweight, tbias = (torch.tensor(a, requires_grad=True) for a in (x, weight, bias))
    ty = torch.nn.functional.linear(tx, tweight, tbias)
    (ty * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(dweight, tweight.grad.numpy(), atol=1e-4)
    np.testing.assert_allclose(dbias, tbias.grad.numpy(), atol=1e-5)


def test_bias_addition_matches_numpy():
    # the layers' bias kernel where the dense kernels are not built; 3,000 rows: split over
    # the cores in both directions
    x = RNG.normal(size=(3000, 40)).astype(np.float32)
    bias = RNG.normal(size=40).astype(np.float32)
    weights = RNG.normal(size=x.shape).astype(np.float32)
    y, dx, _ = value_and_grads(Product(cpu_kernels.bias_add()), weights, Tensor(x), Tensor(bias))
    np.testing.assert_allclose(y, x + bias, atol=1e-6)
    np.testing.assert_allclose(dx, weights, atol=1e-6)
    loss = Weighted(Product(cpu_kernels.bias_add()), weights)
    dbias = ms.jit(ms.grad(loss, grad_position=1))(Tensor(x), Tensor(bias)).asnumpy()
    np.testing.assert_allclose(dbias, weights.sum(axis=0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("seq", [20, 32])   # a part of the position table, then all of it
def test_residual_and_position_additions_match_numpy(seq):
    # the residual stream's additions on CPU: 4 x seq x 1,000 elements, split over the cores
    x = RNG.normal(size=(4, seq, 1000)).astype(np.float32)
    y = RNG.normal(size=x.shape).astype(np.float32)
    weights = RNG.normal(size=x.shape).astype(np.float32)
    residual = ResidualAdd(parallel_config=ParallelConfig())
    assert isinstance(residual.add, AddKernel)
    grad = ms.jit(ms.grad(Weighted(residual, weights), grad_position=(0, 1)))
    dx, dy = grad(Tensor(x), Tensor(y))
    np.testing.assert_allclose(ms.jit(residual)(Tensor(x), Tensor(y)).asnumpy(), x + y,
                               atol=1e-6)
    np.testing.assert_allclose(dx.asnumpy(), weights)
    np.testing.assert_allclose(dy.asnumpy(), weights)

    # positions: the table's first seq rows to every sequence, its gradient summed over them
    positions = PositionEmbedding(32, 1000, parallel_config=ParallelConfig())
    assert positions.cpu_add is not None
    table = positions.embedding_table.asnumpy()
    out, dx, (dtable,) = value_and_grads(positions, weights, Tensor(x))
    np.testing.assert_allclose(out, x + table[:seq], atol=1e-6)
    np.testing.assert_allclose(dx, weights)
    np.testing.assert_allclose(dtable[:seq], weights.sum(axis=0), rtol=1e-5, atol=1e-5)
    assert not dtable[seq:].any()


class TwoLinears(nn.Cell):
    """A layer with a bias feeding one without: both dense kernels in one graph."""

    def __init__(self, sizes):
        super().__init__()
        self.first = Linear(sizes[0], sizes[1], parallel_config=ParallelConfig())
        self.second = Linear(sizes[1], sizes[2], has_bias=False, parallel_config=ParallelConfig())

    def construct(self, x):
        return self.second(self.first(x))


@pytest.mark.skipif(not cpu_kernels.has_dense(), reason="this MindSpore ships no oneDNN")
@pytest.mark.parametrize("sizes, rows", [
    # 300 x 200 rows: oneDNN splits the work over the cores; 37 and 70: odd sizes
    ((37, 70, 45), (300, 200)),
    # a first layer 4,500 wide on 13 inputs: its weight gradient is computed transposed, in
    # blocks of 2,048 rows and a last one of 404
    ((13, 4500, 7), (20, 25))])
def test_dense_kernels_match_torch(sizes, rows):
    net = TwoLinears(sizes)
    net.set_train()
    assert DenseProduct in parts(net.first) and DenseProduct in parts(net.second)
    params = [RNG.normal(size=shape).astype(np.float32) for shape in
              ((sizes[1], sizes[0]), (sizes[1],), (sizes[2], sizes[1]))]
    for parameter, value in zip(net.trainable_params(), params):
        parameter.set_data(Tensor(value))
    x = RNG.normal(size=(*rows, sizes[0])).astype(np.float32)
    weights = RNG.normal(size=(*rows, sizes[2])).astype(np.float32)
    y, dx, dparams = value_and_grads(net, weights, Tensor(x))

    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tparams = [torch.tensor(value, dtype=torch.float64, requires_grad=True) for value in params]
    ty = torch.nn.functional.linear(torch.nn.functional.linear(tx, tparams[0], tparams[1]),
                                    tparams[2])
    (ty * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=1e-3, rtol=1e-4)
    for got, expected in zip(dparams, tparams):
        # sums over 60,000 rows: float32's error grows with the root of their count
        np.testing.assert_allclose(got, expected.grad.numpy(), atol=0.05, rtol=1e-4)


class WeightedAttention(nn.Cell):
    """sum(attention(x, memory, padding bias) * weights)."""

    def __init__(self, attention, weights):
        super().__init__()
        self.attention, self.weights = attention, Tensor(weights)

    def construct(self, x, memory, bias):
        return (self.attention(x, memory, bias) * self.weights).sum()


def train_with_random_weights(attention, fused: bool, rng):
    """`attention` in training mode with random weights (scale 0.3) from `rng`, on its fused
    CPU kernel, or on MindSpore's operators unless `fused`."""
    assert isinstance(attention.core, FusedCpuAttention)
    if not fused:   # the same core on MindSpore's operators (its dropout, its tables)
        attention.core.__class__ = DotProductAttention
    attention.set_train(True)
    for parameter in attention.trainable_params():
        parameter.set_data(Tensor(rng.normal(size=parameter.shape).astype(np.float32) * 0.3))


def attention_loss_and_grads(kind, rate, fused, seed=5, seq=20):
    """Loss, input gradients and parameter gradients of a MultiHeadAttention of `kind`
    (causal, padded or cross) over `seq` positions on fixed data, fused or on MindSpore's
    operators."""
    batch, memory_seq, hidden, heads = 3, 13, 32, 2
    ms.set_seed(seed)
    attention = MultiHeadAttention(hidden, heads, parallel_config=ParallelConfig(),
                                   causal=kind == "causal", cross=kind == "cross",
                                   max_seq_length=160, attention_dropout=rate)
    rng = np.random.default_rng(1)
    train_with_random_weights(attention, fused, rng)
    x = Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    keys = memory_seq if kind == "cross" else seq
    memory = Tensor(rng.normal(size=(batch, keys, hidden)).astype(np.float32))
    bias = np.zeros((batch, 1, 1, keys), np.float32)
    bias[1, ..., -5:] = -1e9   # the second sequence has 5 padding positions
    loss = WeightedAttention(attention, rng.normal(size=x.shape).astype(np.float32))
    inputs = (x, memory if kind == "cross" else None, Tensor(bias))
    grad = ms.jit(ms.value_and_grad(loss, grad_position=(0, 1) if kind == "cross" else 0,
                                    weights=attention.trainable_params()))
    value, (dinputs, dparams) = grad(*inputs)
    dinputs = dinputs if kind == "cross" else (dinputs,)
    return [value.asnumpy()] + [g.asnumpy() for g in dinputs + tuple(dparams)]


@pytest.mark.skipif(not cpu_kernels.has_dense(), reason="this MindSpore ships no oneDNN")
@pytest.mark.parametrize("kind, seq", [
    ("causal", 20),
    # 140 positions: causal attention runs in blocks of 32 rows and keys, and a last of 12
    ("causal", 140), ("padded", 20), ("cross", 20)])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_fused_attention_matches_the_layers_it_replaces(kind, seq, rate):
    """Forward and backward of the one-kernel attention against the same layer on
    MindSpore's BatchMatMul, Softmax and keyed dropout (whose masks it draws too): causal,
    with a padded sequence, and across sequences; 6 batch x heads pairs split over the
    cores."""
    fused = attention_loss_and_grads(kind, rate, fused=True, seq=seq)
    for got, expected in zip(fused, attention_loss_and_grads(kind, rate, fused=False,
                                                             seq=seq)):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    if rate:   # the dropout did act: the loss differs from that without it
        without = attention_loss_and_grads(kind, 0.0, fused=True, seq=seq)
        assert abs(fused[0] - without[0]) > 1e-3


class WeightedGrouped(nn.Cell):
    def __init__(self, attention, weights, seq):
        super().__init__()
        from model_zoo.nn.rotary import rotary_tables
        self.attention, self.weights = attention, Tensor(weights)
        self.cos, self.sin = (Tensor(table) for table in rotary_tables(
            attention.head_dim, seq, 10000.0))

    def construct(self, x):
        return (self.attention(x, (self.cos, self.sin)) * self.weights).sum()


def grouped_attention_loss_and_grads(kv_heads, seq, rate, fused):
    """Loss, input gradient and parameter gradients of a GroupedQueryAttention (4 query
    heads over `kv_heads`, rotary positions) on fixed data, fused or on MindSpore's
    operators (Tile, BatchMatMul, Softmax, keyed dropout)."""
    from model_zoo.nn.grouped_attention import GroupedQueryAttention
    batch, hidden = 3, 64
    ms.set_seed(5)   # the same dropout seeds for both
    attention = GroupedQueryAttention(hidden, 4, kv_heads, parallel_config=ParallelConfig(),
                                      max_seq_length=160, attention_dropout=rate)
    rng = np.random.default_rng(2)
    train_with_random_weights(attention, fused, rng)
    x = Tensor(rng.normal(size=(batch, seq, hidden)).astype(np.float32))
    loss = WeightedGrouped(attention, rng.normal(size=x.shape).astype(np.float32), seq)
    grad = ms.jit(ms.value_and_grad(loss, grad_position=0,
                                    weights=attention.trainable_params()))
    value, (dx, dparams) = grad(x)
    return [value.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]


@pytest.mark.skipif(not cpu_kernels.has_dense(), reason="this MindSpore ships no oneDNN")
@pytest.mark.parametrize("kv_heads, seq, rate", [
    (2, 20, 0.0), (2, 140, 0.3),   # 140: blocks of 32 rows and keys, and a last of 12
    (1, 20, 0.3), (4, 20, 0.0)])   # multi-query; as many key/value heads as query heads
def test_fused_grouped_attention_matches_the_layers_it_replaces(kv_heads, seq, rate):
    """Grouped-query attention in one kernel per direction (rotary positions by the kernel on
    the projections' layouts, each key/value head read by its group's query heads, whose
    gradients it sums) against the same layer on MindSpore's operators, forward and
    backward, with and without the probabilities' dropout."""
    fused = grouped_attention_loss_and_grads(kv_heads, seq, rate, fused=True)
    plain = grouped_attention_loss_and_grads(kv_heads, seq, rate, fused=False)
    assert len(fused) == 2 + 3   # loss, dx, and the query, key-value and output weights
    for got, expected in zip(fused, plain):   # float32 rounding, relative to each's scale
        np.testing.assert_allclose(got, expected, rtol=1e-4,
                                   atol=1e-5 * max(1.0, np.abs(expected).max()))


class Product(nn.Cell):
    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def construct(self, *inputs):
        return self.kernel(*inputs)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_few_rows_matmul_matches_torch(rows, has_bias):
    # 1030 outputs: split over the cores, and not a multiple of 4; 70 inputs: not of 16
    weight = RNG.normal(size=(1030, 70)).astype(np.float32)
    bias = RNG.normal(size=1030).astype(np.float32)
    x = RNG.normal(size=(rows, 70)).astype(np.float32)
    expected = torch.nn.functional.linear(torch.tensor(x), torch.tensor(weight),
                                          torch.tensor(bias) if has_bias else None).numpy()
    inputs = [Tensor(x), Tensor(weight)] + ([Tensor(bias)] if has_bias else [])
    kernel = Product(cpu_kernels.skinny_matmul(has_bias))
    np.testing.assert_allclose(kernel(*inputs).asnumpy(), expected, atol=1e-4, rtol=1e-5)

    # the layer takes it in eval mode, gradients included
    layer = Linear(70, 1030, has_bias=has_bias, parallel_config=ParallelConfig())
    assert isinstance(layer.product, FewRowsProduct)
    layer.weight.set_data(Tensor(weight))
    if has_bias:
        layer.bias.set_data(Tensor(bias))
    weights = RNG.normal(size=(rows, 1030)).astype(np.float32)
    y, dx, dparams = value_and_grads(layer, weights, Tensor(x))
    tx, tweight = torch.tensor(x, requires_grad=True), torch.tensor(weight, requires_grad=True)
    tbias = torch.tensor(bias, requires_grad=True) if has_bias else None
    ty = torch.nn.functional.linear(tx, tweight, tbias)
    (ty * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), atol=1e-3, rtol=1e-5)
    np.testing.assert_allclose(dparams[0], tweight.grad.numpy(), atol=1e-4, rtol=1e-5)
    if has_bias:
        np.testing.assert_allclose(dparams[1], tbias.grad.numpy(), atol=1e-4, rtol=1e-5)


def test_reorder_cache_matches_gather_and_write():
    from model_zoo.nn.cache import cache_index
    rows, heads, length, depth, position = 6, 3, 10, 8, 4
    cache = RNG.normal(size=(rows, heads, length, depth)).astype(np.float32)
    new = RNG.normal(size=(rows, heads, 1, depth)).astype(np.float32)
    parents = np.array([2, 2, 0, 5, 1, 3], np.int32)
    got = Product(cpu_kernels.reorder_cache())(
        Tensor(cache), Tensor(parents), cache_index(position, 1, rows, heads),
        Tensor(new)).asnumpy()
    expected = cache[parents].copy()
    expected[:, :, position] = new[:, :, 0]
    expected[:, :, position + 1:] = 0.0
    np.testing.assert_array_equal(got, expected)


def test_log_softmax_top_k_matches_torch():
    logits = (RNG.normal(size=(6, 1000)) * 3).astype(np.float32)
    logits[1, [40, 7]] = logits[1].max() + 2.0          # a tie: the lower id comes first
    values, ids = Product(cpu_kernels.log_softmax_top_k(8))(Tensor(logits))
    expected_values, expected_ids = torch.topk(
        torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1), 8)
    np.testing.assert_allclose(values.asnumpy(), expected_values.numpy(), atol=1e-5)
    assert ids.dtype == ms.int32
    assert ids.asnumpy()[1, :2].tolist() == [7, 40]
    untied = [row for row in range(6) if row != 1]
    np.testing.assert_array_equal(ids.asnumpy()[untied], expected_ids.numpy()[untied])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch(smoothing):
    tokens, classes = 2000, 37   # split over the cores
    logits = (RNG.normal(size=(tokens, classes)) * 4).astype(np.float32)
    logits[0, 3] = 80.0  # a confident row: the log-sum-exp must not overflow
    labels = RNG.integers(0, classes, tokens).astype(np.int32)
    mask = (RNG.random(tokens) > 0.3).astype(np.float32)
    layer = CrossEntropy(parallel_config=ParallelConfig(), label_smoothing=smoothing,
                         num_classes=classes)
    assert layer.kernel is not None
    grad = ms.jit(ms.value_and_grad(layer, grad_position=0))
    loss, dlogits = grad(Tensor(logits), Tensor(labels), Tensor(mask))

    tlogits = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    per_token = torch.nn.functional.cross_entropy(tlogits, torch.tensor(labels).long(),
                                                  reduction="none", label_smoothing=smoothing)
    tmask = torch.tensor(mask, dtype=torch.float64)
    expected = (per_token * tmask).sum() / tmask.sum()
    expected.backward()
    assert float(loss.asnumpy()) == pytest.approx(expected.item(), abs=1e-5)
    np.testing.assert_allclose(dlogits.asnumpy(), tlogits.grad.numpy(), atol=1e-6)


@pytest.mark.parametrize("tokens", [2, 20000])   # the bad label on a helper's rows too
def test_cross_entropy_refuses_a_label_outside_the_vocabulary(tokens):
    layer = CrossEntropy(parallel_config=ParallelConfig())
    labels = np.ones(tokens, np.int32)
    labels[-1] = 5
    with pytest.raises(RuntimeError):
        ms.jit(layer)(Tensor(np.zeros((tokens, 5), np.float32)), Tensor(labels),
                      Tensor(np.ones(tokens, np.float32))).asnumpy()


def test_layers_use_mindspore_operators_without_a_compiler(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MODEL_ZOO_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.library.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert "fused CPU kernels unavailable" in capsys.readouterr().err
        norm = LayerNorm(8, parallel_config=ParallelConfig())
        assert not isinstance(norm.normalize, NormKernel)
        x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
        expected = torch.nn.functional.layer_norm(torch.tensor(x), (8,), eps=1e-5).numpy()
        np.testing.assert_allclose(ms.jit(norm)(Tensor(x)).asnumpy(), expected, atol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.available()


@pytest.mark.skipif(not cpu_kernels.has_dense(), reason="this MindSpore ships no oneDNN")
def test_without_onednn_the_other_kernels_are_built_and_used(monkeypatch, capsys):
    # a oneDNN that does not link (another MindSpore's): the kernels are built without it,
    # and the dense layers and attention take MindSpore's operators
    monkeypatch.setattr(cpu_kernels, "LINK_FLAGS",
                        cpu_kernels.LINK_FLAGS[:1] + ["-l:libno-such-onednn.so.3"])
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.available() and not cpu_kernels.has_dense()
        assert "cannot link MindSpore's oneDNN" in capsys.readouterr().err
        layer = Linear(8, 6, parallel_config=ParallelConfig())
        attention = MultiHeadAttention(8, 2, parallel_config=ParallelConfig())
        assert DenseProduct not in parts(layer)
        assert not isinstance(attention.core, FusedCpuAttention)
        assert not isinstance(operators_of(layer).bias_add, ms.ops.Add)   # the bias kernel
        x = RNG.normal(size=(5, 8)).astype(np.float32)
        expected = torch.nn.functional.linear(torch.tensor(x), torch.tensor(
            layer.weight.asnumpy())).numpy()
        np.testing.assert_allclose(ms.jit(layer)(Tensor(x)).asnumpy(), expected, atol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.has_dense()


@pytest.mark.skipif(not cpu_kernels.has_dense(), reason="this MindSpore ships no oneDNN")
@pytest.mark.parametrize("version, why", [((2, 7, 3, 8), "oneDNN is 2.7.3"),
                                          ((3, 10, 1, 2), "threading runtime 2")])
def test_a_onednn_of_another_interface_is_not_linked(monkeypatch, capsys, version, why):
    """The kernels declare oneDNN 3.x's thread-pool interface: MindSpore's library is read
    (dnnl_version) before it is linked, and another major version or threading runtime
    (here OpenMP, 2) leaves the dense layers and attention to MindSpore, with one notice."""
    assert cpu_kernels.onednn_version(
        Path(ms.__file__).parent / "lib" / "libdnnl.so.3")[::3] == (3, 8)   # this one's
    monkeypatch.setattr(cpu_kernels, "onednn_version", lambda path: version)
    flags, unusable = cpu_kernels._onednn_link_flags()
    assert flags == [] and why in unusable
    monkeypatch.setattr(cpu_kernels, "LINK_FLAGS", flags)
    monkeypatch.setattr(cpu_kernels, "ONEDNN_UNUSABLE", unusable)
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.available() and not cpu_kernels.has_dense()
        notice = capsys.readouterr().err
        assert notice.count("\n") == 1 and why in notice and "MindSpore's operators" in notice
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.has_dense()


def test_an_unwritable_cache_falls_back_too(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MODEL_ZOO_KERNEL_CACHE", str(blocker / "cache"))
    cpu_kernels.library.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert "cannot build in" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.available()


def test_ascend_builds_keep_the_sharded_operators():
    with kernels_for("Ascend"):
        norm = LayerNorm(8, parallel_config=ParallelConfig())
        linear = Linear(8, 8, activation="gelu", parallel_config=ParallelConfig())
        loss = CrossEntropy(parallel_config=ParallelConfig())
    assert not isinstance(norm.normalize, NormKernel) and loss.kernel is None
    assert type(linear.activation).__name__ == "GeLU"


def test_squared_norm_sums_every_element_of_every_tensor():
    tensors = [RNG.normal(size=shape).astype(np.float32) * scale
               for shape, scale in (((300, 70), 1.0), ((9,), 100.0), ((4, 5, 6), 1e-3))]
    squared_norm = ms.jit(cpu_kernels.squared_norm())
    total = squared_norm(*[Tensor(t) for t in tensors]).asnumpy()
    expected = sum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors)
    assert total.shape == (1,)
    assert total[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")
def test_each_local_rank_gets_its_share_of_the_cores(monkeypatch):
    """The launcher gives each of its CPU ranks cores / ranks threads (MODEL_ZOO_CPU_THREADS,
    unless set), and the kernels run on that many threads (the calling one and helpers)."""
    import os
    import subprocess
    import sys
    from model_zoo.launch.local import CPU_THREADS, cluster_env
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(CPU_THREADS, raising=False)
    assert cluster_env("worker", 1, 2, 10, 0)[CPU_THREADS] == str(max(1, cores // 2))
    assert cluster_env("worker", 1, 4 * cores, 10, 0)[CPU_THREADS] == "1"
    monkeypatch.setenv(CPU_THREADS, "3")
    assert cluster_env("worker", 1, 2, 10, 0)[CPU_THREADS] == "3"   # the user's
    monkeypatch.delenv(CPU_THREADS)
    script = ("import ctypes\nfrom model_zoo.nn import cpu_kernels\n"
              "print(ctypes.CDLL(cpu_kernels.library()).KernelThreads())")

    def threads(**extra):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env=dict(os.environ, **extra), timeout=300)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    assert threads() == min(8, cores)
    assert threads(MODEL_ZOO_CPU_THREADS="1") == 1
    assert threads(MODEL_ZOO_CPU_THREADS="64") == min(8, cores)
