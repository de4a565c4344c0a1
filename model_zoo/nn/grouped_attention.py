"""LLaMA's attention: rotary positions (Su et al., 2021) and grouped-query attention (Ainslie
et al., 2023), with the strategies of docs/mindspore-parallel-rules.md: heads split over mp
(dp, mp, 1, 1), the query and key/value projections column-split, the output row-split."""


import numpy as np
import mindspore as ms
from mindspore import nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn.attention import AttentionLayer
from model_zoo.nn.backend import cpu_kernel
from model_zoo.nn.layers import Linear, RMSNorm, decodes_in_one_launch
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
        self.kernel = cpu_kernel("rotary", 1, dtype=ms.float32)   # float32 x only

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


class GroupedQueryAttention(AttentionLayer):
    """Causal self attention whose `num_kv_heads` key/value heads are each shared by
    num_heads / num_kv_heads query heads (grouped-query attention; multi-query with one,
    multi-head with num_heads), with rotary positions on queries and keys.

    The query projection (hidden -> heads x head_dim) and the key/value projection
    (hidden -> 2 x kv_heads x head_dim, laid out kv head by kv head as
    `fuse_head_projections([k, v], num_kv_heads)` writes it) are column-split over mp, so
    mp must divide num_kv_heads (MindFormers' LLaMA states the same rule): each device then
    holds whole groups, its query heads with the key/value heads they read. The core
    (`build_attention_parts`) repeats the keys and values to the query heads on the device, and the
    output projection is row-split (one all-reduce over mp). Incremental decoding keeps
    key/value caches of the kv heads only (`decode_step`, `prefill`).

    Args:
        hidden_size, num_heads, num_kv_heads: model width and heads.
        parallel_config: the layout.
        max_seq_length: longest sequence (causal mask).
        has_bias: bias on the query and key/value projections (Qwen-style; LLaMA has none).
        attention_dropout: dropout on the probabilities.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: the core as `FlashAttention` (Ascend 910B, `model.flash_attention`), which
            takes the key/value heads as they are, without the repeat (`head_num` query
            heads over fewer key/value heads, as MindFormers' LLaMA calls it). A decoding
            step keeps the core on MindSpore's operators; prefill takes flash attention.

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
        if num_heads % num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={num_kv_heads} must divide "
                              f"model.num_heads={num_heads}")
        parallel_config.check_divisible("model.num_kv_heads", num_kv_heads)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.compute_dtype = compute_dtype   # the key/value caches' dtype
        linear = dict(split="column", parallel_config=parallel_config, has_bias=has_bias,
                      compute_dtype=compute_dtype, init_std=init_std)
        self.query = Linear(hidden_size, num_heads * self.head_dim, **linear)
        self.key_value = Linear(hidden_size, 2 * num_kv_heads * self.head_dim, **linear)
        self.output = Linear(num_heads * self.head_dim, hidden_size, split="row",
                             parallel_config=parallel_config, has_bias=False,
                             compute_dtype=compute_dtype, init_std=output_init_std or init_std)
        self.rotary = RotaryEmbedding(self.head_dim, parallel_config=parallel_config)
        self.build_attention_parts(parallel_config, causal=True, num_kv_heads=num_kv_heads,
                                   max_seq_length=max_seq_length,
                                   attention_dropout=attention_dropout,
                                   compute_dtype=compute_dtype, flash=flash)
        self.hidden_dropout = None
        # the fused CPU core reads the projections with rotary positions applied in place
        # (the queries' kernel is self.rotary's)
        self.rotate_keys = cpu_kernel("rotary", 2, dtype=compute_dtype) \
            if self.fused is not None else None
        # a decoding step from the norm before it to the residual addition in one launch
        self.decode_block = None if flash else cpu_kernel("decode_block", "grouped_attention",
                                                          dtype=compute_dtype)

    def _project(self, x, cos, sin):
        """Queries (batch, heads, seq, hd), keys and values (batch, kv_heads, seq, hd) of x,
        rotary positions applied."""
        (q,) = self._heads(self.query(x), self.num_heads, 1)
        k, v = self._heads(self.key_value(x), self.num_kv_heads, 2)
        return self.rotary(q, cos, sin), self.rotary(k, cos, sin), v

    def construct(self, x, cos, sin):
        if self.fused is not None:
            q = self.rotary.kernel(self.query(x), cos, sin)         # (batch, seq, heads hd)
            kv = self.rotate_keys(self.key_value(x), cos, sin)      # (batch, seq, kv 2 hd)
            return self._fused_attend(q, kv)
        return self._output(self._attend_all(*self._project(x, cos, sin)))

    def decode_step(self, x, cos, sin, cache_key, cache_value, write_index, step_bias):
        """One incremental step for the newest position x (batch, 1, hidden): its key and
        value written into the caches (batch, kv_heads, max_len, hd) in place at
        `write_index` (`attention.cache_index`), attention over the cached positions that
        `step_bias` (1, 1, 1, max_len) leaves unmasked. Returns (batch, 1, hidden)."""
        q, k, v = self._project(x, cos, sin)
        cache_key, cache_value = self._write_caches(cache_key, cache_value, write_index, k, v)
        return self._output(self.core(q, cache_key, cache_value, None, step_bias))

    def decode_residual(self, norm, x, cos, sin, cache_key, cache_value, write_index,
                        step_bias):
        """x + `decode_step`(norm(x), ...) for a pre-norm block's decoding step, x (batch, 1,
        hidden): in one launch on CPU after an RMSNorm (`cpu_kernels.decode_block`: rotary
        positions, the key/value heads each read by their group of query heads in place of
        a repeat, the caches written in place), else through the layers."""
        if decodes_in_one_launch(self, x) and isinstance(norm, RMSNorm):
            q, kv = self.query, self.key_value
            if q.has_bias:
                return self.decode_block(x, norm.weight, norm.eps, q.weight, q.bias, kv.weight,
                                         kv.bias, self.output.weight, cos, sin, cache_key,
                                         cache_value, write_index)
            return self.decode_block(x, norm.weight, norm.eps, q.weight, kv.weight,
                                     self.output.weight, cos, sin, cache_key, cache_value,
                                     write_index)
        return x + self.decode_step(norm(x), cos, sin, cache_key, cache_value, write_index,
                                    step_bias)

    def prefill(self, x, cos, sin, cache_key, cache_value, write_index):
        """Causal attention over the first positions x (batch, P, hidden) in one pass, their
        keys and values written into the caches (`write_index`: `cache_index(0, P, ...)`)."""
        q, k, v = self._project(x, cos, sin)
        caches = self._write_caches(cache_key, cache_value, write_index, k, v)
        return ops.depend(self._output(self._attend_all(q, k, v)), caches)
