"""LLaMA's attention: rotary positions (Su et al., 2021) and grouped-query attention (Ainslie
et al., 2023), with the strategies of docs/mindspore-parallel-rules.md: heads split over mp
(dp, mp, 1, 1), the query and key/value projections column-split, the output row-split."""

import math

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn.attention import (causal_bias, check_flash_attention,
                                    compressed_causal_mask, recompute_attention_core,
                                    uses_fused_attention)
from model_zoo.nn import cpu_kernels
from model_zoo.nn.layers import Dropout, Linear, use_cpu_kernels
from model_zoo.parallel.config import ParallelConfig


def rotary_tables(head_dim: int, max_positions: int, theta: float):
    """cos and sin (max_positions, head_dim) float32 of rotary position embedding, in the
    half-split layout Hugging Face's LLaMA uses: feature i and i + head_dim / 2 rotate
    together by position x theta^(-2i / head_dim)."""
    inverse = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inverse)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RotaryEmbedding(nn.Cell):
    """Rotary position embedding of queries or keys: x cos + rotate_half(x) sin, where
    rotate_half(x) = [-x2, x1] for x's halves x1, x2 along head_dim (the layout of
    `rotary_tables`, Hugging Face's and MindFormers'). Heads split over mp.

    Inputs:
        x: (batch, heads, seq, head_dim) in any float dtype.
        cos, sin: float32 (seq, head_dim), the `rotary_tables` rows of x's positions.
    Outputs:
        the same shape and dtype as x.
    """

    def __init__(self, head_dim: int, *, parallel_config: ParallelConfig):
        super().__init__()
        if head_dim % 2:
            raise ConfigError(f"rotary positions need an even head size, got {head_dim}")
        dp, mp = parallel_config.dp, parallel_config.mp
        self.half = head_dim // 2
        heads = (dp, mp, 1, 1)
        self.slice_half = ops.StridedSlice().shard((heads,))
        self.negate = ops.Neg().shard((heads,))
        self.concat = ops.Concat(axis=-1).shard((heads, heads))
        self.by_table = ops.Mul().shard((heads, (1, 1, 1, 1)))
        self.add = ops.Add().shard((heads, heads))
        self.kernel = cpu_kernels.rotary() if use_cpu_kernels() else None   # float32 only

    def construct(self, x, cos, sin):
        if self.kernel is not None and x.dtype == ms.float32:
            return self.kernel(x, cos, sin)
        batch, heads, seq, head_dim = x.shape
        cos = ops.cast(ops.reshape(cos, (1, 1, seq, head_dim)), x.dtype)
        sin = ops.cast(ops.reshape(sin, (1, 1, seq, head_dim)), x.dtype)
        first = self.slice_half(x, (0, 0, 0, 0), (batch, heads, seq, self.half), (1, 1, 1, 1))
        second = self.slice_half(x, (0, 0, 0, self.half), (batch, heads, seq, head_dim),
                                 (1, 1, 1, 1))
        rotated = self.concat((self.negate(second), first))
        return self.add(self.by_table(x, cos), self.by_table(rotated, sin))


