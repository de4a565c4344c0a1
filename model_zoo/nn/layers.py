"""Sharded building blocks (attention in `attention.py`, the loss in `loss.py`).

Every primitive that touches activations or weights gets its `.shard(...)` strategy in
`__init__`, derived from a ParallelConfig, as MindSpore's semi-auto parallel mode expects on
Ascend; `construct` only does the math. Strategies follow `docs/mindspore-parallel-rules.md`
(dp = data_parallel, mp = model_parallel):

- column-split linear: MatMul ((dp,1),(mp,1)), bias ((dp,mp),(mp,)), no communication;
- row-split linear:    MatMul ((dp,mp),(1,mp)), bias ((dp,1),(1,)), all-reduce over mp;
- attention: one fused QKV column-split linear (heads split by mp, laid out head by head);
  scores, softmax and context carry (dp,mp,1,1);
- layer norm: ((dp,1,1),(1,),(1,)), the normalised axis is never split;
- sequence parallel (`parallel.sequence_parallel`): the residual stream's token-wise
  operators (layer norm, hidden dropout, residual add) see (batch, seq, hidden) as
  (tokens, hidden) split (dp*mp, 1), and the row-split linear reduce-scatters its partial
  sums into that layout (out_strategy ((dp*mp, 1),)); a column-split linear all-gathers its
  input over mp first (MindSpore inserts it: rule G8);
- activations (GELU, exact GELU, ReLU, tanh): element-wise, the input's strategy;
- vocabulary embedding: Gather ((1,1),(dp,1)) when vocab_emb_dp, else ((mp,1),(dp,1));
- cross-entropy: OneHot and SoftmaxCrossEntropyWithLogits with the class dimension whole, or,
  under a vocabulary-split head, a log-softmax whose class axis stays split (dp, mp).

Stand-alone and data-parallel runs ignore the strategies; the plan check verifies them.
Activations are (batch, seq, hidden); a linear layer flattens them to 2-D for MatMul.

CPU kernels: MindSpore's CPU kernels for layer norm, GELU and softmax cross-entropy are
several times slower than one pass over memory, so CPU builds use the fused kernels of
`cpu_kernels` for them (same math, no strategies: CPU runs ignore strategies anyway).
`backend.cpu_kernel` makes that choice for every block; the plan check, which models
Ascend, builds under `backend.kernels_for("Ascend")` and so sees MindSpore's operators.
"""

import itertools
import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, One, Zero, initializer
from mindspore.common.seed import _get_graph_seed  # how nn.Dropout takes its seeds
from mindspore.ops.auto_generate import SiLU

from model_zoo.errors import ConfigError
from model_zoo.nn import cpu_kernels
from model_zoo.nn import backend
from model_zoo.nn.backend import cpu_kernel, decode_block
from model_zoo.parallel.config import ParallelConfig

MASK_VALUE = -1e9


def dtype_of(precision: str):
    """MindSpore compute dtype for a `train.precision` value."""
    return {"fp16": ms.float16, "bf16": ms.bfloat16}.get(precision, ms.float32)


def check_precision_device(precision: str, device_target: str, is_910b: bool = True):
    """ConfigError unless `train.precision` runs on the device: bfloat16 needs an Ascend
    910B (Atlas A2); the 910 has no bfloat16 Cube and MindSpore's CPU kernels none at all
    (its CPU MatMul refuses the type)."""
    if precision == "bf16" and (device_target != "Ascend" or not is_910b):
        device = "CPU" if device_target == "CPU" else "Ascend 910"
        raise ConfigError(f"train.precision=bf16 runs on Ascend 910B only, not on {device}; "
                          f"use fp16 (with its loss scale) or fp32 there")


class DecodeBlockPart(nn.Cell):
    """A layer's decode-block part: one half of a pre-norm decoder block, norm to residual
    addition, in one launch at a decoding step's few rows (`cpu_kernels.decode_block`, handed
    out by the CPU backend: `backend.decode_block`). A subclass says which norm the kernel
    computes (`norm_kind`), whether the half reads a decoding cache (`needs_cache`), and in
    `construct(x, norm, layer, *inputs)` which weights of the norm and the layer it takes."""

    norm_kind, needs_cache = None, False

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel


def decodes_in_one_launch(layer, norm, x, cache) -> bool:
    """Whether `layer` takes a decoding step's x (batch, 1, hidden) after `norm` through its
    decode-block part: it has one for this norm, it is in eval mode, the rows are few, and
    the half has the cache it reads."""
    part = layer.decode_block
    return part is not None and norm.kind == part.norm_kind and not layer.training and \
        x.shape[1] == 1 and x.shape[0] <= cpu_kernels.SKINNY_ROWS and \
        (cache is not None or not part.needs_cache)


