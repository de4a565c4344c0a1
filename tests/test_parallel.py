"""Parallel layout: divisibility errors, data sharding, launch checks, operator strategies,
pipeline stages and recomputation.

Operator strategies are read from the built cells (built without allocating weights, so the
benchmark-size GPT-2 costs nothing) and checked against MindSpore's rules as summarised in
`docs/mindspore-parallel-rules.md`; a tiny model's forward pass checks them against real shapes.
"""

import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor
from mindspore.nn.utils import no_init_parameters

from conftest import device_matrix_size
from model_zoo.config import load_config
from model_zoo.errors import ConfigError
from model_zoo.models.gpt2.model import GPT2Block, GPT2Config, GPT2ForTraining
from model_zoo.parallel.config import ParallelConfig
from model_zoo.parallel.context import (check_fits_launch, data_shard, detect_device_target,
                                        launched_ranks)
from model_zoo.nn.attention import MultiHeadAttention
from model_zoo.nn.backend import kernels_for
from model_zoo.nn.layers import LayerNorm
from model_zoo.nn.loss import CrossEntropy
from model_zoo.layout.trace import primitives, record

CONFIG_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "model_zoo", "models", "gpt2",
                          "configs")
BENCHMARK = os.path.join(CONFIG_DIR, "gpt2-1024.yaml")


def small_config(**overrides) -> GPT2Config:
    values = dict(num_layers=2, hidden_size=64, num_heads=8, seq_length=16, vocab_size=256)
    values.update(overrides)
    return GPT2Config(**values)


def build(config: GPT2Config, parallel: ParallelConfig, compute_dtype=ms.float32):
    with no_init_parameters(), kernels_for("Ascend"):  # the sharded operators
        return GPT2ForTraining(config, parallel, compute_dtype)


def build_error(config: GPT2Config, parallel: ParallelConfig) -> str:
    with pytest.raises(ConfigError) as info:
        build(config, parallel)
    return str(info.value)


def strategy(prim):
    """The strategy `.shard()` recorded: MindSpore 2.10 keeps it in the primitive's attrs."""
    value = prim.attrs.get("in_strategy")
    assert value == getattr(prim, "in_strategy", value)
    return value


def contracted_splits(prim, strat):
    """Split of the contracted (K) dimension on each input of a MatMul / BatchMatMul."""
    x, w = strat
    k_x = x[-2] if prim.attrs.get("transpose_a") else x[-1]
    k_w = w[-1] if prim.attrs.get("transpose_b") else w[-2]
    return k_x, k_w


# --- divisibility errors at construction ---------------------------------------------------

def test_heads_not_divisible_by_model_parallel():
    message = build_error(small_config(num_heads=6, hidden_size=96),
                          ParallelConfig(model_parallel=4))
    assert "model.num_heads=6" in message and "parallel.model_parallel=4" in message


def test_hidden_not_divisible_by_model_parallel():
    # heads divisible by mp but not the hidden size (only possible when heads don't divide it).
    message = build_error(small_config(num_heads=4, hidden_size=10),
                          ParallelConfig(model_parallel=4))
    assert "model.hidden_size=10" in message and "parallel.model_parallel=4" in message


def test_ffn_not_divisible_by_model_parallel():
    message = build_error(small_config(ffn_hidden_size=100), ParallelConfig(model_parallel=8))
    assert "model.ffn_hidden_size=100" in message and "parallel.model_parallel=8" in message


def test_vocab_divisible_only_when_split():
    message = build_error(small_config(vocab_size=1001),
                          ParallelConfig(model_parallel=2, vocab_emb_dp=False))
    assert "model.vocab_size=1001" in message and "parallel.model_parallel=2" in message
    # Kept whole on every device: any vocabulary size is fine.
    net = build(small_config(vocab_size=1001), ParallelConfig(model_parallel=2, vocab_emb_dp=True))
    assert net.lm.transformer.wte.embedding_table.shape == (1001, 64)


def test_layers_not_divisible_by_pipeline_stage():
    message = build_error(small_config(num_layers=3),
                          ParallelConfig(pipeline_stage=2, micro_batch_num=2))
    assert "model.num_layers: the model's 3 blocks" in message
    assert "parallel.pipeline_stage=2" in message
    message = build_error(small_config(num_layers=1),
                          ParallelConfig(pipeline_stage=2, micro_batch_num=2))
    assert "model.num_layers: the model's 1 blocks" in message


def test_valid_hybrid_layout_builds():
    net = build(small_config(num_layers=4, vocab_size=256),
                ParallelConfig(data_parallel=2, model_parallel=8, pipeline_stage=2,
                               micro_batch_num=4, vocab_emb_dp=False))
    assert len(net.lm.transformer.blocks) == 4


