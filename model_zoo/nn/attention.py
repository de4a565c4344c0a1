"""Attention with its strategies: the cores between the projections and the output, with one
signature, chosen once by name when a layer is built (`ATTENTION_CORES`; the backend names
the one for the device, `backend.attention_core_name`), and what attention layers share
(`AttentionLayer`), `MultiHeadAttention` with its fused QKV projection laid out head by head,
and the decode-block parts of a decoding step. Strategies follow
docs/mindspore-parallel-rules.md.

Every core is called as

    core(queries, key_values=None, positions=None, padding=None, cache=None) -> context
        queries     (batch, seq_q, heads x head_dim); self attention with one fused
                    projection passes it, (batch, seq, 3 x heads x head_dim) laid out head
                    by head (`fuse_head_projections`), and key_values None
        key_values  (batch, seq_k, 2 x kv_heads x head_dim), laid out kv head by kv head
        positions   rotary (cos, sin), float32 (seq, head_dim) rows of the positions, or
                    None for a layer without rotary positions
        padding     None or float32 additive (batch, 1, 1, seq_k)
        cache       None, or the layer's part of a decoding cache (`nn.cache`): prefill
                    (seq_q > 1, from position 0) or a step (seq_q 1, over every cached
                    position up to it); the call's keys and values are written into it
        context     (batch, seq_q, heads x head_dim)

    "dot_product"  DotProductAttention: MindSpore's operators split by heads (dp, mp, 1, 1)
    "flash"        FlashAttention: FlashAttentionScore (Ascend 910B); a step as dot_product
    "cpu_fused"    FusedCpuAttention: one CPU kernel a direction; a multi-head self-attention
                   step in one kernel; other cached calls as dot_product
"""

import functools
import math

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn import cache as kv_cache
from model_zoo.nn.backend import attention_core_name, cpu_kernel, decode_block, kernel_target
from model_zoo.nn.layers import (MASK_VALUE, DecodeBlockPart, Dropout, Linear,
                                 stream_dropout)
from model_zoo.nn.rotary import RotaryEmbedding
from model_zoo.parallel.config import ParallelConfig


@functools.lru_cache(maxsize=None)
def causal_bias(max_seq_length: int) -> Tensor:
    """float32 (1, 1, max_len, max_len): 0 where a query may attend (key <= query), else
    MASK_VALUE. One tensor per length, shared by every causal attention layer (a per-layer
    copy costs 16 MB a layer at length 2048: 1.3 GB for 80 layers)."""
    allowed = np.tril(np.ones((max_seq_length, max_seq_length), dtype=bool))
    return Tensor(np.where(allowed, 0.0, MASK_VALUE)[None, None], ms.float32)


def check_flash_attention_device(device_target: str, is_910b: bool = True):
    """ConfigError unless FlashAttentionScore can run on `device_target` (Ascend 910B)."""
    if device_target != "Ascend" or not is_910b:
        device = device_target if device_target != "Ascend" else "Ascend 910"
        raise ConfigError(f"model.flash_attention=true: FlashAttentionScore runs only on "
                          f"Ascend 910B; set model.flash_attention=false on {device}")


def check_flash_attention(head_dim: int, attention_dropout: float, compute_dtype):
    """Refuse what FlashAttentionScore cannot run (`model.flash_attention`), naming the
    config key: another device than Ascend 910B, float32, attention dropout, a head size
    that is not a multiple of 16 up to 512."""
    check_flash_attention_device(kernel_target())
    if compute_dtype not in (ms.float16, ms.bfloat16):
        raise ConfigError("model.flash_attention needs train.precision=fp16 or bf16")
    if attention_dropout:
        raise ConfigError(f"model.flash_attention needs model.attention_dropout=0 (got "
                          f"{attention_dropout}): the dropout mask would be a (seq, seq) "
                          f"tensor again")
    if head_dim % 16 or head_dim > 512:
        raise ConfigError(f"model.flash_attention needs a head size (hidden_size / "
                          f"num_heads) that is a multiple of 16 up to 512, got {head_dim}")