def pre_norm_residual(add, norm, layer, x, *inputs, cache=None):
    """add(x, layer(norm(x), *inputs)): one half of a pre-norm block; `cache`, for a layer
    that takes one, is passed on. At a decoding step the layer's decode-block part runs the
    whole half in one launch, when it has one (`decodes_in_one_launch`)."""
    if decodes_in_one_launch(layer, norm, x, cache):
        if cache is None:
            return layer.decode_block(x, norm, layer, *inputs)
        return layer.decode_block(x, norm, layer, *inputs, cache)
    if cache is None:
        return add(x, layer(norm(x), *inputs))
    return add(x, layer(norm(x), *inputs, cache=cache))


def stream_strategy(parallel_config: ParallelConfig) -> tuple:
    """Strategy of the residual stream's token-wise operators (layer norm, hidden dropout,
    residual add): (dp, 1, 1) on (batch, seq, hidden); with `parallel.sequence_parallel`
    (dp * mp, 1) on its (tokens, hidden) view (`as_tokens`), so each device of a stage keeps
    1 / (dp mp) of the tokens, the layout the row-split linear's reduce-scatter leaves (as
    in MindFormers' 2-D sequence parallel). Between these operators the stream is
    (batch, seq, hidden) again, which holds the same slices when the dp x mp pieces are
    whole sequences or equal parts of one (`ParallelConfig.check_sequence_split`)."""
    if parallel_config.sequence_parallel:
        return (parallel_config.dp * parallel_config.mp, 1)
    return (parallel_config.dp, 1, 1)


def sequence_pieces(batch: int, pieces: int) -> int:
    """Index, among the divisors of `pieces` in increasing order, of the rows of whole
    sequences sequence parallel's `pieces` (dp x mp) slices of a (batch, seq, hidden)
    stream span: gcd(batch, pieces) (`ResidualAdd`)."""
    rows = math.gcd(batch, pieces)
    return sum(1 for divisor in range(1, rows) if pieces % divisor == 0)


def as_tokens(x):
    """(batch, seq, hidden) -> (batch * seq, hidden), the view sequence parallel splits."""
    return ops.reshape(x, (-1, x.shape[-1]))


# The (train step, micro batch) that the keyed dropout masks of this process follow: the
# train step writes it before each forward pass (`model_zoo.train.step.TrainStep`). A free
# variable of the Dropout cells, not a parameter of theirs: it is never saved or loaded.
DROPOUT_STEP = Parameter(Tensor(np.zeros(2, np.int32)), name="dropout_step", requires_grad=False)


_UNSEEDED_CELLS = itertools.count(1)


def _rank() -> int:
    """This process's rank once communication is initialised, else 0."""
    try:
        from mindspore.communication import get_rank
        return get_rank()
    except (RuntimeError, ValueError):
        return 0