def test_global_batch_by_devices_per_stage_and_micro_batches():
    parallel = ParallelConfig(data_parallel=2, model_parallel=2, pipeline_stage=2,
                              micro_batch_num=2)
    assert parallel.batch_slices() == 2 * 2 * 2  # devices per stage (dp x mp) x micro batches
    parallel.check_batch(16)
    with pytest.raises(ConfigError) as info:
        parallel.check_batch(12)
    message = str(info.value)
    assert "train.global_batch_size=12" in message and "8" in message
    assert "micro_batch_num x data_parallel x model_parallel" in message
    with pytest.raises(ConfigError) as info:
        parallel.check_batch(16, accumulation=4)
    assert "32" in str(info.value) and "train.grad_accumulation" in str(info.value)
    parallel.check_batch(32, accumulation=4)


def test_global_batch_under_full_batch():
    parallel = ParallelConfig(data_parallel=2, model_parallel=4, micro_batch_num=2,
                              full_batch=True)
    assert parallel.batch_slices() == 2 * 2  # micro batches x dp: mp does not cut the batch
    parallel.check_batch(4)
    with pytest.raises(ConfigError) as info:
        parallel.check_batch(6)
    message = str(info.value)
    assert "train.global_batch_size=6" in message and "by 4" in message
    assert "micro_batch_num x data_parallel" in message and "model_parallel" not in message
    # The same 4 is rejected without full_batch, where each of the 8 ranks reads a slice.
    with pytest.raises(ConfigError):
        ParallelConfig(data_parallel=2, model_parallel=4, micro_batch_num=2).check_batch(4)


def test_micro_batches_fewer_than_stages():
    with pytest.raises(ConfigError) as info:
        ParallelConfig(pipeline_stage=4, micro_batch_num=2).validate()
    message = str(info.value)
    assert "parallel.micro_batch_num=2" in message and "parallel.pipeline_stage=4" in message
    ParallelConfig(pipeline_stage=4, micro_batch_num=4).validate()
    ParallelConfig(pipeline_stage=1, micro_batch_num=1).validate()


@pytest.mark.parametrize("key", ["data_parallel", "model_parallel", "pipeline_stage",
                                 "micro_batch_num"])
def test_sizes_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"parallel.{key}"):
        ParallelConfig(**{key: 0}).validate()


# --- which data shard each rank reads -------------------------------------------------------

