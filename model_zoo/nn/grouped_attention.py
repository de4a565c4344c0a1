"""Grouped-query attention (Ainslie et al., 2023) with rotary positions (`nn.rotary`), the
attention of LLaMA and the decoders after it, with the strategies of
docs/mindspore-parallel-rules.md: heads split over mp (dp, mp, 1, 1), the query and key/value
projections column-split, the output row-split."""

import mindspore as ms

from model_zoo.errors import ConfigError
from model_zoo.nn.attention import AttentionLayer
from model_zoo.nn.backend import decode_block
from model_zoo.nn.layers import DecodeBlockPart, Linear
from model_zoo.parallel.config import ParallelConfig


class GroupedQueryAttention(AttentionLayer):
    """Causal self attention whose `num_kv_heads` key/value heads are each shared by
    num_heads / num_kv_heads query heads (grouped-query attention; multi-query with one,
    multi-head with num_heads), with rotary positions on queries and keys.

    The query projection (hidden -> heads x head_dim) and the key/value projection
    (hidden -> 2 x kv_heads x head_dim, laid out kv head by kv head as
    `fuse_head_projections([k, v], num_kv_heads)` writes it) are column-split over mp, so
    mp must divide num_kv_heads (MindFormers' LLaMA states the same rule): each device then
    holds whole groups, its query heads with the key/value heads they read. The core
    (`attention_core`) reads the key/value heads for their query heads on the device, and the
    output projection is row-split (one all-reduce over mp). A decoding cache holds the kv
    heads only.

    Args:
        hidden_size, num_heads, num_kv_heads: model width and heads.
        parallel_config: the layout.
        max_seq_length: longest sequence (causal mask).
        has_bias: bias on the query and key/value projections (Qwen-style; LLaMA has none).
        attention_dropout: dropout on the probabilities.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: the "flash" core (Ascend 910B, `model.flash_attention`), which takes the
            key/value heads as they are, without the repeat (`head_num` query heads over fewer
            key/value heads, as MindFormers' LLaMA calls it).

    Inputs:
        x: (batch, seq, hidden); positions: rotary (cos, sin), float32 (seq, head_dim) rows
        of x's positions (`rotary_tables`); cache: None, or the layer's decoding cache.
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
        self.build_core(parallel_config, causal=True, num_kv_heads=num_kv_heads, rotary=True,
                        max_seq_length=max_seq_length, attention_dropout=attention_dropout,
                        compute_dtype=compute_dtype, flash=flash)
        self.hidden_dropout = None
        # a decoding step from the norm before it to the residual addition in one launch
        kernel = None if flash else decode_block("grouped_attention", compute_dtype)
        self.decode_block = GroupedAttentionBlockPart(kernel) if kernel is not None else None

    def construct(self, x, positions, cache=None):
        return self._output(self.core(self.query(x), self.key_value(x), positions, None, cache))


class GroupedAttentionBlockPart(DecodeBlockPart):
    """`GroupedQueryAttention`'s decode-block part after an RMSNorm (`cpu_kernels.decode_block`
    "grouped_attention": rotary positions, the key/value heads each read by their group of
    query heads in place of a repeat, the caches written in place)."""

    norm_kind, needs_cache = "rms_norm", True

    def construct(self, x, norm, layer, positions, cache):
        cos, sin = positions
        key, value, write_index, _ = cache
        q, kv = layer.query, layer.key_value
        if q.has_bias:
            return self.kernel(x, norm.weight, norm.eps, q.weight, q.bias, kv.weight, kv.bias,
                               layer.output.weight, cos, sin, key, value, write_index)
        return self.kernel(x, norm.weight, norm.eps, q.weight, kv.weight, layer.output.weight,
                           cos, sin, key, value, write_index)
