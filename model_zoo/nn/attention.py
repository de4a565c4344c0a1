"""Attention with its strategies: the cores between the projections (`DotProductAttention`,
split by heads (dp, mp, 1, 1), with the shared causal masks; `FlashAttention` on Ascend
910B; `FusedCpuAttention`), what attention layers share (`AttentionLayer`: the head layout,
key/value-cache writes, the row-split output projection), and `MultiHeadAttention` with its
fused QKV projection laid out head by head and incremental decoding. Strategies follow
docs/mindspore-parallel-rules.md."""

import functools
import math

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn.backend import cpu_kernel, kernel_target
from model_zoo.nn.layers import (MASK_VALUE, Dropout, LayerNorm, Linear,
                                 decodes_in_one_launch, stream_dropout)
from model_zoo.parallel.config import ParallelConfig


@functools.lru_cache(maxsize=None)
def causal_bias(max_seq_length: int) -> Tensor:
    """float32 (1, 1, max_len, max_len): 0 where a query may attend (key <= query), else
    MASK_VALUE. One tensor per length, shared by every causal attention layer (a per-layer
    copy costs 16 MB a layer at length 2048: 1.3 GB for 80 layers)."""
    allowed = np.tril(np.ones((max_seq_length, max_seq_length), dtype=bool))
    return Tensor(np.where(allowed, 0.0, MASK_VALUE)[None, None], ms.float32)


def cache_index(first: int, count: int, rows: int, heads: int) -> Tensor:
    """Where `MultiHeadAttention.decode_step` and `prefill` write positions first ..
    first + count - 1 into caches (rows, heads, max_len, head_dim): int32
    (rows, heads, count, 3) of (row, head, position) triples."""
    row, head, position = np.meshgrid(np.arange(rows), np.arange(heads),
                                      np.arange(first, first + count), indexing="ij")
    return Tensor(np.stack([row, head, position], axis=-1).astype(np.int32))


def step_inputs(position: int, max_len: int, rows: int, heads: int):
    """What `MultiHeadAttention.decode_step` takes for decoder position `position` with
    caches (rows, heads, max_len, head_dim): its `cache_index`, and the attention bias
    (1, 1, 1, max_len) that masks the positions after it."""
    bias = np.where(np.arange(max_len) <= position, 0.0, MASK_VALUE).astype(np.float32)
    return cache_index(position, 1, rows, heads), Tensor(bias.reshape(1, 1, 1, max_len))


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
    """The attention core on MindSpore's operators, between the projections: scaled scores,
    masks, a float32 softmax, dropout on the probabilities, the context; every operator split
    by heads (dp, mp, 1, 1). With fewer key/value heads than query heads (grouped-query
    attention), each key/value head is repeated for the query heads of its group on the
    device (Tile; kv head h // group for query head h), so mp must divide the key/value heads.

    Args:
        num_heads, head_dim: query heads and their size.
        parallel_config: the layout.
        num_kv_heads: key/value heads (default num_heads).
        causal: mask the positions after each query (a slice of the shared `causal_bias`).
        max_seq_length: longest sequence, for the causal mask.
        attention_dropout: dropout on the probabilities.
        compute_dtype: dtype of the matmuls; softmax runs in float32.

    Inputs:
        q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim).
        padding: None or float32 additive bias (batch, 1, 1, seq_k), 0 to keep and a large
            negative number to mask.
        mask: None (the causal mask when causal) or float32 additive (1, 1, seq_q, seq_k),
            e.g. a decoding step's `step_inputs` bias.
    Outputs:
        context (batch, seq_q, heads x head_dim) in the compute dtype.
    """

    # what selective recompute recomputes: every operator but the dropout and the merge of
    # the heads (MindFormers marks the same ones, `llama_transformer.py`)
    RECOMPUTED = ("repeat", "scale", "scores", "to_float", "slice_causal", "add_causal",
                  "add_bias", "softmax", "to_compute", "context")

    def __init__(self, num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                 num_kv_heads: int = None, causal: bool = False, max_seq_length: int = 1024,
                 attention_dropout: float = 0.0, compute_dtype=ms.float32):
        super().__init__()
        dp, mp = parallel_config.dp, parallel_config.mp
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.group = num_heads // self.num_kv_heads
        self.compute_dtype = compute_dtype
        self.causal = causal
        heads = (dp, mp, 1, 1)
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

    def _to_query_heads(self, x):
        """(batch, kv_heads, seq, head_dim) -> (batch, heads, seq, head_dim)."""
        if self.group == 1:
            return x
        batch, _, seq, head_dim = x.shape
        x = ops.reshape(x, (batch, self.num_kv_heads, 1, seq, head_dim))
        x = self.repeat(x, (1, 1, self.group, 1, 1))
        return ops.reshape(x, (batch, self.num_heads, seq, head_dim))

    def construct(self, q, k, v, padding=None, mask=None):
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


