"""Multi-head attention with its strategies: the fused QKV projection laid out head by head,
scores, softmax and context split by heads (dp, mp, 1, 1), the row-split output projection,
the shared causal masks, FlashAttentionScore on Ascend 910B, and incremental decoding with
key/value caches. Strategies follow docs/mindspore-parallel-rules.md."""

import functools
import math

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn import cpu_kernels
from model_zoo.nn.layers import (MASK_VALUE, Dropout, Linear, kernel_target, stream_dropout,
                                 use_cpu_kernels)
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


def uses_fused_attention(flash: bool, compute_dtype) -> bool:
    """Whether an attention layer built now runs training's attention through the fused CPU
    kernels (`cpu_kernels.self_attention`, `kv_attention`): float32 on CPU with oneDNN,
    unless it takes FlashAttentionScore."""
    return not flash and use_cpu_kernels() and compute_dtype == ms.float32 \
        and cpu_kernels.has_dense()


# the operators of the attention core, between the projections: what selective
# recompute recomputes (MindFormers marks the same ones, `llama_transformer.py`)
CORE_OPERATORS = ("repeat", "scale", "scores", "to_float", "slice_causal", "add_causal",
                  "add_bias", "softmax", "to_compute", "context")


def recompute_attention_core(attention):
    """Selective recompute (`parallel.recompute: selective`): the backward pass recomputes
    the attention core (scores, softmax, context) of `attention` instead of keeping its
    float32 (seq x seq) tensors; the projections keep their activations. MindSpore's own
    Dropout is not recomputed (Primitive.recompute does not promise the same random mask),
    so with attention dropout its output and mask are kept. The fused CPU kernels are one
    instance shared by every layer (marking one would mark them all) and keep only their
    probabilities: they are left as they are. Flash attention keeps no (seq x seq) tensor:
    nothing to do."""
    if attention.use_flash:
        return
    for name in CORE_OPERATORS:
        operator = getattr(attention, name, None)
        if operator is not None:
            operator.recompute()


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