class Dropout(nn.Cell):
    """Dropout with a strategy; an identity when the rate is 0 or the cell is not training.

    Its masks are a function of `train.seed` (MindSpore's global seed when the cell is
    built), the cell's place among the random operators built since then, and DROPOUT_STEP:
    the same run gives the same masks, and a resumed run the masks it would have had. On
    CPU the keyed kernel (`cpu_kernels.keyed_dropout`) does this. MindSpore's own CPU
    Dropout draws from `std::random_device` unless given seeds, and with seeds keeps its
    generator's state inside the kernel, where no checkpoint reaches it
    (`plugin/device/cpu/kernel/dropout_cpu_kernel.cc`). Elsewhere (Ascend, the plan check)
    the cell is MindSpore's Dropout with seeds from the global seed, as `nn.Dropout` takes
    them (`mindspore/nn/layer/basic.py`): a run is repeatable, but a resumed run draws a
    new stream.

    Args:
        rate: probability of dropping an element.
        strategy: the input's strategy, e.g. (dp, 1, 1); a 2-D strategy on a 3-D input
            applies to its (tokens, hidden) view (`stream_strategy`).
    """

    def __init__(self, rate: float, strategy: tuple):
        super().__init__()
        self.rate = rate
        self.rank = len(strategy)
        seed, op_seed = _get_graph_seed(0, "dropout")
        self.dropout = ops.Dropout(keep_prob=1.0 - rate, Seed0=seed,
                                   Seed1=op_seed).shard((tuple(strategy),))
        self.keyed = cpu_kernel("dropout") if rate else None
        if seed == op_seed == 0:   # no global seed: at least no two cells alike
            op_seed = next(_UNSEEDED_CELLS)
        # each rank of CPU data parallel draws its own masks
        self.seeds = Tensor([(seed * 1_000_003 + _rank()) % 2 ** 31, op_seed % 2 ** 31],
                            ms.int32)
        self.keep = Tensor([1.0 - rate], ms.float32)
        # when off: keep everything, and a key nothing reads (so that an exported or
        # evaluated graph does not read DROPOUT_STEP, which no cell owns)
        self.keep_all, self.unused_key = Tensor([1.0], ms.float32), Tensor([0] * 4, ms.int32)

    def mask_key(self):
        """(key int32 (4,), keep float32 (1,)): what the keyed kernel would draw this cell's
        mask from now, for a kernel that applies this dropout inside (the CPU attention);
        keep is 1 when the cell is off (rate 0, or not training)."""
        if self.rate == 0.0 or not self.training:
            return self.unused_key, self.keep_all
        return ops.concat((self.seeds, DROPOUT_STEP)), self.keep

    def construct(self, x):
        if self.rate == 0.0 or not self.training:
            return x
        if self.keyed is not None and x.dtype == ms.float32:
            return self.keyed(x, *self.mask_key())
        if len(x.shape) == self.rank:
            return self.dropout(x)[0]
        return ops.reshape(self.dropout(as_tokens(x))[0], x.shape)


def stream_dropout(rate: float, parallel_config: ParallelConfig) -> Dropout:
    """Dropout on (batch, seq, hidden) activations of the residual stream."""
    return Dropout(rate, stream_strategy(parallel_config))


class ExactGELU(nn.Cell):
    """GELU with the Gauss error function: x * 0.5 * (1 + erf(x / sqrt(2))).

    This is BERT's (and Hugging Face's `hidden_act="gelu"`) activation; `ops.GeLU` is the
    tanh approximation. Every primitive is element-wise (MindSpore's ErfInfo is an
    ActivationOther, like GeLU; Mul/Add with a scalar get `()` for it, rule G1), so each
    takes the input's strategy and no communication is inserted.

    Args:
        strategy: the input's strategy, e.g. (dp, mp) for a column-split linear's output.

    Inputs:
        x: a tensor whose rank is len(strategy).
    Outputs:
        a tensor of x's shape and dtype.
    """

    def __init__(self, strategy: tuple):
        super().__init__()
        strategy = tuple(strategy)
        self.scale = ops.Mul().shard((strategy, ()))
        self.erf = ops.Erf().shard((strategy,))
        self.add_one = ops.Add().shard((strategy, ()))
        self.half = ops.Mul().shard((strategy, ()))
        self.mul = ops.Mul().shard((strategy, strategy))
        self.inv_sqrt_2 = 1.0 / math.sqrt(2.0)

    def construct(self, x):
        erf = self.erf(self.scale(x, ops.cast(self.inv_sqrt_2, x.dtype)))
        cdf = self.half(self.add_one(erf, ops.cast(1.0, x.dtype)), ops.cast(0.5, x.dtype))
        return self.mul(x, cdf)


class MatMulProduct(nn.Cell):
    """x W^T (+ b) on MindSpore's MatMul and Add with a layer's strategies (its product on
    operators; `backend.linear_product` hands out the CPU one).

    Inputs:
        x: (rows, in); weight: (out, in); bias: (out,) or None; in the compute dtype.
    Outputs:
        (rows, out).
    """

    def __init__(self, matmul_strategy, out_strategy=None, bias_strategy=None):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        if out_strategy is None:
            self.matmul.shard(matmul_strategy)
        else:
            self.matmul.shard(matmul_strategy, (out_strategy,))
        self.bias_add = None if bias_strategy is None else ops.Add().shard(bias_strategy)

    def construct(self, x, weight, bias=None):
        y = self.matmul(x, weight)
        return y if bias is None else self.bias_add(y, bias)