class FlashAttention(nn.Cell):
    """The attention core as one FlashAttentionScore (Ascend 910B, `model.flash_attention`),
    which keeps no (seq, seq) tensor for the backward pass, as MindFormers' FlashAttention
    calls it: BNSD layout, q/k/v split (dp, mp, 1, 1), fewer key/value heads taken as they
    are (`head_num` query heads), the causal mask as MindSpore's compressed 2048 x 2048
    triangle (sparse_mode 2), a padding mask as (batch, 1, seq_q, seq_k) booleans
    (dp, 1, 1, 1). Needs a float16 or bfloat16 compute dtype, a head size that is a
    multiple of 16 up to 512 and no attention dropout (`check_flash_attention`).

    Inputs:
        q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim).
        padding: not causal only: None or float32 additive bias (batch, 1, 1, seq_k).
    Outputs:
        context (batch, seq_q, heads x head_dim) in the compute dtype.
    """

    def __init__(self, num_heads: int, head_dim: int, *, parallel_config: ParallelConfig,
                 causal: bool, attention_dropout: float, compute_dtype):
        super().__init__()
        check_flash_attention(head_dim, attention_dropout, compute_dtype)
        dp, mp = parallel_config.dp, parallel_config.mp
        heads = (dp, mp, 1, 1)
        self.num_heads, self.head_dim, self.causal = num_heads, head_dim, causal
        from mindspore.ops.operations.nn_ops import FlashAttentionScore
        self.score = FlashAttentionScore(
            head_num=num_heads, scale_value=1.0 / math.sqrt(head_dim), input_layout="BNSD",
            sparse_mode=2 if causal else 0).shard(
                (heads, heads, heads) + (((1, 1),) if causal else ((dp, 1, 1, 1),)))
        self.merge_heads = ops.Transpose().shard((heads,))
        if causal:
            self.causal_mask = compressed_causal_mask()
        else:
            self.padding_mask = ops.Less().shard(((dp, 1, 1, 1), ()))
            self.masked_below = Tensor(MASK_VALUE / 2, ms.float32)
            self.expand_mask = ops.Tile().shard(((dp, 1, 1, 1),))

    def construct(self, q, k, v, padding=None):
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
        if self.causal:
            mask = self.causal_mask
        elif padding is None:   # nothing masked (the models always pass a padding bias)
            mask = ops.zeros((batch, 1, seq_q, seq_k), ms.uint8)
        else:   # (batch, 1, 1, seq_k) additive -> (batch, 1, seq_q, seq_k), 1 = masked
            masked = self.padding_mask(padding, self.masked_below)
            mask = self.expand_mask(ops.cast(masked, ms.uint8), (1, 1, seq_q, 1))
        context = self.score(q, k, v, None, None, None, mask)[3]   # (batch, heads, seq_q, hd)
        context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq_q, self.num_heads * self.head_dim))