@functools.lru_cache(maxsize=None)
def compressed_causal_mask() -> Tensor:
    """uint8 (2048, 2048), 1 above the diagonal: FlashAttentionScore's compressed causal mask
    (sparse_mode 2; 1 means masked), one tensor shared by every layer."""
    return Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))


def fuse_head_projections(parts, num_heads: int) -> np.ndarray:
    """Separate projections (q, k, v or k, v: weights (hidden, in) or biases (hidden,)) as
    one fused projection laid out head by head: rows [q_0, k_0, v_0, q_1, k_1, v_1, ...],
    each head_dim long. Split by columns over mp, each device then holds whole heads with
    all their parts (see MultiHeadAttention)."""
    parts = [np.asarray(part) for part in parts]
    hidden = parts[0].shape[0]
    per_head = [part.reshape((num_heads, hidden // num_heads) + part.shape[1:])
                for part in parts]
    stacked = np.stack(per_head, axis=1)              # (heads, parts, head_dim, ...)
    return np.ascontiguousarray(stacked.reshape((len(parts) * hidden,) + parts[0].shape[1:]))


def split_head_projections(fused, num_heads: int, num_parts: int) -> list:
    """The inverse of `fuse_head_projections`: a fused projection laid out head by head
    -> its `num_parts` separate projections (q, k, v), each (hidden, ...)."""
    fused = np.asarray(fused)
    hidden = fused.shape[0] // num_parts
    per_head = fused.reshape((num_heads, num_parts, hidden // num_heads) + fused.shape[1:])
    return [np.ascontiguousarray(per_head[:, part].reshape((hidden,) + fused.shape[1:]))
            for part in range(num_parts)]


class DotProductAttention(nn.Cell):
    """The "dot_product" core on MindSpore's operators: the projections split into heads, rotary
    positions, scaled scores, masks, a float32 softmax, dropout on the probabilities, the
    context; every operator split by heads (dp, mp, 1, 1). With fewer key/value heads than
    query heads (grouped-query attention), each key/value head is repeated for the query heads
    of its group on the device (Tile; kv head h // group for query head h), so mp must divide
    the key/value heads. Its operators also serve the cached calls of the other cores.

    Args:
        num_heads, head_dim: query heads and their size.
        parallel_config: the layout.
        num_kv_heads: key/value heads (default num_heads).
        causal: mask the positions after each query (a slice of the shared `causal_bias`).
        max_seq_length: longest sequence, for the causal mask.
        attention_dropout: dropout on the probabilities.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        rotary: rotary positions on queries and keys (`positions` then given).

    Inputs and outputs: the core signature of the module docstring; the context in the
    compute dtype.
    """

    # what selective recompute recomputes: every operator but the dropout and the merge of
    # the heads (MindFormers marks the same ones, `llama_transformer.py`)
    step_kernel = None   # a decoding step's own kernel (FusedCpuAttention)
    RECOMPUTED = ("repeat", "scale", "scores", "to_float", "slice_causal", "add_causal",
                  "add_bias", "softmax", "to_compute", "context")

    def __init__(self, num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                 num_kv_heads: int = None, causal: bool = False, max_seq_length: int = 1024,
                 attention_dropout: float = 0.0, compute_dtype=ms.float32,
                 rotary: bool = False):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.group = num_heads // self.num_kv_heads
        self.compute_dtype = compute_dtype
        self.causal = causal
        heads = (dp, mp, 1, 1)
        # (batch, seq, heads, parts x head_dim) -> one part: heads split, parts whole
        self.take_part = ops.StridedSlice().shard(((dp, 1, mp, 1),))
        self.split_heads = ops.Transpose().shard(((dp, 1, mp, 1),))
        # a decoding step's fused q, k, v in one kernel (`heads_of`)
        self.split_qkv = ops.Split(axis=3, output_num=3).shard(((dp, 1, mp, 1),))
        self.rotary = RotaryEmbedding(head_dim, parallel_config=parallel_config) \
            if rotary else None
        if self.group > 1:   # (batch, kv_heads, 1, seq, head_dim) -> once per query head
            self.repeat = ops.Tile().shard(((dp, mp, 1, 1, 1),))
        self.scale = ops.Mul().shard((heads, ()))
        self.scores = ops.BatchMatMul(transpose_b=True).shard((heads, heads))
        self.add_causal = ops.Add().shard((heads, (1, 1, 1, 1)))
        self.add_bias = ops.Add().shard((heads, (dp, 1, 1, 1)))
        self.softmax = ops.Softmax(axis=-1).shard((heads,))
        self.to_float, self.to_compute = (ops.Cast().shard((heads,)) for _ in range(2))
        self.context = ops.BatchMatMul().shard((heads, heads))
        self.merge_heads = ops.Transpose().shard((heads,))
        self.attention_dropout = Dropout(attention_dropout, heads)
        if causal:
            self.causal_bias = causal_bias(max_seq_length)
            self.slice_causal = ops.StridedSlice().shard(((1, 1, 1, 1),))
        self.inv_sqrt_head_dim = 1.0 / math.sqrt(head_dim)

    def recompute_operators(self):
        """Mark the RECOMPUTED operators this core has for the backward pass to recompute."""
        for name in self.RECOMPUTED:
            operator = getattr(self, name, None)
            if operator is not None:
                operator.recompute()

    def construct(self, queries, key_values=None, positions=None, padding=None, cache=None):
        if cache is None:
            return self.uncached(queries, key_values, positions, padding)
        return self.cached(queries, key_values, positions, padding, cache)

    def uncached(self, queries, key_values, positions, padding):
        """Training and evaluation: every query over every key."""
        q, k, v = self._project(queries, key_values, positions)
        return self.attend(q, k, v, padding)

    def cached(self, queries, key_values, positions, padding, cache):
        """A decoding call: the keys and values written into the cache; a step attends over
        the cache up to its position, prefill over its own positions."""
        return self.cached_on_operators(queries, key_values, positions, padding, cache)

    def cached_on_operators(self, queries, key_values, positions, padding, cache):
        """`cached` on this core's operators (the other cores' cached calls too)."""
        q, k, v = self._project(queries, key_values, positions)
        keys, values = kv_cache.write(cache, k, v)
        if kv_cache.is_step(queries):
            return self.dot_product(q, keys, values, None, kv_cache.step_mask(cache))
        return ops.depend(self.attend(q, k, v, padding), (keys, values))

    def attend(self, q, k, v, padding=None):
        """q (batch, heads, seq_q, hd) over k, v (batch, kv_heads, seq_k, hd) -> context."""
        return self.dot_product(q, k, v, padding)

    def _project(self, queries, key_values, positions):
        """Queries (batch, heads, seq, hd), keys and values (batch, kv_heads, seq, hd) of the
        projections, rotary positions applied."""
        if key_values is None:
            q, k, v = self.heads_of(queries, self.num_heads, 3)
        else:
            (q,) = self.heads_of(queries, self.num_heads, 1)
            k, v = self.heads_of(key_values, self.num_kv_heads, 2)
        if positions is not None:
            cos, sin = positions
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        return q, k, v

    def heads_of(self, projected, heads: int, parts: int):
        """(batch, seq, parts x heads x head_dim) laid out head by head -> `parts` tensors
        (batch, heads, seq, head_dim)."""
        batch, seq = projected.shape[0], projected.shape[1]
        x = ops.reshape(projected, (batch, seq, heads, parts * self.head_dim))
        if seq == 1 and parts == 3:
            # a decoding step: one kernel for the three parts, and (batch, 1, heads, hd) is
            # (batch, heads, 1, hd) in memory, so no transpose (fewer kernels per step)
            return tuple(ops.reshape(piece, (batch, heads, 1, self.head_dim))
                         for piece in self.split_qkv(x))
        found = ()
        for part in range(parts):
            piece = self.take_part(x, (0, 0, 0, part * self.head_dim),
                                   (batch, seq, heads, (part + 1) * self.head_dim),
                                   (1, 1, 1, 1))
            found += (self.split_heads(piece, (0, 2, 1, 3)),)
        return found

    def _to_query_heads(self, x):
        """(batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim)."""
        if self.group == 1:
            return x
        batch, _, seq, head_dim = x.shape
        x = ops.reshape(x, (batch, self.num_kv_heads, 1, seq, head_dim))
        x = self.repeat(x, (1, 1, self.group, 1, 1))
        return ops.reshape(x, (batch, self.num_heads, seq, head_dim))

    def dot_product(self, q, k, v, padding=None, mask=None):
        """Scores, masks (`mask`: float32 additive (1, 1, seq_q, seq_k), else the causal one
        when causal; `padding`), softmax, dropout and the context (batch, seq_q, heads hd)."""
        batch, seq_q = q.shape[0], q.shape[2]
        k, v = self._to_query_heads(k), self._to_query_heads(v)
        q = self.scale(q, ops.cast(self.inv_sqrt_head_dim, self.compute_dtype))
        scores = self.to_float(self.scores(q, k), ms.float32)
        if mask is not None:
            scores = self.add_causal(scores, mask)
        elif self.causal:
            scores = self.add_causal(scores, self.slice_causal(
                self.causal_bias, (0, 0, 0, 0), (1, 1, seq_q, seq_q), (1, 1, 1, 1)))
        if padding is not None:
            scores = self.add_bias(scores, padding)
        probs = self.attention_dropout(self.to_compute(self.softmax(scores),
                                                       self.compute_dtype))
        context = self.context(probs, v)                       # (batch, heads, seq_q, hd)
        if seq_q > 1:   # one position (a decoding step) needs no transpose
            context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq_q, self.num_heads * self.head_dim))


class FlashAttention(DotProductAttention):
    """The "flash" core: one FlashAttentionScore (Ascend 910B, `model.flash_attention`),
    which keeps no (seq, seq) tensor for the backward pass, as MindFormers' FlashAttention
    calls it: BNSD layout, q/k/v split (dp, mp, 1, 1), fewer key/value heads taken as they
    are (`head_num` query heads), the causal mask as MindSpore's compressed 2048 x 2048
    triangle (sparse_mode 2), a padding mask as (batch, 1, seq_q, seq_k) booleans
    (dp, 1, 1, 1). Needs a float16 or bfloat16 compute dtype, a head size that is a
    multiple of 16 up to 512 and no attention dropout (`check_flash_attention`). Prefill runs
    it too; a decoding step takes `DotProductAttention`'s operators over the cache (no
    causal table: the step's mask comes with the cache). Causal flash attention takes no
    padding bias (no model passes one).

    Args: those of DotProductAttention.
    """

    def __init__(self, num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                 causal: bool, attention_dropout: float, compute_dtype,
                 num_kv_heads: int = None, max_seq_length: int = 1024, rotary: bool = False):
        check_flash_attention(head_dim, attention_dropout, compute_dtype)
        super().__init__(num_heads, head_dim, parallel_config=parallel_config,
                         num_kv_heads=num_kv_heads, max_seq_length=max_seq_length,
                         compute_dtype=compute_dtype, rotary=rotary)
        dp, mp = parallel_config.dp, parallel_config.mp
        heads = (dp, mp, 1, 1)
        self.flash_causal = causal
        from mindspore.ops.operations.nn_ops import FlashAttentionScore
        self.score = FlashAttentionScore(
            head_num=num_heads, scale_value=1.0 / math.sqrt(head_dim), input_layout="BNSD",
            sparse_mode=2 if causal else 0).shard(
                (heads, heads, heads) + (((1, 1),) if causal else ((dp, 1, 1, 1),)))
        if causal:
            self.causal_mask = compressed_causal_mask()
        else:
            self.padding_mask = ops.Less().shard(((dp, 1, 1, 1), ()))
            self.masked_below = Tensor(MASK_VALUE / 2, ms.float32)
            self.expand_mask = ops.Tile().shard(((dp, 1, 1, 1),))

    def recompute_operators(self):
        """Nothing to recompute: flash attention keeps no (seq x seq) tensor."""

    def attend(self, q, k, v, padding=None):
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
        if self.flash_causal:
            mask = self.causal_mask
        elif padding is None:   # nothing masked (the models always pass a padding bias)
            mask = ops.zeros((batch, 1, seq_q, seq_k), ms.uint8)
        else:   # (batch, 1, 1, seq_k) additive -> (batch, 1, seq_q, seq_k), 1 = masked
            masked = self.padding_mask(padding, self.masked_below)
            mask = self.expand_mask(ops.cast(masked, ms.uint8), (1, 1, seq_q, 1))
        context = self.score(q, k, v, None, None, None, mask)[3]   # (batch, heads, seq_q, hd)
        context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq_q, self.num_heads * self.head_dim))