class Linear(nn.Cell):
    """y = x W^T + b over the last axis, with the weight split by columns or rows.

    Args:
        in_features, out_features: sizes of the last axis before and after.
        split: "column" splits the output features over mp (no communication), "row" splits
            the input features over mp (MindSpore all-reduces the partial sums; with
            `parallel.sequence_parallel` it reduce-scatters them over the tokens instead,
            leaving the output (dp*mp, 1)), "none" keeps the weight whole.
        parallel_config: the layout; dp splits the rows (tokens).
        activation: optional activation applied on the output, sharded like it: "gelu"
            (tanh approximation, `ops.GeLU`), "gelu_exact" (erf form, `ExactGELU`), "relu"
            or "tanh".
        has_bias: add a bias.
        compute_dtype: dtype of the matmul (weights are stored in float32).
        init_std: standard deviation of the normal weight init.

    Inputs:
        x: (..., in_features).
    Outputs:
        (..., out_features) in compute_dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, split: str = "none",
                 parallel_config: ParallelConfig, activation: str = None, has_bias: bool = True,
                 compute_dtype=ms.float32, init_std: float = 0.02):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        scattered = False   # rows reduce-scattered over mp (sequence parallel's row split)
        if split == "column":
            parallel_config.check_divisible(f"output features of a {in_features}->"
                                            f"{out_features} linear layer", out_features)
            matmul_strategy, out_strategy = ((dp, 1), (mp, 1)), (dp, mp)
        elif split == "row":
            parallel_config.check_divisible(f"input features of a {in_features}->"
                                            f"{out_features} linear layer", in_features)
            matmul_strategy, out_strategy = ((dp, mp), (1, mp)), (dp, 1)
            scattered = parallel_config.sequence_parallel
            if scattered:
                out_strategy = stream_strategy(parallel_config)
        elif split == "none":
            matmul_strategy, out_strategy = ((dp, 1), (1, 1)), (dp, 1)
        else:
            raise ValueError(f"split must be column, row or none, got {split!r}")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.weight = Parameter(initializer(Normal(init_std), (out_features, in_features),
                                            ms.float32), name="weight")
        # the output strategy of a reduce-scatter (rule G6: rows split by dp x mp)
        operators = MatMulProduct(matmul_strategy, out_strategy if scattered else None,
                                  (out_strategy, (out_strategy[1],)) if has_bias else None)
        self.product = backend.linear_product(operators, has_bias, compute_dtype)
        self.has_bias = has_bias
        self.bias = None
        if has_bias:
            self.bias = Parameter(initializer(Zero(), (out_features,), ms.float32), name="bias")
        self.activation = None
        if activation in ("gelu", "gelu_exact"):
            self.activation = cpu_kernel("gelu", activation == "gelu_exact") or (
                ops.GeLU().shard((out_strategy,)) if activation == "gelu"
                else ExactGELU(out_strategy))
        elif activation == "relu":
            self.activation = ops.ReLU().shard((out_strategy,))
        elif activation == "tanh":
            self.activation = ops.Tanh().shard((out_strategy,))
        elif activation is not None:
            raise ValueError("activation must be gelu, gelu_exact, relu, tanh or None, "
                             f"got {activation!r}")

    def construct(self, x):
        lead_shape = x.shape[:-1]
        x = ops.reshape(ops.cast(x, self.compute_dtype), (-1, self.in_features))
        bias = self.bias   # None, or float32: cast only for a product in another dtype
        if self.has_bias and self.compute_dtype != ms.float32:
            bias = ops.cast(bias, self.compute_dtype)
        y = self.product(x, ops.cast(self.weight, self.compute_dtype), bias)
        if self.activation is not None:
            y = self.activation(y)
        return ops.reshape(y, lead_shape + (self.out_features,))


class LayerNorm(nn.Cell):
    """Layer normalisation over the last axis, computed in float32; that axis is never split.
    Split like the residual stream (`stream_strategy`).

    Inputs:
        x: (batch, seq, hidden).
    Outputs:
        float32 tensor of the same shape.
    """

    kind = "layer_norm"   # what a decode-block part computes (`DecodeBlockPart.norm_kind`)

    def __init__(self, hidden_size: int, *, parallel_config: ParallelConfig, eps: float = 1e-5):
        super().__init__()
        self.gamma = Parameter(initializer(One(), (hidden_size,), ms.float32), name="gamma")
        self.beta = Parameter(initializer(Zero(), (hidden_size,), ms.float32), name="beta")
        self.normalize = backend.norm(self.kind, LayerNormOperators(parallel_config, eps))
        self.eps = Tensor(eps, ms.float32)

    def construct(self, x):
        return self.normalize(ops.cast(x, ms.float32), self.gamma, self.beta, self.eps)


class LayerNormOperators(nn.Cell):
    """`LayerNorm` on MindSpore's operator, split like the residual stream.

    Inputs: x float32 (batch, seq, hidden), gamma, beta, eps (held by the operator).
    """

    def __init__(self, parallel_config: ParallelConfig, eps: float):
        super().__init__()
        strategy = stream_strategy(parallel_config)
        self.tokens_view = parallel_config.sequence_parallel
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1,
                                  epsilon=eps).shard((strategy, (1,), (1,)))

    def construct(self, x, gamma, beta, eps):
        if self.tokens_view:
            return ops.reshape(self.norm(as_tokens(x), gamma, beta)[0], x.shape)
        return self.norm(x, gamma, beta)[0]


class RMSNorm(nn.Cell):
    """Root-mean-square normalisation over the last axis (Zhang and Sennrich, 2019; LLaMA's
    norm): x / sqrt(mean(x^2) + eps) * weight, in float32, with no mean subtracted and no
    bias. Split like the residual stream (`stream_strategy`); the last axis is never split.

    Inputs:
        x: (batch, seq, hidden).
    Outputs:
        float32 tensor of the same shape.
    """

    kind = "rms_norm"

    def __init__(self, hidden_size: int, *, parallel_config: ParallelConfig, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(initializer(One(), (hidden_size,), ms.float32), name="weight")
        self.normalize = backend.norm(self.kind, RMSNormOperators(parallel_config))
        self.eps = Tensor(eps, ms.float32)

    def construct(self, x):
        return self.normalize(ops.cast(x, ms.float32), self.weight, self.eps)


class RMSNormOperators(nn.Cell):
    """`RMSNorm` on MindSpore's operators, split like the residual stream.

    Inputs: x float32 (batch, seq, hidden), weight (hidden,), eps float32 scalar.
    """

    def __init__(self, parallel_config: ParallelConfig):
        super().__init__()
        strategy = stream_strategy(parallel_config)
        self.tokens_view = parallel_config.sequence_parallel
        self.square = ops.Square().shard((strategy,))
        self.mean = ops.ReduceMean(keep_dims=True).shard((strategy,))
        self.add_eps = ops.Add().shard((strategy, ()))
        self.rsqrt = ops.Rsqrt().shard((strategy,))
        self.normalize = ops.Mul().shard((strategy, strategy))
        self.scale = ops.Mul().shard((strategy, (1,)))

    def construct(self, x, weight, eps):
        shape = x.shape
        if self.tokens_view:
            x = as_tokens(x)
        inverse_rms = self.rsqrt(self.add_eps(self.mean(self.square(x), -1), eps))
        y = self.scale(self.normalize(x, inverse_rms), weight)
        return ops.reshape(y, shape) if self.tokens_view else y


class VocabEmbedding(nn.Cell):
    """Token embedding lookup.

    With `parallel_config.vocab_emb_dp` every device keeps the whole table and the lookup is
    split by batch; otherwise the table is split by vocabulary over mp and the ids by batch
    over dp, ((mp,1),(dp,1)) as MindSpore's and MindFormers' VocabEmbedding do: each device
    looks up its own batch slice in its vocabulary slice (out-of-slice ids give zeros) and
    MindSpore sums the partial lookups over mp. (MindSpore's "batch and axis" Gather mode:
    mp x dp must be the whole stage; with dp = 1 it is the plain vocabulary split.)

    Inputs:
        input_ids: int32 (batch, seq).
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, parallel_config: ParallelConfig,
                 init_std: float = 0.02):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.embedding_table = Parameter(
            initializer(Normal(init_std), (vocab_size, hidden_size), ms.float32),
            name="embedding_table")
        if parallel_config.vocab_emb_dp:
            self.gather = ops.Gather().shard(((1, 1), (dp, 1)))
        else:
            parallel_config.check_divisible("model.vocab_size", vocab_size)
            self.gather = ops.Gather().shard(((mp, 1), (dp, 1)))

    def tie_across_stages(self):
        """Mark the table as also used on a later pipeline stage (a tied output projection):
        the parallel optimizer then leaves it whole, as MindSpore's own VocabEmbedding and
        PanGu-alpha keep theirs (`parallel_optimizer=False`). Sharded, the gradients of its
        two uses do not add up on the first stage: MindSpore 2.10 refuses the graph ("For
        'AddN', input shape must be same", seen with `model-zoo dryrun`)."""
        self.embedding_table.parallel_optimizer = False

    def construct(self, input_ids):
        return self.gather(self.embedding_table, input_ids, 0)