class FusedCpuAttention(nn.Cell):
    """The attention core of training and evaluation on CPU in float32: one fused kernel per
    direction (`cpu_kernels.self_attention`, `kv_attention`) that reads the projections
    where they are and keeps only the probabilities for the backward pass.

    Args:
        kernel: `cpu_kernel("self_attention", heads, ...)`, which takes the queries with the
            keys and values in one projection laid out head by head
            (`fuse_head_projections`), as self attention projects them, or
            `cpu_kernel("kv_attention", heads, ...)`, which takes them in two.
        causal: mask the positions after each query.

    Inputs:
        queries: (batch, seq_q, heads x head_dim), or the fused projection (batch, seq,
            3 x hidden) for the self-attention kernel.
        key_values: (batch, seq_k, 2 x kv_heads x head_dim) laid out key/value head by
            head, or None for the self-attention kernel.
        padding: None or float32 additive bias (batch, 1, 1, seq_k).
        key, keep: the attention dropout's `Dropout.mask_key()`.
    Outputs:
        float32 context (batch, seq_q, heads x head_dim).
    """

    def __init__(self, kernel, *, causal: bool):
        super().__init__()
        self.kernel = kernel
        self.causal_flag = Tensor([int(causal)], ms.int32)

    def construct(self, queries, key_values, padding, key, keep):
        batch = queries.shape[0]
        seq_k = (queries if key_values is None else key_values).shape[1]
        if padding is None:
            padding = ops.zeros((batch, seq_k), ms.float32)
        else:   # (batch, 1, 1, seq_k) -> (batch, seq_k)
            padding = ops.reshape(padding, (batch, seq_k))
        if key_values is None:
            context, _ = self.kernel(queries, padding, self.causal_flag, key, keep)
        else:
            context, _ = self.kernel(queries, key_values, padding, self.causal_flag, key, keep)
        return context