class GroupedQueryAttention(nn.Cell):
    """Causal self attention whose `num_kv_heads` key/value heads are each shared by
    num_heads / num_kv_heads query heads (grouped-query attention; multi-query with one,
    multi-head with num_heads), with rotary positions on queries and keys.

    The query projection (hidden -> heads x head_dim) and the key/value projection
    (hidden -> 2 x kv_heads x head_dim, laid out kv head by kv head as
    `fuse_head_projections([k, v], num_kv_heads)` writes it) are column-split over mp, so
    mp must divide num_kv_heads (MindFormers' LLaMA states the same rule): each device then
    holds whole groups, its query heads with the key/value heads they read. The keys and
    values are repeated to the query heads on the device (Tile), and the output projection
    is row-split (one all-reduce over mp). Incremental decoding keeps key/value caches of
    the kv heads only (`decode_step`, `prefill`).

    Args:
        hidden_size, num_heads, num_kv_heads: model width and heads.
        parallel_config: the layout.
        max_seq_length: longest sequence (causal mask).
        has_bias: bias on the query and key/value projections (Qwen-style; LLaMA has none).
        attention_dropout: dropout on the probabilities.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: scores, softmax and context in one FlashAttentionScore (Ascend 910B,
            `model.flash_attention`; needs float16 or bfloat16, no attention dropout, a head
            size that is a multiple of 16): it takes the key/value heads as they are, without the
            repeat (`head_num` query heads over fewer key/value heads, as MindFormers'
            LLaMA calls it), BNSD, split (dp, mp, 1, 1), the causal mask as the compressed
            2048 x 2048 triangle (sparse_mode 2). Incremental decoding keeps the plain path.

    Inputs:
        x: (batch, seq, hidden); cos, sin: float32 (seq, head_dim), `rotary_tables` rows of
        x's positions.
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, *,
                 parallel_config: ParallelConfig, max_seq_length: int = 2048,
                 has_bias: bool = False, attention_dropout: float = 0.0,
                 compute_dtype=ms.float32, init_std: float = 0.02,
                 output_init_std: float = None, flash: bool = False):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        if num_heads % num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={num_kv_heads} must divide "
                              f"model.num_heads={num_heads}")
        parallel_config.check_divisible("model.num_kv_heads", num_kv_heads)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.compute_dtype = compute_dtype
        linear = dict(split="column", parallel_config=parallel_config, has_bias=has_bias,
                      compute_dtype=compute_dtype, init_std=init_std)
        self.query = Linear(hidden_size, num_heads * self.head_dim, **linear)
        self.key_value = Linear(hidden_size, 2 * num_kv_heads * self.head_dim, **linear)
        self.output = Linear(num_heads * self.head_dim, hidden_size, split="row",
                             parallel_config=parallel_config, has_bias=False,
                             compute_dtype=compute_dtype, init_std=output_init_std or init_std)
        self.rotary = RotaryEmbedding(self.head_dim, parallel_config=parallel_config)
        heads = (dp, mp, 1, 1)
        # (batch, seq, heads, parts x head_dim) -> one part, heads split
        self.take_part = ops.StridedSlice().shard(((dp, 1, mp, 1),))
        self.split_heads = ops.Transpose().shard(((dp, 1, mp, 1),))
        # (batch, kv_heads, 1, seq, head_dim) -> each key/value head once per query head
        self.repeat = ops.Tile().shard(((dp, mp, 1, 1, 1),))
        self.merge_heads = ops.Transpose().shard((heads,))
        self.scale = ops.Mul().shard((heads, ()))
        self.scores = ops.BatchMatMul(transpose_b=True).shard((heads, heads))
        self.add_bias = ops.Add().shard((heads, (1, 1, 1, 1)))
        self.softmax = ops.Softmax(axis=-1).shard((heads,))
        self.to_float, self.to_compute = (ops.Cast().shard((heads,)) for _ in range(2))
        self.context = ops.BatchMatMul().shard((heads, heads))
        self.attention_dropout = Dropout(attention_dropout, heads)
        self.causal_bias = causal_bias(max_seq_length)
        self.slice_causal = ops.StridedSlice().shard(((1, 1, 1, 1),))
        # decoding runs on one device: the cache writes keep every tensor whole
        self.cache_write = ops.ScatterNdUpdate().shard(((1, 1, 1, 1),) * 3)
        self.inv_sqrt_head_dim = 1.0 / math.sqrt(self.head_dim)
        self.use_flash = flash
        if flash:
            check_flash_attention(self.head_dim, attention_dropout, compute_dtype)
            from mindspore.ops.operations.nn_ops import FlashAttentionScore
            self.flash = FlashAttentionScore(
                head_num=num_heads, scale_value=self.inv_sqrt_head_dim, input_layout="BNSD",
                sparse_mode=2).shard((heads, heads, heads, (1, 1)))
            self.flash_causal_mask = compressed_causal_mask()
        # on CPU, training's attention in one kernel per direction, reading the projections
        # where they are (`cpu_kernels.kv_attention`), rotary positions applied in place
        self.fused = None
        if uses_fused_attention(flash, compute_dtype):
            self.fused = cpu_kernels.kv_attention(num_heads)
            self.rotate_keys = cpu_kernels.rotary(parts=2)   # the queries: self.rotary's
            self.causal_flag = Tensor([1], ms.int32)

    recompute_attention_core = recompute_attention_core

    def _heads(self, projected, heads: int, parts: int):
        """(batch, seq, parts x heads x head_dim) laid out head by head -> `parts` tensors
        (batch, heads, seq, head_dim)."""
        batch, seq = projected.shape[0], projected.shape[1]
        x = ops.reshape(projected, (batch, seq, heads, parts * self.head_dim))
        found = ()
        for part in range(parts):
            piece = self.take_part(x, (0, 0, 0, part * self.head_dim),
                                   (batch, seq, heads, (part + 1) * self.head_dim),
                                   (1, 1, 1, 1))
            found += (self.split_heads(piece, (0, 2, 1, 3)),)
        return found

    def _project(self, x, cos, sin):
        """Queries (batch, heads, seq, hd), keys and values (batch, kv_heads, seq, hd) of x,
        rotary positions applied."""
        (q,) = self._heads(self.query(x), self.num_heads, 1)
        k, v = self._heads(self.key_value(x), self.num_kv_heads, 2)
        return self.rotary(q, cos, sin), self.rotary(k, cos, sin), v

    def _to_query_heads(self, x):
        """(batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim), each key/value
        head repeated for the query heads of its group (kv head h // group for head h)."""
        if self.group == 1:
            return x
        batch, _, seq, head_dim = x.shape
        x = ops.reshape(x, (batch, self.num_kv_heads, 1, seq, head_dim))
        x = self.repeat(x, (1, 1, self.group, 1, 1))
        return ops.reshape(x, (batch, self.num_heads, seq, head_dim))

    def _attend(self, q, k, v, bias):
        """q (batch, heads, seq_q, hd) over k, v (batch, kv_heads, seq_k, hd) with the
        additive bias (1, 1, seq_q, seq_k); the output projection of the context."""
        batch, seq_q = q.shape[0], q.shape[2]
        k, v = self._to_query_heads(k), self._to_query_heads(v)
        q = self.scale(q, ops.cast(self.inv_sqrt_head_dim, self.compute_dtype))
        scores = self.add_bias(self.to_float(self.scores(q, k), ms.float32), bias)
        probs = self.attention_dropout(self.to_compute(self.softmax(scores),
                                                       self.compute_dtype))
        context = self.context(probs, v)                      # (batch, heads, seq_q, hd)
        if seq_q > 1:   # one position (a decoding step) needs no transpose
            context = self.merge_heads(context, (0, 2, 1, 3))
        context = ops.reshape(context, (batch, seq_q, self.num_heads * self.head_dim))
        return ops.cast(self.output(context), ms.float32)

    def _causal(self, seq: int):
        return self.slice_causal(self.causal_bias, (0, 0, 0, 0), (1, 1, seq, seq),
                                 (1, 1, 1, 1))

    def _causal_attend(self, q, k, v):
        """Causal attention of q over k, v (their own positions)."""
        if not self.use_flash:
            return self._attend(q, k, v, self._causal(q.shape[2]))
        batch, seq_q = q.shape[0], q.shape[2]
        context = self.flash(q, k, v, None, None, None, self.flash_causal_mask)[3]
        context = self.merge_heads(context, (0, 2, 1, 3))      # (batch, seq, heads, hd)
        context = ops.reshape(context, (batch, seq_q, self.num_heads * self.head_dim))
        return ops.cast(self.output(context), ms.float32)

    def construct(self, x, cos, sin):
        if self.fused is not None:
            return self._fused_attend(x, cos, sin)
        q, k, v = self._project(x, cos, sin)
        return self._causal_attend(q, k, v)

    def _fused_attend(self, x, cos, sin):
        """Causal attention of x (batch, seq, hidden) through the fused CPU kernels."""
        batch, seq = x.shape[0], x.shape[1]
        q = self.rotary.kernel(self.query(x), cos, sin)             # (batch, seq, heads hd)
        kv = self.rotate_keys(self.key_value(x), cos, sin)          # (batch, seq, kv 2 hd)
        key, keep = self.attention_dropout.mask_key()
        context, _ = self.fused(q, kv, ops.zeros((batch, seq), ms.float32), self.causal_flag,
                                key, keep)
        return self.output(context)

    def decode_step(self, x, cos, sin, cache_key, cache_value, write_index, step_bias):
        """One incremental step for the newest position x (batch, 1, hidden): its key and
        value written into the caches (batch, kv_heads, max_len, hd) in place at
        `write_index` (`attention.cache_index`), attention over the cached positions that
        `step_bias` (1, 1, 1, max_len) leaves unmasked. Returns (batch, 1, hidden)."""
        q, k, v = self._project(x, cos, sin)
        cache_key = self.cache_write(cache_key, write_index, k)
        cache_value = self.cache_write(cache_value, write_index, v)
        return self._attend(q, cache_key, cache_value, step_bias)

    def prefill(self, x, cos, sin, cache_key, cache_value, write_index):
        """Causal attention over the first positions x (batch, P, hidden) in one pass, their
        keys and values written into the caches (`write_index`: `cache_index(0, P, ...)`)."""
        q, k, v = self._project(x, cos, sin)
        cache_key = self.cache_write(cache_key, write_index, k)
        cache_value = self.cache_write(cache_value, write_index, v)
        return ops.depend(self._causal_attend(q, k, v), (cache_key, cache_value))