class MultiHeadAttention(nn.Cell):
    """Multi-head attention: self attention (causal or not) or cross attention.

    Self attention projects Q, K and V with one column-split linear layer `qkv` (hidden ->
    3 hidden, laid out head by head: `fuse_head_projections`), so each device computes whole
    heads and the backward pass all-reduces the input's gradient once instead of three
    times. Cross attention has `query` (hidden -> hidden) and a fused `key_value` (hidden ->
    2 hidden) for the memory. The output projection is row-split: one all-reduce over mp in
    the forward pass.

    Args:
        hidden_size, num_heads: model width and heads (both divisible by mp).
        parallel_config: the layout.
        causal: mask future positions (decoder self attention).
        cross: attend over another sequence (the encoder's memory) instead of the input.
        max_seq_length: longest sequence, for the causal mask.
        attention_dropout, hidden_dropout: dropout on the probabilities and on the output.
        compute_dtype: dtype of the matmuls; softmax runs in float32.
        init_std, output_init_std: init of the projections and of the output projection.
        flash: compute scores, softmax and context in one FlashAttentionScore (Ascend 910B,
            `model.flash_attention`), which keeps no (seq, seq) tensor for the backward pass:
            BNSD layout, q/k/v (dp, mp, 1, 1), the causal mask as MindSpore's compressed
            2048 x 2048 lower triangle (sparse_mode 2), a padding mask as (batch, 1, seq_q,
            seq_k) booleans (dp, 1, 1, 1), as MindFormers' FlashAttention does. Needs a
            float16 compute dtype, a head size that is a multiple of 16, and no attention
            dropout (its bit mask would be a (seq, seq) tensor again). Causal flash attention
            takes no padding bias (no model passes one). Incremental decoding keeps the plain
            path.

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
        dp, mp = parallel_config.dp, parallel_config.mp
        parallel_config.check_divisible("model.num_heads", num_heads)
        parallel_config.check_divisible("model.hidden_size", hidden_size)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.hidden_size = hidden_size
        self.compute_dtype = compute_dtype
        self.causal = causal
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
        heads = (dp, mp, 1, 1)
        # (batch, seq, heads, parts x head_dim) -> one part: heads split, parts whole
        self.take_part = ops.StridedSlice().shard(((dp, 1, mp, 1),))
        self.split_heads = ops.Transpose().shard(((dp, 1, mp, 1),))
        self.split_qkv = ops.Split(axis=3, output_num=3).shard(((dp, 1, mp, 1),))
        self.merge_heads = ops.Transpose().shard((heads,))
        self.scale = ops.Mul().shard((heads, ()))
        self.scores = ops.BatchMatMul(transpose_b=True).shard((heads, heads))
        self.add_causal = ops.Add().shard((heads, (1, 1, 1, 1)))
        # incremental decoding writes each new key and value into its cache in place; it
        # runs on one device, so the strategy keeps every tensor whole
        self.cache_write = ops.ScatterNdUpdate().shard(((1, 1, 1, 1),) * 3)
        # beam search reorders the cache rows at every step (gather, then the write above);
        # the gathered batch axis must be whole
        self.gather_rows = ops.Gather().shard(((1, mp, 1, 1), (1,)))
        on_cpu = use_cpu_kernels() and compute_dtype == ms.float32
        self.reorder_kernel = cpu_kernels.reorder_cache() if on_cpu else None
        # a decoding step's attention in one launch, the caches written in place
        self.decode_kernel = cpu_kernels.decode_attention() \
            if on_cpu and not cross and not flash else None
        self.add_bias = ops.Add().shard((heads, (dp, 1, 1, 1)))
        self.softmax = ops.Softmax(axis=-1).shard((heads,))
        self.to_float, self.to_compute = (ops.Cast().shard((heads,)) for _ in range(2))
        self.context = ops.BatchMatMul().shard((heads, heads))
        self.attention_dropout = Dropout(attention_dropout, heads)
        self.hidden_dropout = stream_dropout(hidden_dropout, parallel_config)
        if causal and not flash:
            self.causal_bias = causal_bias(max_seq_length)
            self.slice_causal = ops.StridedSlice().shard(((1, 1, 1, 1),))
        self.inv_sqrt_head_dim = 1.0 / math.sqrt(self.head_dim)
        # on CPU, attention in one kernel per direction (`cpu_kernels.self_attention`)
        self.fused = None
        if uses_fused_attention(flash, compute_dtype):
            self.fused = cpu_kernels.kv_attention(num_heads) if cross else \
                cpu_kernels.self_attention(num_heads)
            self.causal_flag = Tensor([int(causal and not cross)], ms.int32)
        self.use_flash = flash
        if flash:
            check_flash_attention(self.head_dim, attention_dropout, compute_dtype)
            strategy = (heads, heads, heads) + (((1, 1),) if causal else ((dp, 1, 1, 1),))
            from mindspore.ops.operations.nn_ops import FlashAttentionScore
            self.flash = FlashAttentionScore(
                head_num=num_heads, scale_value=self.inv_sqrt_head_dim, input_layout="BNSD",
                sparse_mode=2 if causal else 0).shard(strategy)
            if causal:
                self.flash_causal_mask = compressed_causal_mask()
            else:
                self.padding_mask = ops.Less().shard(((dp, 1, 1, 1), ()))
                self.masked_below = Tensor(MASK_VALUE / 2, ms.float32)
                self.expand_mask = ops.Tile().shard(((dp, 1, 1, 1),))


    recompute_attention_core = recompute_attention_core

    def _heads(self, projected, parts: int):
        """(batch, seq, parts x hidden) laid out head by head -> `parts` tensors
        (batch, heads, seq, head_dim)."""
        batch, seq = projected.shape[0], projected.shape[1]
        x = ops.reshape(projected, (batch, seq, self.num_heads, parts * self.head_dim))
        if seq == 1 and parts == 3:
            # a decoding step: one kernel for the three parts, and (batch, 1, heads, hd) is
            # (batch, heads, 1, hd) in memory, so no transpose (fewer kernels per step)
            return tuple(ops.reshape(piece, (batch, self.num_heads, 1, self.head_dim))
                         for piece in self.split_qkv(x))
        found = ()
        for part in range(parts):
            piece = self.take_part(x, (0, 0, 0, part * self.head_dim),
                                   (batch, seq, self.num_heads, (part + 1) * self.head_dim),
                                   (1, 1, 1, 1))
            found += (self.split_heads(piece, (0, 2, 1, 3)),)
        return found

    def construct(self, query, memory=None, attention_bias=None):
        if self.fused is not None:
            return self._fused_attend(query, memory, attention_bias)
        if self.cross:
            (q,) = self._heads(self.query(query), 1)
            k, v = self.project_key_value(memory)
        else:
            q, k, v = self._heads(self.qkv(query), 3)
        if self.use_flash:
            return self._flash_attend(query.shape[0], q, k, v, attention_bias)
        if self.cross:
            return self._attend(query.shape[0], q, k, v, None, attention_bias)
        causal_bias = None
        if self.causal:
            seq = query.shape[1]
            causal_bias = self.slice_causal(self.causal_bias, (0, 0, 0, 0), (1, 1, seq, seq),
                                            (1, 1, 1, 1))
        return self._attend(query.shape[0], q, k, v, causal_bias, attention_bias)

    def project_key_value(self, memory):
        """Cross attention: keys and values (batch, heads, seq_k, head_dim) of the memory;
        incremental decoding computes them once."""
        return self._heads(self.key_value(memory), 2)

    def attend(self, query, key, value, attention_bias=None):
        """Cross attention of `query` over precomputed keys and values."""
        (q,) = self._heads(self.query(query), 1)
        return self._attend(query.shape[0], q, key, value, None, attention_bias)

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
            context = self.decode_kernel(self.qkv(query), cache_key, cache_value, write_index)
            return self.hidden_dropout(self.output(context)), cache_key, cache_value
        q, k, v = self._heads(self.qkv(query), 3)                  # (batch, heads, 1, hd)
        if parents is not None and self.reorder_kernel is not None:
            cache_key = self.reorder_kernel(cache_key, parents, write_index, k)
            cache_value = self.reorder_kernel(cache_value, parents, write_index, v)
        else:
            if parents is not None:
                cache_key = self.gather_rows(cache_key, parents, 0)
                cache_value = self.gather_rows(cache_value, parents, 0)
            cache_key = self.cache_write(cache_key, write_index, k)
            cache_value = self.cache_write(cache_value, write_index, v)
        output = self._attend(query.shape[0], q, cache_key, cache_value, step_bias, None)
        return output, cache_key, cache_value

    def prefill(self, query, cache_key, cache_value, write_index):
        """Causal self attention over a decoder's first positions query (batch, P, hidden)
        in one pass, writing their keys and values into the caches (`write_index`:
        `cache_index(0, P, ...)`), so that decoding continues at position P."""
        q, k, v = self._heads(self.qkv(query), 3)                  # (batch, heads, P, hd)
        cache_key = self.cache_write(cache_key, write_index, k)
        cache_value = self.cache_write(cache_value, write_index, v)
        if self.use_flash:
            output = self._flash_attend(query.shape[0], q, k, v, None)
        else:
            seq = query.shape[1]
            causal_bias = self.slice_causal(self.causal_bias, (0, 0, 0, 0), (1, 1, seq, seq),
                                            (1, 1, 1, 1))
            output = self._attend(query.shape[0], q, k, v, causal_bias, None)
        return ops.depend(output, (cache_key, cache_value))

    def _attend(self, batch, q, k, v, causal_bias, attention_bias):
        """q (batch, heads, seq_q, head_dim) over k, v (batch, heads, seq_k, head_dim)."""
        seq_q = q.shape[2]
        q = self.scale(q, ops.cast(self.inv_sqrt_head_dim, self.compute_dtype))
        scores = self.to_float(self.scores(q, k), ms.float32)
        if causal_bias is not None:
            scores = self.add_causal(scores, causal_bias)
        if attention_bias is not None:
            scores = self.add_bias(scores, attention_bias)
        probs = self.attention_dropout(self.to_compute(self.softmax(scores),
                                                       self.compute_dtype))
        context = self.context(probs, v)                       # (batch, heads, seq_q, hd)
        if seq_q > 1:   # one position (a decoding step) needs no transpose
            context = self.merge_heads(context, (0, 2, 1, 3))
        context = ops.reshape(context, (batch, seq_q, self.hidden_size))
        return self.hidden_dropout(ops.cast(self.output(context), ms.float32))

    def _fused_attend(self, query, memory, attention_bias):
        """Attention of query (batch, seq_q, hidden) over itself or over memory (batch,
        seq_k, hidden) through the fused CPU kernel."""
        batch, seq_k = query.shape[0], (memory if self.cross else query).shape[1]
        if attention_bias is None:
            bias = ops.zeros((batch, seq_k), ms.float32)
        else:   # (batch, 1, 1, seq_k) -> (batch, seq_k)
            bias = ops.reshape(attention_bias, (batch, seq_k))
        key, keep = self.attention_dropout.mask_key()
        if self.cross:
            context, _ = self.fused(self.query(query), self.key_value(memory), bias,
                                    self.causal_flag, key, keep)
        else:
            context, _ = self.fused(self.qkv(query), bias, self.causal_flag, key, keep)
        return self.hidden_dropout(self.output(context))

    def _flash_attend(self, batch, q, k, v, attention_bias):
        seq_q, seq_k = q.shape[2], k.shape[2]
        if self.causal:
            mask = self.flash_causal_mask
        elif attention_bias is None:  # nothing masked (the models always pass a padding bias)
            mask = ops.zeros((batch, 1, seq_q, seq_k), ms.uint8)
        else:  # additive padding bias (batch, 1, 1, seq_k) -> (batch, 1, seq_q, seq_k), 1 = masked
            masked = self.padding_mask(attention_bias, self.masked_below)
            mask = self.expand_mask(ops.cast(masked, ms.uint8), (1, 1, seq_q, 1))
        context = self.flash(q, k, v, None, None, None, mask)[3]      # (batch, heads, seq_q, hd)
        context = self.merge_heads(context, (0, 2, 1, 3))
        context = ops.reshape(context, (batch, seq_q, self.hidden_size))
        return self.hidden_dropout(ops.cast(self.output(context), ms.float32))