class PositionEmbedding(nn.Cell):
    """Learned absolute positions added to (batch, seq, hidden) activations.

    Inputs:
        x: float32 (batch, seq, hidden), seq <= max_positions.
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, max_positions: int, hidden_size: int, *,
                 parallel_config: ParallelConfig, init_std: float = 0.02):
        super().__init__()
        dp = parallel_config.dp
        self.embedding_table = Parameter(
            initializer(Normal(init_std), (max_positions, hidden_size), ms.float32),
            name="embedding_table")
        self.slice = ops.StridedSlice().shard(((1, 1),))
        self.add = ops.Add().shard(((dp, 1, 1), (1, 1)))
        self.cpu_add = cpu_kernel("bias_add", dtype=ms.float32)   # float32 x only

    def construct(self, x):
        batch, seq, hidden = x.shape
        # On CPU the whole table is taken as it is when the sequence fills it (MindSpore's
        # CPU StridedSlice takes about 1 ms to copy all of a 128 x 256 one), and added in
        # float32 as a bias of seq x hidden to the (batch, seq x hidden) view (its broadcast
        # Add: 10-20x slower)
        positions = self.embedding_table
        if self.cpu_add is None or seq != self.embedding_table.shape[0]:
            positions = self.slice(self.embedding_table, (0, 0), (seq, hidden), (1, 1))
        if self.cpu_add is None or x.dtype != ms.float32:
            return self.add(x, positions)
        flat = self.cpu_add(ops.reshape(x, (batch, seq * hidden)),
                            ops.reshape(positions, (seq * hidden,)))
        return ops.reshape(flat, (batch, seq, hidden))


def sinusoid_table(max_positions: int, hidden_size: int) -> np.ndarray:
    """The fixed position encodings of Vaswani et al. (2017): sin on even, cos on odd features."""
    positions = np.arange(max_positions, dtype=np.float64)[:, None]
    rates = np.exp(-math.log(10000.0) * np.arange(0, hidden_size, 2) / hidden_size)
    table = np.zeros((max_positions, hidden_size))
    table[:, 0::2] = np.sin(positions * rates)
    table[:, 1::2] = np.cos(positions * rates[: hidden_size // 2])
    return table.astype(np.float32)


class SinusoidalPositionEncoding(nn.Cell):
    """Adds fixed sinusoidal positions to (batch, seq, hidden) activations.

    Inputs:
        x: float32 (batch, seq, hidden); offset (optional): int, the position of x's first
            element (incremental decoding feeds one position at a time).
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, max_positions: int, hidden_size: int, *, parallel_config: ParallelConfig):
        super().__init__()
        dp = parallel_config.dp
        self.table = Tensor(sinusoid_table(max_positions, hidden_size))
        self.hidden_size = hidden_size
        self.slice = ops.StridedSlice().shard(((1, 1),))
        self.add = ops.Add().shard(((dp, 1, 1), (1, 1)))

    def construct(self, x):
        positions = self.slice(self.table, (0, 0), (x.shape[1], self.hidden_size), (1, 1))
        return self.add(x, positions)