LAYOUTS = [(1, 1, 1), (8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (2, 1, 4), (4, 2, 4)]
GLOBAL_BATCH = 64


def layout(dp, mp, pp, **kwargs) -> ParallelConfig:
    return ParallelConfig(data_parallel=dp, model_parallel=mp, pipeline_stage=pp,
                          micro_batch_num=max(pp, 1), **kwargs)


@pytest.mark.parametrize("dp, mp, pp", LAYOUTS)
def test_data_shard_per_rank(dp, mp, pp):
    parallel = layout(dp, mp, pp)
    per_stage = dp * mp
    for rank in range(parallel.device_num):
        shard = data_shard(parallel, rank, GLOBAL_BATCH)
        assert shard.num_shards == per_stage
        assert shard.shard_id == rank % per_stage
        assert shard.batch_size == GLOBAL_BATCH // per_stage
    # Every stage's ranks together read every shard exactly once: the whole global batch.
    for stage in range(pp):
        ranks = range(stage * per_stage, (stage + 1) * per_stage)
        ids = sorted(data_shard(parallel, rank, GLOBAL_BATCH).shard_id for rank in ranks)
        assert ids == list(range(per_stage))
        assert sum(data_shard(parallel, r, GLOBAL_BATCH).batch_size for r in ranks) == GLOBAL_BATCH


@pytest.mark.parametrize("dp, mp, pp", LAYOUTS)
def test_data_shard_full_batch(dp, mp, pp):
    parallel = layout(dp, mp, pp, full_batch=True)
    for rank in range(parallel.device_num):
        shard = data_shard(parallel, rank, GLOBAL_BATCH)
        assert (shard.num_shards, shard.shard_id, shard.batch_size) == (1, 0, GLOBAL_BATCH)


@pytest.mark.parametrize("dp, mp, pp", [(2, 4, 1), (1, 8, 1), (2, 2, 2), (4, 2, 4)])
def test_model_parallel_group_reads_different_shards(dp, mp, pp):
    """The "data_parallel" dataset strategy splits inputs over all S = dp x mp ranks of a
    stage (rules, Dataset section), so the mp ranks of one group must not share a slice.

    Ranks are laid out row-major over (stage, dp, mp), the model-parallel index fastest:
    the mp group of (stage s, replica d) is s*S + d*mp + [0, mp).
    """
    parallel = layout(dp, mp, pp)
    per_stage = dp * mp
    for stage in range(pp):
        for replica in range(dp):
            group = [stage * per_stage + replica * mp + j for j in range(mp)]
            ids = {data_shard(parallel, rank, GLOBAL_BATCH).shard_id for rank in group}
            assert len(ids) == mp
    # The same position in another stage reads the same slice (each stage sees the batch).
    for rank in range(per_stage, parallel.device_num):
        assert (data_shard(parallel, rank, GLOBAL_BATCH)
                == data_shard(parallel, rank % per_stage, GLOBAL_BATCH))


# --- launch checks --------------------------------------------------------------------------

@pytest.mark.parametrize("mp, pp", [(2, 1), (1, 2), (4, 2)])
def test_cpu_refuses_model_and_pipeline_parallel(mp, pp):
    parallel = layout(1, mp, pp)
    with pytest.raises(ConfigError) as info:
        check_fits_launch(parallel, "CPU", parallel.device_num)
    message = str(info.value)
    assert "no CPU backend" in message and "model-zoo plan" in message
    assert f"parallel.model_parallel={mp}" in message
    assert f"parallel.pipeline_stage={pp}" in message


def test_layout_device_count_mismatch():
    with pytest.raises(ConfigError) as info:
        check_fits_launch(layout(4, 1, 1), "CPU", 2)
    message = str(info.value)
    assert "needs 4 devices" in message and "but 2 were launched" in message
    with pytest.raises(ConfigError) as info:
        check_fits_launch(layout(2, 2, 2), "Ascend", 16)
    assert "8" in str(info.value) and "16" in str(info.value)


def test_layouts_that_fit():
    check_fits_launch(layout(1, 1, 1), "CPU", 1)
    check_fits_launch(layout(4, 1, 1), "CPU", 4)
    check_fits_launch(layout(2, 2, 2), "Ascend", 8)
    check_fits_launch(layout(1, 8, 1), "Ascend", 8)


def test_detect_device_target(monkeypatch):
    monkeypatch.delenv("DEVICE_TARGET", raising=False)
    assert detect_device_target("CPU") == "CPU"
    assert detect_device_target("Ascend") == "Ascend"
    assert detect_device_target("auto") == "CPU"  # only the CPU backend loads here
    assert detect_device_target() == "CPU"
    monkeypatch.setenv("DEVICE_TARGET", "Ascend")
    assert detect_device_target("auto") == "Ascend"
    assert detect_device_target("CPU") == "CPU"  # an explicit request beats the environment
    monkeypatch.setenv("DEVICE_TARGET", "CPU")
    assert detect_device_target("auto") == "CPU"
    monkeypatch.setenv("DEVICE_TARGET", "GPU")
    with pytest.raises(ConfigError, match="GPU"):
        detect_device_target("auto")
    monkeypatch.delenv("DEVICE_TARGET")
    with pytest.raises(ConfigError, match="GPU"):
        detect_device_target("GPU")


def test_launched_ranks(monkeypatch):
    monkeypatch.delenv("MS_WORKER_NUM", raising=False)
    monkeypatch.delenv("RANK_SIZE", raising=False)
    assert launched_ranks() == 1
    monkeypatch.setenv("RANK_SIZE", "8")
    assert launched_ranks() == 8
    monkeypatch.setenv("MS_WORKER_NUM", "4")
    assert launched_ranks() == 4  # msrun's variable first
    monkeypatch.setenv("MS_WORKER_NUM", "four")
    with pytest.raises(ConfigError, match="MS_WORKER_NUM"):
        launched_ranks()


# --- operator strategies of the benchmark GPT-2 --------------------------------------------

_BUILT = {}


def benchmark_net(dp: int, mp: int, vocab_emb_dp: bool):
    """The gpt2-1024.yaml model for one layout, built once without weights (as Ascend builds
    it, see `build`)."""
    key = (dp, mp, vocab_emb_dp)
    if key not in _BUILT:
        config = load_config(BENCHMARK, [f"parallel.data_parallel={dp}",
                                    f"parallel.model_parallel={mp}",
                                    f"parallel.vocab_emb_dp={str(vocab_emb_dp).lower()}"])
        assert (config.model.num_layers, config.model.hidden_size, config.model.num_heads,
                config.model.seq_length, config.model.vocab_size) == (24, 1024, 16, 1024, 50304)
        _BUILT[key] = (build(config.model, config.parallel, ms.float16), config.parallel)
    return _BUILT[key]


MODEL_PARALLEL = [1, 2, 4, 8]
CHECKED_OPS = {"MatMul", "BatchMatMul", "Softmax", "Gather", "LayerNorm", "Add"}


@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_every_primitive_has_a_valid_strategy(mp):
    net, parallel = benchmark_net(1, mp, False)
    found = primitives(net)
    names = {prim.name for _, _, _, prim in found}
    assert CHECKED_OPS <= names
    per_stage = parallel.devices_per_stage
    for cell_name, _, attr, prim in found:
        strat = strategy(prim)
        where = f"{cell_name}.{attr} ({prim.name})"
        assert strat is not None, f"{where} has no strategy"
        assert isinstance(strat, tuple) and all(isinstance(part, tuple) for part in strat), where
        for part in strat:
            for value in part:
                assert value >= 1 and value & (value - 1) == 0, f"{where}: {strat} (rule G3)"
        assert per_stage % device_matrix_size(prim, strat) == 0, f"{where}: {strat} (rule G4)"
        if prim.name in ("MatMul", "BatchMatMul"):
            k_x, k_w = contracted_splits(prim, strat)
            assert k_x == k_w, f"{where}: contracted dimension split {k_x} vs {k_w}"
            assert strat[0][:-2] == strat[1][:-2], f"{where}: batch dimensions differ"
        if prim.name in ("Softmax", "LogSoftmax"):
            axes = prim.attrs["axis"]
            for axis in (axes,) if isinstance(axes, int) else axes:
                assert strat[0][axis] == 1, f"{where}: softmax axis split"
        if prim.name == "LayerNorm":
            assert prim.attrs["begin_norm_axis"] == -1
            assert strat[0][-1] == 1 and strat[1] == (1,) and strat[2] == (1,), where


def test_primitive_count_scales_with_layers():
    net, _ = benchmark_net(1, 2, False)
    found = primitives(net)
    per_block = [p for name, _, _, p in found if name.startswith("lm.transformer.blocks.0.")]
    all_blocks = [p for name, _, _, p in found if name.startswith("lm.transformer.blocks.")]
    assert len(all_blocks) == 24 * len(per_block)


@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_attention_strategies(mp):
    net, _ = benchmark_net(1, mp, False)
    heads = (1, mp, 1, 1)
    attentions = [cell for _, cell in net.cells_and_names() if isinstance(cell, MultiHeadAttention)]
    assert len(attentions) == 24
    for attention in attentions:
        assert strategy(attention.core.scores) == (heads, heads)
        assert attention.core.scores.attrs["transpose_b"] is True
        assert strategy(attention.core.context) == (heads, heads)
        assert strategy(attention.core.softmax) == (heads,)
        assert strategy(attention.core.scale) == (heads, ())
        assert strategy(attention.core.split_heads) == ((1, 1, mp, 1),)
        assert strategy(attention.core.merge_heads) == (heads,)


@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_linear_strategies(mp):
    net, _ = benchmark_net(1, mp, False)
    column, row = [], []
    for block in (cell for _, cell in net.cells_and_names() if isinstance(cell, GPT2Block)):
        attention, mlp = block.attention, block.mlp
        column += [attention.qkv, mlp.expand]
        row += [attention.output, mlp.project]
    assert len(column) == 2 * 24 and len(row) == 2 * 24
    for linear in column:
        assert strategy(linear.product.matmul) == ((1, 1), (mp, 1))  # weight (out, in): out split
        assert linear.product.matmul.attrs["transpose_b"] is True
        assert strategy(linear.product.bias_add) == ((1, mp), (mp,))
    for linear in row:
        assert strategy(linear.product.matmul) == ((1, mp), (1, mp))  # in split on both: all-reduce
        assert strategy(linear.product.bias_add) == ((1, 1), (1,))
    for block in (cell for _, cell in net.cells_and_names() if isinstance(cell, GPT2Block)):
        assert strategy(block.mlp.expand.activation) == ((1, mp),)
        assert block.mlp.expand.out_features == 4096


@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_vocab_split_embedding(mp):
    net, _ = benchmark_net(1, mp, False)
    gather = net.lm.transformer.wte.gather
    assert strategy(gather) == ((mp, 1), (1, 1))  # dp 1: the ids stay whole
    head = strategy(net.lm.head.product.matmul)
    assert head == ((1, 1), (mp, 1))
    # The tied table has one layout in both of its users (MindSpore rejects a parameter whose
    # users split it differently).
    assert strategy(gather)[0] == head[1]


@pytest.mark.parametrize("dp, mp", [(1, 4), (8, 1), (2, 4)])
def test_vocab_whole_embedding(dp, mp):
    net, _ = benchmark_net(dp, mp, True)
    assert strategy(net.lm.transformer.wte.gather) == ((1, 1), (dp, 1))
    assert strategy(net.lm.head.product.matmul) == ((dp, 1), (1, 1))


@pytest.mark.parametrize("mp", MODEL_PARALLEL)
def test_layer_norm_strategies(mp):
    net, _ = benchmark_net(1, mp, False)
    norms = [cell for _, cell in net.cells_and_names() if isinstance(cell, LayerNorm)]
    assert len(norms) == 2 * 24 + 1
    for norm in norms:
        assert strategy(norm.normalize.norm) == ((1, 1, 1), (1,), (1,))


# Primitives whose first input is a weight or a constant, not an activation.
# whole on purpose: constant slices, and the decoding cache's write and beam reordering
# (decoding runs on one device)
NOT_ACTIVATIONS = {("PositionEmbedding", "slice"), ("DotProductAttention", "slice_causal"),
                   ("MultiHeadAttention", "gather_rows")}


def test_data_parallel_splits_every_activation_by_batch():
    dp = 8
    net, _ = benchmark_net(dp, 1, True)
    checked = 0
    for cell_name, cell, attr, prim in primitives(net):
        strat = strategy(prim)
        where = f"{cell_name}.{attr} ({prim.name}): {strat}"
        # No weight and no feature dimension is split with mp = 1.
        assert all(value == 1 for part in strat for value in part[1:]), where
        if (type(cell).__name__, attr) in NOT_ACTIVATIONS:
            assert all(value == 1 for part in strat for value in part), where
            continue
        activation = strat[1] if prim.name == "Gather" else strat[0]  # Gather(table, ids)
        assert activation[0] == dp, where
        checked += 1
    assert checked > 24 * 20


def test_hybrid_layout_strategies():
    net, _ = benchmark_net(2, 4, False)
    attention = net.lm.transformer.blocks[0].attention
    assert strategy(attention.core.scores) == ((2, 4, 1, 1), (2, 4, 1, 1))
    assert strategy(attention.qkv.product.matmul) == ((2, 1), (4, 1))
    assert strategy(attention.output.product.matmul) == ((2, 4), (1, 4))
    assert strategy(net.lm.transformer.wte.gather) == ((4, 1), (2, 1))
    # vocabulary-parallel loss: the class axis of the logits stays split by mp
    assert strategy(net.lm.head.product.matmul) == ((2, 1), (4, 1))
    for name in ("max", "exp", "sum_exp", "sum_classes"):
        assert strategy(getattr(net.loss, name)) == ((2, 4),), name
    assert strategy(net.loss.one_hot) == ((2, 4), (), ())
    assert strategy(net.loss.log) == ((2, 1),)
    assert not hasattr(net.loss, "softmax_cross_entropy")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocabulary_parallel_cross_entropy_matches_torch(label_smoothing):
    """The split-class loss (MindSpore's operators, run here stand-alone) gives torch's
    masked mean cross-entropy and its gradient, as the whole-class loss does."""
    import torch
    rng = np.random.default_rng(0)
    tokens, classes = 24, 50
    logits = (3 * rng.standard_normal((tokens, classes))).astype(np.float32)
    labels = rng.integers(0, classes, tokens).astype(np.int32)
    mask = (rng.random(tokens) > 0.3).astype(np.float32)
    parallel = ParallelConfig(data_parallel=2, model_parallel=2, vocab_emb_dp=False)
    x = torch.tensor(logits, requires_grad=True)
    per_token = torch.nn.functional.cross_entropy(
        x, torch.tensor(labels, dtype=torch.long), reduction="none",
        label_smoothing=label_smoothing)
    expected = (per_token * torch.tensor(mask)).sum() / mask.sum()
    expected.backward()
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        for class_split in (1, 2):
            with kernels_for("Ascend"):
                loss = CrossEntropy(parallel_config=parallel, label_smoothing=label_smoothing,
                                    num_classes=classes, class_split=class_split)
            assert loss.vocabulary_parallel == (class_split > 1)
            value, grad = ms.value_and_grad(
                lambda z: loss(z, Tensor(labels), Tensor(mask)))(Tensor(logits))
            assert float(value.asnumpy()) == pytest.approx(expected.item(), abs=1e-6)
            np.testing.assert_allclose(grad.asnumpy(), x.grad.numpy(), atol=1e-6)
    finally:
        ms.set_context(mode=mode)


@pytest.fixture
def pynative():
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=mode)