class FusedCpuAttention(DotProductAttention):
    """The "cpu_fused" core: training and evaluation on CPU in float32 in one fused kernel per
    direction (`cpu_kernels.self_attention` for a fused q/k/v projection, `kv_attention` for
    separate ones), which reads the projections where they are (rotary positions applied in
    place, `cpu_kernels.rotary`) and keeps only the probabilities for the backward pass; its
    probabilities dropped out as the core's dropout would. A multi-head self-attention step
    is one kernel too (`cpu_kernels.decode_attention`, the caches written in place); other
    cached calls take `DotProductAttention`'s operators.

    Args: those of DotProductAttention, and `fused_qkv`: the queries, keys and values come
    from one projection laid out head by head (self attention's `qkv`).
    """

    def __init__(self, num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                 causal: bool = False, fused_qkv: bool = False, rotary: bool = False,
                 compute_dtype=ms.float32, **options):
        super().__init__(num_heads, head_dim, parallel_config=parallel_config, causal=causal,
                         compute_dtype=compute_dtype, rotary=rotary, **options)
        self.fused_qkv = fused_qkv
        self.kernel = cpu_kernel("self_attention" if fused_qkv else "kv_attention", num_heads,
                                 dtype=compute_dtype)
        self.causal_flag = Tensor([int(causal)], ms.int32)
        if rotary:   # in place on the projections: the queries', the fused keys'
            self.rotate_queries = cpu_kernel("rotary", 1, dtype=compute_dtype)
            self.rotate_keys = cpu_kernel("rotary", 2, dtype=compute_dtype)
        self.step_kernel = cpu_kernel("decode_attention", dtype=compute_dtype) \
            if fused_qkv and causal else None

    def recompute_operators(self):
        """Nothing to mark: the kernels are one instance shared by every layer (marking one
        would mark them all) and keep only their probabilities."""

    def uncached(self, queries, key_values, positions, padding):
        if positions is not None:
            cos, sin = positions
            queries = self.rotate_queries(queries, cos, sin)       # (batch, seq, heads hd)
            key_values = self.rotate_keys(key_values, cos, sin)    # (batch, seq, kv 2 hd)
        batch = queries.shape[0]
        seq_k = (queries if key_values is None else key_values).shape[1]
        if padding is None:
            padding = ops.zeros((batch, seq_k), ms.float32)
        else:   # (batch, 1, 1, seq_k) -> (batch, seq_k)
            padding = ops.reshape(padding, (batch, seq_k))
        key, keep = self.attention_dropout.mask_key()
        if key_values is None:
            context, _ = self.kernel(queries, padding, self.causal_flag, key, keep)
        else:
            context, _ = self.kernel(queries, key_values, padding, self.causal_flag, key, keep)
        return context

    def cached(self, queries, key_values, positions, padding, cache):
        if self.step_kernel is not None and kv_cache.is_step(queries):
            key, value, write_index, _ = cache
            return self.step_kernel(queries, key, value, write_index)
        return self.cached_on_operators(queries, key_values, positions, padding, cache)