class FeedForward(nn.Cell):
    """Position-wise feed-forward: column-split expansion with activation, row-split back.

    Inputs:
        x: (batch, seq, hidden).
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *,
                 parallel_config: ParallelConfig, activation: str = "gelu",
                 hidden_dropout: float = 0.0, compute_dtype=ms.float32, init_std: float = 0.02,
                 output_init_std: float = None):
        super().__init__()
        parallel_config.check_divisible("model.ffn_hidden_size", ffn_hidden_size)
        self.expand = Linear(hidden_size, ffn_hidden_size, split="column",
                             activation=activation, parallel_config=parallel_config,
                             compute_dtype=compute_dtype, init_std=init_std)
        self.project = Linear(ffn_hidden_size, hidden_size, split="row",
                              parallel_config=parallel_config, compute_dtype=compute_dtype,
                              init_std=output_init_std or init_std)
        self.dropout = stream_dropout(hidden_dropout, parallel_config)
        kernel = decode_block("feed_forward", compute_dtype) if activation == "gelu" else None
        self.decode_block = FeedForwardBlockPart(kernel) if kernel is not None else None

    def construct(self, x):
        return self.dropout(ops.cast(self.project(self.expand(x)), ms.float32))


class FeedForwardBlockPart(DecodeBlockPart):
    """`FeedForward`'s decode-block part after a LayerNorm (GELU, tanh form)."""

    norm_kind = "layer_norm"

    def construct(self, x, norm, layer):
        return self.kernel(x, norm.gamma, norm.beta, norm.eps, layer.expand.weight,
                           layer.expand.bias, layer.project.weight, layer.project.bias)