@pytest.mark.parametrize("dp, mp", [(2, 2), (1, 4), (2, 4)])
def test_strategies_fit_real_shapes(pynative, dp, mp):
    """Run a tiny model stand-alone (strategies are ignored) and check every primitive call:
    one sub-strategy per tensor input with that input's rank (G1), each split dividing its
    dimension (G2). OneHot's first strategy describes its output (indices + depth)."""
    parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, vocab_emb_dp=False)
    config = small_config(num_layers=1, hidden_size=32, num_heads=4, vocab_size=64,
                          dropout=0.1, attention_dropout=0.1)
    with kernels_for("Ascend"):  # the sharded operators, not CPU's fused kernels
        net = GPT2ForTraining(config, parallel)
    owners = {f"{name}.{attr}" if name else attr for name, _, attr, _ in primitives(net)}
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (4, 17)), ms.int32)
    # layout.trace.record spies on every outermost primitive call while the kernels really run
    recording = record(net, [ids], compute=True)
    loss = float(recording.output.asnumpy())
    assert np.isfinite(loss)
    calls = [(call.path, call.prim, call.args) for call in recording.calls if call.path in owners]
    not_run = owners - {owner for owner, _, _ in calls}
    idle = (".add_bias", ".gather_rows", ".split_qkv")  # padding bias, decoding
    assert all(owner.endswith(idle) for owner in not_run), not_run
    for owner, prim, args in calls:
        strat = strategy(prim)
        shapes = [tuple(arg.shape) for arg in args if hasattr(arg, "shape")]
        if prim.name == "OneHot":
            shapes[0] = shapes[0] + (args[1],)
        where = f"{owner} ({prim.name}): strategy {strat}, shapes {shapes}"
        assert len(strat) == len(shapes), where
        for part, shape in zip(strat, shapes):
            assert len(part) == len(shape), where
            assert all(dim % split == 0 for dim, split in zip(shape, part)), where