ATTENTION_CORES = {"dot_product": DotProductAttention, "flash": FlashAttention,
                   "cpu_fused": FusedCpuAttention}


def attention_core(num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                   flash: bool = False, fused_qkv: bool = False, causal: bool = False,
                   compute_dtype=ms.float32, **options):
    """The core a layer built now takes (`backend.attention_core_name`), built with the
    options of DotProductAttention."""
    name = attention_core_name(flash=flash, fused_qkv=fused_qkv, compute_dtype=compute_dtype)
    if name == "cpu_fused":
        options["fused_qkv"] = fused_qkv
    return ATTENTION_CORES[name](num_heads, head_dim, parallel_config=parallel_config,
                                 causal=causal, compute_dtype=compute_dtype, **options)


class AttentionLayer(nn.Cell):
    """What the attention layers share: the core, chosen once when the layer is built
    (`attention_core`), the output projection with its dropout, and selective recompute. A
    subclass sets `num_heads` and `head_dim`, builds its projections and `output`, calls
    `build_core`, and sets `hidden_dropout` (a Dropout, or None)."""

    def build_core(self, parallel_config: ParallelConfig, **options):
        """`self.core` for this layer (`attention_core`'s options)."""
        self.core = attention_core(self.num_heads, self.head_dim,
                                   parallel_config=parallel_config, **options)

    def recompute_attention_core(self):
        """Selective recompute (`parallel.recompute: selective`): the backward pass recomputes
        the attention core (scores, softmax, context) instead of keeping its float32
        (seq x seq) tensors; the projections keep their activations. MindSpore's own
        Dropout is not recomputed (Primitive.recompute does not promise the same random
        mask), so with attention dropout its output and mask are kept."""
        self.core.recompute_operators()

    def _output(self, context):
        """The output projection of context (batch, seq, heads x head_dim), in float32,
        then the hidden dropout if the layer has one."""
        output = self.output(context)
        if output.dtype != ms.float32:
            output = ops.cast(output, ms.float32)
        if self.hidden_dropout is None:
            return output
        return self.hidden_dropout(output)