class GatedFeedForward(nn.Cell):
    """down(silu(gate(x)) * up(x)): the gated feed-forward of LLaMA (SwiGLU, Shazeer 2020).

    Gate and up are one column-split projection `gate_up` (hidden -> 2 ffn) whose output
    features interleave them, [gate_0, up_0, gate_1, up_1, ...] (`fuse_head_projections(
    [gate, up], ffn)` lays a checkpoint's two out), so every device holds matching columns
    of both whatever mp is; `down` is row-split (one all-reduce over mp). Bias-free.

    Inputs:
        x: (batch, seq, hidden).
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *,
                 parallel_config: ParallelConfig, compute_dtype=ms.float32,
                 init_std: float = 0.02, output_init_std: float = None):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        parallel_config.check_divisible("model.ffn_hidden_size", ffn_hidden_size)
        self.ffn_hidden_size = ffn_hidden_size
        self.gate_up = Linear(hidden_size, 2 * ffn_hidden_size, split="column",
                              parallel_config=parallel_config, has_bias=False,
                              compute_dtype=compute_dtype, init_std=init_std)
        self.down = Linear(ffn_hidden_size, hidden_size, split="row",
                           parallel_config=parallel_config, has_bias=False,
                           compute_dtype=compute_dtype, init_std=output_init_std or init_std)
        # (batch, seq, ffn, 2): the gate or the up half, ffn split over mp
        self.take = ops.StridedSlice().shard(((dp, 1, mp, 1),))
        self.silu = SiLU().shard(((dp, 1, mp),))
        self.gated = ops.Mul().shard(((dp, 1, mp), (dp, 1, mp)))
        self.kernel = cpu_kernel("swiglu", dtype=compute_dtype)
        kernel = decode_block("gated_feed_forward", compute_dtype)
        self.decode_block = GatedFeedForwardBlockPart(kernel) if kernel is not None else None

    def construct(self, x):
        if self.kernel is not None:
            return self.down(self.kernel(self.gate_up(x)))
        batch, seq = x.shape[0], x.shape[1]
        pairs = ops.reshape(self.gate_up(x), (batch, seq, self.ffn_hidden_size, 2))
        end = (batch, seq, self.ffn_hidden_size)
        gate = ops.reshape(self.take(pairs, (0, 0, 0, 0), end + (1,), (1, 1, 1, 1)), end)
        up = ops.reshape(self.take(pairs, (0, 0, 0, 1), end + (2,), (1, 1, 1, 1)), end)
        return ops.cast(self.down(self.gated(self.silu(gate), up)), ms.float32)


class GatedFeedForwardBlockPart(DecodeBlockPart):
    """`GatedFeedForward`'s decode-block part after an RMSNorm."""

    norm_kind = "rms_norm"

    def construct(self, x, norm, layer):
        return self.kernel(x, norm.weight, norm.eps, layer.gate_up.weight, layer.down.weight)


class ResidualAdd(nn.Cell):
    """x + y for (batch, seq, hidden) activations, split like the residual stream
    (`StreamAdd`); on CPU in float32 `cpu_kernels.add` (`backend.residual_add`)."""

    def __init__(self, *, parallel_config: ParallelConfig):
        super().__init__()
        self.add = backend.residual_add(StreamAdd(parallel_config))

    def construct(self, x, y):
        return self.add(x, y)