# --- sequence parallel ------------------------------------------------------------------------

def test_sequence_parallel_strategies():
    """The residual stream's layer norms and hidden dropouts split the (tokens, hidden) view
    by dp x mp, the residual adds (batch, seq, hidden) into the same slices (whole
    sequences here: (dp mp, 1, 1)); the row-split projections reduce-scatter into it
    (output strategy (dp x mp, 1), rule G6); the column-split ones are unchanged."""
    dp, mp = 2, 4
    parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, vocab_emb_dp=False,
                              sequence_parallel=True)
    net = build(small_config(dropout=0.1), parallel)
    tokens = (dp * mp, 1)
    for block in (cell for _, cell in net.cells_and_names() if isinstance(cell, GPT2Block)):
        for norm in (block.ln_1, block.ln_2):
            assert strategy(norm.normalize.norm) == (tokens, (1,), (1,))
        for residual in (block.residual_1, block.residual_2):
            assert strategy(residual.add.add) == ((dp * mp, 1, 1),) * 2
        for dropout in (block.attention.hidden_dropout, block.mlp.dropout):
            assert strategy(dropout.dropout) == (tokens,)
        for row in (block.attention.output, block.mlp.project):
            assert strategy(row.product.matmul) == ((dp, mp), (1, mp))
            assert row.product.matmul.attrs["out_strategy"] == (tokens,)
            assert strategy(row.product.bias_add) == (tokens, (1,))
        for column in (block.attention.qkv, block.mlp.expand):
            assert strategy(column.product.matmul) == ((dp, 1), (mp, 1))
            assert column.product.matmul.attrs.get("out_strategy") is None
    assert strategy(net.lm.transformer.ln_f.normalize.norm) == (tokens, (1,), (1,))
    assert strategy(net.lm.transformer.dropout.dropout) == (tokens,)
    with pytest.raises(ConfigError, match="needs parallel.model_parallel > 1"):
        ParallelConfig(sequence_parallel=True).validate()