class MultiHeadAttention(AttentionLayer):
    """Multi-head attention: self attention (causal or not) or cross attention.

    Self attention projects Q, K and V with one column-split linear layer `qkv` (hidden ->
    3 hidden, laid out head by head: `fuse_head_projections`), so each device computes whole
    heads and the backward pass all-reduces the input's gradient once instead of three
    times. Cross attention has `query` (hidden -> hidden) and a fused `key_value` (hidden ->
    2 hidden) for the memory. The output projection is row-split: one all-reduce over mp in
    the forward pass. The core between them is chosen once (`attention_core`).

    Args:
        hidden_size, num_heads: model width and heads (both divisible by mp).
        parallel_config: the layout.
        causal: mask future positions (decoder self attention).
        cross: attend over another sequence (the encoder's memory) instead of the input.
        max_seq_length: longest sequence, for the causal mask.
        attention_dropout, hidden_dropout: dropout on the probabilities and on the output.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: the "flash" core (Ascend 910B, `model.flash_attention`).

    Inputs:
        query: (batch, seq_q, hidden).
        memory: cross attention only: (batch, seq_k, hidden).
        attention_bias: None or float32 additive bias (batch, 1, 1, seq_k), 0 to keep and a
            large negative number to mask (padding).
        cache: self attention: None, or the layer's decoding cache (`nn.cache`).
    Outputs:
        float32 (batch, seq_q, hidden).
    """

    def __init__(self, hidden_size: int, num_heads: int, *, parallel_config: ParallelConfig,
                 causal: bool = False, cross: bool = False, max_seq_length: int = 1024,
                 attention_dropout: float = 0.0, hidden_dropout: float = 0.0,
                 compute_dtype=ms.float32, init_std: float = 0.02,
                 output_init_std: float = None, flash: bool = False):
        super().__init__()
        mp = parallel_config.mp
        parallel_config.check_divisible("model.num_heads", num_heads)
        parallel_config.check_divisible("model.hidden_size", hidden_size)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.hidden_size = hidden_size
        self.compute_dtype = compute_dtype   # the key/value caches' dtype
        self.cross = cross
        linear = dict(split="column", parallel_config=parallel_config,
                      compute_dtype=compute_dtype, init_std=init_std)
        if cross:
            self.query = Linear(hidden_size, hidden_size, **linear)
            self.key_value = Linear(hidden_size, 2 * hidden_size, **linear)
        else:
            self.qkv = Linear(hidden_size, 3 * hidden_size, **linear)
        self.output = Linear(hidden_size, hidden_size, split="row",
                             parallel_config=parallel_config, compute_dtype=compute_dtype,
                             init_std=output_init_std or init_std)
        # beam search reorders the cache rows at every step (gather, then the cache write);
        # the gathered batch axis must be whole
        self.gather_rows = ops.Gather().shard(((1, mp, 1, 1), (1,)))
        self.reorder_kernel = cpu_kernel("reorder_cache", dtype=compute_dtype)
        self.build_core(parallel_config, causal=causal and not cross, fused_qkv=not cross,
                        max_seq_length=max_seq_length, attention_dropout=attention_dropout,
                        compute_dtype=compute_dtype, flash=flash)
        self.hidden_dropout = stream_dropout(hidden_dropout, parallel_config)
        # a decoding step from the norm before it to the residual addition in one launch
        kernel = None if cross or flash else decode_block("attention", compute_dtype)
        self.decode_block = AttentionBlockPart(kernel) if kernel is not None else None

    def construct(self, query, memory=None, attention_bias=None, cache=None):
        if self.cross:
            return self._output(self.core(self.query(query), self.key_value(memory), None,
                                          attention_bias))
        return self._output(self.core(self.qkv(query), None, None, attention_bias, cache))

    # The Transformer's beam search: cross attention over keys and values computed once, and
    # a self-attention step whose cache rows follow their hypotheses (functional caches, for
    # its exported step graph).
    def project_key_value(self, memory):
        """Cross attention: keys and values (batch, heads, seq_k, head_dim) of the memory."""
        return self.core.heads_of(self.key_value(memory), self.num_heads, 2)

    def attend(self, query, key, value, attention_bias=None):
        """Cross attention of `query` over precomputed keys and values."""
        (q,) = self.core.heads_of(self.query(query), self.num_heads, 1)
        return self._output(self.core.dot_product(q, key, value, attention_bias))

    def reordered_step(self, query, cache_key, cache_value, write_index, step_bias,
                       parents=None):
        """A self-attention step for query (batch, 1, hidden) whose cache rows are first taken
        from `parents` (int32 (batch,)) when given; returns (output, cache_key, cache_value),
        the caches as written (new tensors when reordered)."""
        if parents is None and self.core.step_kernel is not None:
            context = self.core.step_kernel(self.qkv(query), cache_key, cache_value, write_index)
            return self._output(context), cache_key, cache_value
        q, k, v = self.core.heads_of(self.qkv(query), self.num_heads, 3)
        if parents is not None and self.reorder_kernel is not None:
            cache_key = self.reorder_kernel(cache_key, parents, write_index, k)
            cache_value = self.reorder_kernel(cache_value, parents, write_index, v)
        else:
            if parents is not None:
                cache_key = self.gather_rows(cache_key, parents, 0)
                cache_value = self.gather_rows(cache_value, parents, 0)
            cache_key, cache_value = kv_cache.write(
                (cache_key, cache_value, write_index, step_bias), k, v)
        output = self._output(self.core.dot_product(q, cache_key, cache_value, None, step_bias))
        return output, cache_key, cache_value


class AttentionBlockPart(DecodeBlockPart):
    """`MultiHeadAttention`'s decode-block part after a LayerNorm (`cpu_kernels.decode_block`
    "attention")."""

    norm_kind, needs_cache = "layer_norm", True

    def construct(self, x, norm, layer, cache):
        key, value, write_index, _ = cache
        return self.kernel(x, norm.gamma, norm.beta, norm.eps, layer.qkv.weight, layer.qkv.bias,
                           layer.output.weight, layer.output.bias, key, value, write_index)