class StreamAdd(nn.Cell):
    """x + y on MindSpore's Add, split like the residual stream (`stream_strategy`).

    With sequence parallel the addition is made on (batch, seq, hidden) itself, split as
    the (tokens, hidden) view is: the dp x mp pieces are whole sequences or equal parts of
    one, so (rows, dp mp / rows, 1) with rows = gcd(batch, dp mp) holds the same slices
    (`sequence_pieces`). A block then ends in this Add, not in a Reshape, which MindSpore's
    pipeline inference refuses on a stage border ("Reshape op can't be a border").
    """

    def __init__(self, parallel_config: ParallelConfig):
        super().__init__()
        self.tokens_view = parallel_config.sequence_parallel
        pieces = parallel_config.dp * parallel_config.mp
        self.pieces = pieces
        # with sequence parallel one Add per way the pieces can fall on (batch, seq), by the
        # rows of whole sequences they span: `add` (pieces of whole sequences) the last
        strategy = (pieces, 1, 1) if self.tokens_view else stream_strategy(parallel_config)
        self.add = ops.Add().shard((strategy, strategy))
        self.sequence_adds = tuple(
            ops.Add().shard(((rows, pieces // rows, 1),) * 2)
            for rows in range(1, pieces) if pieces % rows == 0) + (self.add,) \
            if self.tokens_view else ()

    def construct(self, x, y):
        if self.tokens_view:
            return self.sequence_adds[sequence_pieces(x.shape[0], self.pieces)](x, y)
        return self.add(x, y)


class PaddingBias(nn.Cell):
    """The additive attention bias of a padding mask: (1 - mask) x MASK_VALUE, split by
    batch. The scalar operands get () (rule G1); the Cast to float32 takes no strategy
    (ignored in semi-auto parallel).

    Inputs:
        mask: int or float (batch, seq), 1 for tokens, 0 for padding.
    Outputs:
        float32 (batch, 1, 1, seq), 0 to keep and MASK_VALUE to mask, for the attention's
        Add ((dp,mp,1,1),(dp,1,1,1)).
    """

    def __init__(self, *, parallel_config: ParallelConfig):
        super().__init__()
        dp = parallel_config.dp
        self.invert = ops.Sub().shard(((), (dp, 1)))
        self.scale = ops.Mul().shard(((dp, 1), ()))

    def construct(self, mask):
        batch, seq = mask.shape
        padding = self.invert(ops.cast(1.0, ms.float32), ops.cast(mask, ms.float32))
        bias = self.scale(padding, ops.cast(MASK_VALUE, ms.float32))
        return ops.reshape(bias, (batch, 1, 1, seq))


class VocabProjection(nn.Cell):
    """Logits over the vocabulary from hidden states and a (tied) embedding table, or a table
    of its own (`vocab_size` given: an untied output head, its `weight` (vocab, hidden) held
    here so that it lives on the head's pipeline stage).

    The vocabulary axis is split over mp when the embedding is (vocab_emb_dp False), else whole.

    Inputs:
        x: (batch, seq, hidden); embedding_table: (vocab, hidden), or None for the own one.
    Outputs:
        float32 (batch * seq, vocab).
    """

    def __init__(self, hidden_size: int, *, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32, vocab_size: int = 0, init_std: float = 0.02):
        super().__init__()
        dp = parallel_config.dp
        vocab_split = vocabulary_split(parallel_config)
        self.hidden_size = hidden_size
        self.compute_dtype = compute_dtype
        if vocab_size:
            self.weight = Parameter(initializer(Normal(init_std), (vocab_size, hidden_size),
                                                ms.float32), name="weight")
        self.product = backend.linear_product(MatMulProduct(((dp, 1), (vocab_split, 1))),
                                              False, compute_dtype)

    def construct(self, x, embedding_table=None):
        x = ops.reshape(ops.cast(x, self.compute_dtype), (-1, self.hidden_size))
        table = ops.cast(self.weight if embedding_table is None else embedding_table,
                         self.compute_dtype)
        return ops.cast(self.product(x, table), ms.float32)


def vocabulary_split(parallel_config: ParallelConfig) -> int:
    """How many ways a vocabulary axis (embedding table, head logits, loss) is split."""
    return 1 if parallel_config.vocab_emb_dp else parallel_config.mp


def assign_pipeline_stages(blocks, parallel_config: ParallelConfig):
    """Give each block a pipeline stage, contiguous groups in order (`stage_blocks`, else
    equal; with `pipeline_interleave` chunks that go round the stages that many times:
    `ParallelConfig.block_chunks`), and recompute the first `recompute_blocks` of each
    stage: the whole block, or with `recompute: selective` its attention core only
    (`recompute_attention_core`).

    Cells before the first block belong to stage 0 and cells after the last to the final
    stage; the model sets those itself. Follows MindFormers' LayerSetting (pipeline offsets,
    per-stage recompute counts, select_recompute, the interleaved chunks' order),
    `mindformers/models/utils.py`; with interleave a stage's first blocks in model order
    (its first chunks) are the ones recomputed, where MindFormers deals the count out over
    the chunks in turn.
    """
    recomputed = parallel_config.recomputed_blocks(len(blocks))
    seen = [0] * parallel_config.pipeline_stage   # blocks of each stage so far, in order
    for block, (stage, _) in zip(blocks, parallel_config.block_chunks(len(blocks))):
        block.pipeline_stage = stage
        seen[stage] += 1
        if seen[stage] > recomputed[stage]:
            continue
        if parallel_config.recompute == "selective":
            for _, cell in block.cells_and_names():
                if hasattr(cell, "recompute_attention_core"):
                    cell.recompute_attention_core()
        else:
            block.recompute()