def test_training_config_refuses_a_micro_batch_sequence_parallel_cannot_cut():
    from model_zoo.config import config_from_dict
    raw = {"model": {"name": "gpt2", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                     "seq_length": 16, "vocab_size": 256},
           "parallel": {"data_parallel": 2, "model_parallel": 4, "full_batch": True,
                        "sequence_parallel": True},
           "train": {"global_batch_size": 6}, "data": {"dataset_dir": "unused"}}
    with pytest.raises(ConfigError, match="a micro batch of 6 sequences of 16 tokens"):
        config_from_dict(raw)
    raw["train"]["global_batch_size"] = 4       # 8 pieces: each half a sequence
    assert config_from_dict(raw).parallel.sequence_parallel


@pytest.mark.parametrize("name", ["gpt2", "bert", "transformer"])
def test_sequence_parallel_computes_the_same_loss_and_gradients(pynative, name):
    """Run stand-alone (strategies ignored), a model built with sequence parallel (its
    token-wise operators on the (tokens, hidden) view) gives the loss and gradients of the
    same model without it, to float32 rounding."""
    from model_zoo.config import config_from_dict, import_model
    from model_zoo.layout.network import network_inputs
    raw = {"model": {"name": name, "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                     "seq_length": 16, "vocab_size": 64, "dropout": 0.0,
                     "attention_dropout": 0.0},
           "parallel": {"data_parallel": 1, "model_parallel": 2, "vocab_emb_dp": False},
           "train": {"global_batch_size": 4, "precision": "fp32"},
           "data": {"dataset_dir": "unused"}}
    results = []
    for sequence_parallel in (False, True):
        raw["parallel"]["sequence_parallel"] = sequence_parallel
        config = config_from_dict(raw)
        module = import_model(name)
        ms.set_seed(0)
        with kernels_for("Ascend"):  # MindSpore's operators, as a cluster runs them
            net = module.build_train_network(config, ms.float32)
        if results:
            ms.load_param_into_net(net, {p.name: p for p in results[0][2]}, strict_load=True)
        rng = np.random.default_rng(0)
        inputs = [Tensor(rng.integers(0, 2, shape).astype(np.float32 if dtype == ms.float32
                                                          else np.int32))
                  for shape, dtype in network_inputs(module, config, net, 4)]
        loss, grads = ms.value_and_grad(net, None, net.trainable_params())(*inputs)
        results.append((float(loss.asnumpy()), [g.asnumpy() for g in grads],
                        net.trainable_params()))
    (loss_a, grads_a, params), (loss_b, grads_b, _) = results
    assert np.isfinite(loss_a) and loss_b == pytest.approx(loss_a, rel=1e-6)
    assert len(grads_a) == len(grads_b) == len(params)
    for param, a, b in zip(params, grads_a, grads_b):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=param.name)