class AttentionLayer(nn.Cell):
    """What multi-head and grouped-query attention share: the attention cores, chosen once
    when the layer is built, the head layout of the projections, the key/value-cache writes
    of incremental decoding, and the output projection. A subclass sets `num_heads` and
    `head_dim`, builds its projections and `output`, calls `build_attention_parts`, and sets
    `hidden_dropout` (a Dropout, or None)."""

    def build_attention_parts(self, parallel_config: ParallelConfig, *, causal: bool,
                     num_kv_heads: int = None, fused_qkv: bool = False,
                     max_seq_length: int = 1024, attention_dropout: float = 0.0,
                     compute_dtype=ms.float32, flash: bool = False):
        """The head layout's operators, the cache writes, and the cores of this layer, chosen
        here once: `core` on MindSpore's operators (always: a decoding
        step runs it), and the one training, evaluation and prefill run, the first of
        `FlashAttention` (model.flash_attention), `FusedCpuAttention` (CPU, float32, with
        MindSpore's oneDNN) and `core`. `fused_qkv`: the queries, keys and values come from
        one projection laid out head by head (self attention's `qkv`)."""
        dp, mp = parallel_config.dp, parallel_config.mp
        # (batch, seq, heads, parts x head_dim) -> one part: heads split, parts whole
        self.take_part = ops.StridedSlice().shard(((dp, 1, mp, 1),))
        self.split_heads = ops.Transpose().shard(((dp, 1, mp, 1),))
        if fused_qkv:   # a decoding step's three parts in one kernel (`_heads`)
            self.split_qkv = ops.Split(axis=3, output_num=3).shard(((dp, 1, mp, 1),))
        # incremental decoding writes each new key and value into its cache in place; it
        # runs on one device, so the strategy keeps every tensor whole
        self.cache_write = ops.ScatterNdUpdate().shard(((1, 1, 1, 1),) * 3)
        self.core = DotProductAttention(
            self.num_heads, self.head_dim, parallel_config=parallel_config,
            num_kv_heads=num_kv_heads, causal=causal and not flash,
            max_seq_length=max_seq_length, attention_dropout=attention_dropout,
            compute_dtype=compute_dtype)
        self.flash = FlashAttention(self.num_heads, self.head_dim,
                                    parallel_config=parallel_config, causal=causal,
                                    attention_dropout=attention_dropout,
                                    compute_dtype=compute_dtype) if flash else None
        kernel = None if flash else cpu_kernel("self_attention" if fused_qkv else
                                               "kv_attention", self.num_heads,
                                               dtype=compute_dtype)
        self.fused = FusedCpuAttention(kernel, causal=causal) if kernel is not None else None

    def recompute_attention_core(self):
        """Selective recompute (`parallel.recompute: selective`): the backward pass recomputes
        the attention core (scores, softmax, context) instead of keeping its float32
        (seq x seq) tensors; the projections keep their activations. MindSpore's own
        Dropout is not recomputed (Primitive.recompute does not promise the same random
        mask), so with attention dropout its output and mask are kept. The fused CPU kernels
        are one instance shared by every layer (marking one would mark them all) and keep
        only their probabilities: they are left as they are. Flash attention keeps no
        (seq x seq) tensor: nothing to do."""
        if self.flash is None:
            self.core.recompute_operators()

    def _heads(self, projected, heads: int, parts: int):
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

    def _attend_all(self, q, k, v, padding=None):
        """q over k, v through the training core: flash attention, else `core`."""
        if self.flash is not None:
            return self.flash(q, k, v, padding)
        return self.core(q, k, v, padding)

    def _fused_attend(self, queries, key_values=None, padding=None):
        """The output of the fused CPU core over the projections (`FusedCpuAttention`), its
        probabilities dropped out as the core's dropout would."""
        return self._output(self.fused(queries, key_values, padding,
                                       *self.core.attention_dropout.mask_key()))

    def _write_caches(self, cache_key, cache_value, write_index, k, v):
        """The caches with k, v written at `write_index` (`cache_index`)."""
        return (self.cache_write(cache_key, write_index, k),
                self.cache_write(cache_value, write_index, v))

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
    the forward pass. The core between them is chosen once (`build_attention_parts`).

    Args:
        hidden_size, num_heads: model width and heads (both divisible by mp).
        parallel_config: the layout.
        causal: mask future positions (decoder self attention).
        cross: attend over another sequence (the encoder's memory) instead of the input.
        max_seq_length: longest sequence, for the causal mask.
        attention_dropout, hidden_dropout: dropout on the probabilities and on the output.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: the core as `FlashAttention` (Ascend 910B, `model.flash_attention`). Causal
            flash attention takes no padding bias (no model passes one). A decoding step
            keeps the core on MindSpore's operators; prefill takes flash attention.

    Inputs:
        query: (batch, seq_q, hidden).
        memory: cross attention only: (batch, seq_k, hidden).
        attention_bias: None or float32 additive bias (batch, 1, 1, seq_k), 0 to keep and a
            large negative number to mask (padding).
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
        # a decoding step's attention in one launch, the caches written in place
        self.decode_kernel = None if cross or flash else cpu_kernel("decode_attention",
                                                                    dtype=compute_dtype)
        # and with the norm before it, the projections and the residual addition
        self.decode_block = None if cross or flash else cpu_kernel("decode_block", "attention",
                                                                   dtype=compute_dtype)
        self.build_attention_parts(parallel_config, causal=causal and not cross,
                                   fused_qkv=not cross, max_seq_length=max_seq_length,
                                   attention_dropout=attention_dropout,
                                   compute_dtype=compute_dtype, flash=flash)
        self.hidden_dropout = stream_dropout(hidden_dropout, parallel_config)

    def construct(self, query, memory=None, attention_bias=None):
        if self.fused is not None:
            if self.cross:
                return self._fused_attend(self.query(query), self.key_value(memory),
                                          attention_bias)
            return self._fused_attend(self.qkv(query), None, attention_bias)
        if self.cross:
            (q,) = self._heads(self.query(query), self.num_heads, 1)
            k, v = self.project_key_value(memory)
        else:
            q, k, v = self._heads(self.qkv(query), self.num_heads, 3)
        return self._output(self._attend_all(q, k, v, attention_bias))

    def project_key_value(self, memory):
        """Cross attention: keys and values (batch, heads, seq_k, head_dim) of the memory;
        incremental decoding computes them once."""
        return self._heads(self.key_value(memory), self.num_heads, 2)

    def attend(self, query, key, value, attention_bias=None):
        """Cross attention of `query` over precomputed keys and values."""
        (q,) = self._heads(self.query(query), self.num_heads, 1)
        return self._output(self.core(q, key, value, attention_bias))

    def decode_step(self, query, cache_key, cache_value, write_index, step_bias,
                    parents=None):
        """One incremental self-attention step: no recomputation of past positions.

        Args:
            query: (batch, 1, hidden), the newest position.
            cache_key, cache_value: (batch, heads, max_len, head_dim), the keys and values of
                the positions decoded so far; the newest position's are written into them in
                place (Parameters of the step cell, or tensors the step owns).
            write_index: int32 (batch, heads, 1, 3), `cache_index` of the newest position.
            step_bias: float32 (1, 1, 1, max_len), 0 up to the newest position, else masked.
            parents: beam search: int32 (batch,), the cache row each row continues; the
                caches are then new tensors, rows reordered (one pass on CPU).
        Returns:
            (output (batch, 1, hidden), cache_key, cache_value), the caches as written.
        """
        if parents is None and self.decode_kernel is not None:
            return (self.decode_in_place(query, cache_key, cache_value, write_index, step_bias),
                    cache_key, cache_value)
        q, k, v = self._heads(self.qkv(query), self.num_heads, 3)  # (batch, heads, 1, hd)
        if parents is not None and self.reorder_kernel is not None:
            cache_key = self.reorder_kernel(cache_key, parents, write_index, k)
            cache_value = self.reorder_kernel(cache_value, parents, write_index, v)
        else:
            if parents is not None:
                cache_key = self.gather_rows(cache_key, parents, 0)
                cache_value = self.gather_rows(cache_value, parents, 0)
            cache_key, cache_value = self._write_caches(cache_key, cache_value, write_index,
                                                        k, v)
        output = self._output(self.core(q, cache_key, cache_value, None, step_bias))
        return output, cache_key, cache_value

    def decode_in_place(self, query, cache_key, cache_value, write_index, step_bias):
        """`decode_step` for a caller that goes on with the caches it passed (Parameters,
        written in place): the output alone. Returning the caches to a caller that drops
        them leaves MindSpore eliminating those outputs of a call with side effects, with a
        warning each ("Some side effect nodes were eliminated by mistake"; no write is
        lost, the writes stay in the call)."""
        if self.decode_kernel is not None:
            return self._output(self.decode_kernel(self.qkv(query), cache_key, cache_value,
                                                   write_index))
        q, k, v = self._heads(self.qkv(query), self.num_heads, 3)  # (batch, heads, 1, hd)
        cache_key, cache_value = self._write_caches(cache_key, cache_value, write_index, k, v)
        return self._output(self.core(q, cache_key, cache_value, None, step_bias))

    def decode_residual(self, norm, x, cache_key, cache_value, write_index, step_bias):
        """x + `decode_in_place`(norm(x), ...) for a pre-norm block's decoding step, x (batch,
        1, hidden): in one launch on CPU after a LayerNorm (`cpu_kernels.decode_block`), else
        through the layers."""
        if decodes_in_one_launch(self, x) and isinstance(norm, LayerNorm):
            return self.decode_block(x, norm.gamma, norm.beta, norm.eps, self.qkv.weight,
                                     self.qkv.bias, self.output.weight, self.output.bias,
                                     cache_key, cache_value, write_index)
        return x + self.decode_in_place(norm(x), cache_key, cache_value, write_index, step_bias)

    def prefill(self, query, cache_key, cache_value, write_index):
        """Causal self attention over a decoder's first positions query (batch, P, hidden)
        in one pass, writing their keys and values into the caches (`write_index`:
        `cache_index(0, P, ...)`), so that decoding continues at position P."""
        q, k, v = self._heads(self.qkv(query), self.num_heads, 3)  # (batch, heads, P, hd)
        caches = self._write_caches(cache_key, cache_value, write_index, k, v)
        return ops.depend(self._output(self._attend_all(q, k, v)), caches)