def test_stream_dropout_on_the_token_view(pynative):
    """A 2-D strategy on a 3-D input runs dropout on its (tokens, hidden) view and gives back
    the input's shape (the plan's rank check, G1, sees that the view is what is split)."""
    from model_zoo.nn.layers import Dropout
    dropout = Dropout(0.5, (4, 1))
    dropout.set_train(True)
    x = np.arange(1, 25, dtype=np.float32).reshape(2, 3, 4)
    y = dropout(Tensor(x)).asnumpy()
    assert y.shape == x.shape
    kept = y != 0
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(y[kept], 2 * x[kept])


# --- pipeline stages and recomputation ------------------------------------------------------

def stage_of(cell):
    return getattr(cell, "pipeline_stage", None)  # unset: MindSpore raises AttributeError


@pytest.mark.parametrize("recompute", [False, True])
def test_pipeline_stage_assignment(recompute):
    parallel = ParallelConfig(pipeline_stage=2, micro_batch_num=2, recompute=recompute)
    net = build(small_config(num_layers=4), parallel)
    model = net.lm.transformer
    assert [stage_of(block) for block in model.blocks] == [0, 0, 1, 1]
    assert stage_of(model.wte) == stage_of(model.wpe) == stage_of(model.dropout) == 0
    assert stage_of(model.ln_f) == stage_of(net.lm.head) == stage_of(net.loss) == 1
    # Every parameter sits in a cell that has a stage or inherits one from an ancestor, and
    # the stages never decrease in execution order (embeddings, blocks, final norm).
    cells = dict(net.cells_and_names())
    stages = []
    for name, _ in net.parameters_and_names():
        path = name.split(".")[:-1]
        owners = [cells[".".join(path[:n])] for n in range(len(path), 0, -1)]
        stage = next((stage_of(c) for c in owners if stage_of(c) is not None), None)
        assert stage is not None, f"{name} has no pipeline stage"
        stages.append(stage)
    assert stages == sorted(stages) and stages[0] == 0 and stages[-1] == 1


def test_four_stages_of_eight_layers():
    parallel = ParallelConfig(pipeline_stage=4, micro_batch_num=4)
    net = build(small_config(num_layers=8), parallel)
    assert [stage_of(b) for b in net.lm.transformer.blocks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stage_of(net.loss) == 3


def is_recomputed(cell) -> bool:
    """How MindSpore 2.10 records `Cell.recompute()`: the cell is flagged as configured, its
    scope (and its children's) is prefixed `recompute_`, and it gets the `output_recompute`
    flag (only the cell recompute() was called on)."""
    return bool(cell._has_config_recompute and (cell._scope or "").startswith("recompute_"))


def test_recompute_marks_the_blocks():
    net = build(small_config(num_layers=4), ParallelConfig(recompute=True))
    model = net.lm.transformer
    for block in model.blocks:
        assert is_recomputed(block)
        assert "output_recompute" in block.get_flags()
        for _, child in block.cells_and_names():
            assert is_recomputed(child)
    for cell in (model.wte, model.wpe, model.ln_f, net.lm.head, net.loss, net):
        assert not is_recomputed(cell)


def test_no_recompute_by_default():
    net = build(small_config(num_layers=2), ParallelConfig())
    for _, cell in net.cells_and_names():
        assert not is_recomputed(cell)
        assert "output_recompute" not in cell.get_flags()


@pytest.mark.parametrize("layout, device_num, expected", [
    ((1, 1, 1), 8, 8),     # a one-device config on a server: data parallel 8
    ((8, 1, 1), 8, 8),     # already laid out
    ((2, 2, 1), 16, 8),    # one server's dp2 x mp2 on four servers' worth: mp kept
    ((1, 2, 2), 16, 4),
])
def test_a_layout_for_fewer_devices_gets_the_replicas_that_fill_the_job(layout, device_num,
                                                                          expected):
    dp, mp, pp = layout
    parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, pipeline_stage=pp,
                              micro_batch_num=max(pp, 1))
    assert parallel.data_parallel_for(device_num) == expected


@pytest.mark.parametrize("layout, device_num, message", [
    ((16, 1, 1), 8, "needs more devices than the job has"),
    ((1, 3, 1), 8, "DEVICE_NUM 8 is not a multiple of model_parallel x pipeline_stage = 3"),
])
def test_a_layout_that_cannot_fill_the_job_is_named(layout, device_num, message):
    dp, mp, pp = layout
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(data_parallel=dp, model_parallel=mp,
                       pipeline_stage=pp).data_parallel_for(device_num)


def test_a_compiled_layout_other_than_the_norm_weights_stops_the_run():
    """The trainer's check before step 1 (`check_compiled_layouts`): MindSpore's
    parameter_layout_dict entries (device matrix, tensor map, slice, ..., optimizer-shard
    group, whole shape) that say what the gradient-norm weights assumed pass; one weight
    compiled whole where the plan splits it stops the run, naming it."""
    from model_zoo.errors import UserInputError
    from model_zoo.layout.network import usable_parameters
    from model_zoo.parallel.compiled_layouts import check_compiled_layouts
    from model_zoo.parallel.strategy_file import parameter_layout
    config = load_config("model_zoo/gpt2/configs/tiny.yaml",
                         ["parallel.data_parallel=2", "parallel.model_parallel=2",
                          "parallel.optimizer_shard=true"], layout_checked=False)
    planned = {name: param for name, param in usable_parameters(config, "test").items()
               if param.requires_grad}
    compiled = {}
    for name, param in planned.items():   # as MindSpore reports the plan's layout
        dev_matrix, tensor_map, _, shard = parameter_layout(param, config.parallel)
        group = f"{shard}-{abs(hash(name))}" if shard else ""
        compiled[name] = (dev_matrix, tensor_map, list(param.shape), 0, True, group,
                          list(param.shape))
    check_compiled_layouts(compiled, planned, config.parallel, rank=3)
    split = next(name for name, param in planned.items() if param.split
                 and max(param.split) == 2 and name.endswith("weight"))
    entry = compiled[split]
    compiled[split] = (entry[0], [-1] * len(entry[1]), *entry[2:])
    with pytest.raises(UserInputError, match=f"MindSpore compiled for {split}, split"):
        check_compiled_layouts(compiled, planned, config.parallel, rank=3)


@pytest.mark.parametrize("batch, dp, mp, rows", [(1, 1, 8, 1), (2, 1, 8, 2), (8, 1, 8, 8),
                                                 (16, 1, 8, 8), (4, 2, 2, 4), (2, 2, 2, 2)])
def test_sequence_parallel_residual_add_splits_as_the_token_view(batch, dp, mp, rows):
    """Under sequence parallel the residual addition on (batch, seq, hidden) takes the
    (rows, dp mp / rows, 1) split, rows = gcd(batch, dp mp): device i of the dp x mp pieces
    then holds tokens [i T, (i + 1) T) of the flattened (batch * seq) stream, T = batch *
    seq / (dp mp), as the (tokens, hidden) view split (dp mp, 1) does."""
    from model_zoo.nn.layers import StreamAdd, sequence_pieces
    parallel = ParallelConfig(data_parallel=dp, model_parallel=mp, sequence_parallel=True)
    add = StreamAdd(parallel).sequence_adds[sequence_pieces(batch, dp * mp)]
    split = strategy(add)[0]
    assert split == (rows, dp * mp // rows, 1)
    seq = 16
    tokens = np.arange(batch * seq).reshape(batch, seq)
    per_row, per_col = batch // split[0], seq // split[1]
    for device in range(dp * mp):
        row, col = divmod(device, split[1])
        held = tokens[row * per_row:(row + 1) * per_row, col * per_col:(col + 1) * per_col]
        size = batch * seq // (dp * mp)
        assert held.ravel().tolist() == list(range(device * size, (device + 1) * size))
