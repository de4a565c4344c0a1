"""The key/value cache of decoding, passed to the same `construct` that trains.

A language model's call `lm(input_ids, cache)` is a training or evaluation pass without a
cache, and with one it is a decoding call: prefill (positions 0 .. P - 1 of every row, P > 1)
or a step (one position p), the keys and values of its positions written into the cache, and
only the last position's logits returned. The cache is a tuple, the one structure a MindSpore
graph takes as an input and hands down unchanged (a class instance made in the graph must be
built from constants, and a namedtuple is not one of the graph's types):

    (keys, values, write_index, bias, positions)
    keys, values   one tensor (batch, kv_heads, length, head_dim) a layer, in the attention's
                   compute dtype; Parameters of the caller (`DecodeStep`), written in place,
                   or tensors of a caller that takes them back (beam search's reordered rows);
    write_index    int32 (batch, kv_heads, n, 3): where the call's n positions go
                   (`cache_index`);
    bias           float32 (1, 1, 1, length): 0 up to the step's position, MASK_VALUE after
                   (a step reads the cache through it; prefill reads only its own positions);
    positions      the model's position inputs of the call's positions (GPT-2: rows of its
                   learned table; LLaMA: the rotary cos and sin rows).

A layer sees its own part, `for_layer(cache, index)`: (key, value, write_index, bias). A new
kind of cache (a latent one, a paged one) is a new module of these functions, not new methods
on every layer.
"""

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from model_zoo.nn.layers import MASK_VALUE


def cache_index(first: int, count: int, rows: int, heads: int) -> Tensor:
    """Where positions first .. first + count - 1 go in caches (rows, heads, length,
    head_dim): int32 (rows, heads, count, 3) of (row, head, position) triples."""
    row, head, position = np.meshgrid(np.arange(rows), np.arange(heads),
                                      np.arange(first, first + count), indexing="ij")
    return Tensor(np.stack([row, head, position], axis=-1).astype(np.int32))


def step_bias(position: int, length: int) -> Tensor:
    """float32 (1, 1, 1, length): 0 up to `position`, MASK_VALUE after it."""
    bias = np.where(np.arange(length) <= position, 0.0, MASK_VALUE).astype(np.float32)
    return Tensor(bias.reshape(1, 1, 1, length))


def step_inputs(position: int, length: int, rows: int, heads: int):
    """(write_index, bias) of a decoding step at `position` over caches of `length`."""
    return cache_index(position, 1, rows, heads), step_bias(position, length)


def make(keys, values, write_index, bias, positions=()):
    """A model's cache (the module docstring)."""
    return (keys, values, write_index, bias, positions)


def positions(cache):
    """The position inputs of the call's positions."""
    return cache[4]


def for_layer(cache, index: int):
    """Layer `index`'s part: (key, value, write_index, bias); None without a cache."""
    if cache is None:
        return None
    return (cache[0][index], cache[1][index], cache[2], cache[3])


def write(layer_cache, k, v):
    """The layer's key and value caches with k, v (batch, kv_heads, n, head_dim) written at
    the call's positions (in place when the caches are Parameters)."""
    key, value, write_index = layer_cache[0], layer_cache[1], layer_cache[2]
    if k.dtype != key.dtype:
        k, v = ops.cast(k, key.dtype), ops.cast(v, value.dtype)
    return (ops.scatter_nd_update(key, write_index, k),
            ops.scatter_nd_update(value, write_index, v))


def step_mask(layer_cache):
    """The additive mask (1, 1, 1, length) of a step over the whole cache."""
    return layer_cache[3]


def last_position(hidden, cache):
    """hidden (batch, seq, width) of a call: with a cache its last position (batch, 1, width),
    whose logits choose the next token, else all of it."""
    if cache is None or hidden.shape[1] == 1:
        return hidden
    return hidden[:, -1:]


def is_step(x) -> bool:
    """Whether a decoding call of x (batch, seq, ...) is a step (one position), not prefill."""
    return x.shape[1] == 1


def zeros(layers: int, shape: tuple, dtype, name: str):
    """`layers` cache Parameters of `shape` for a caller that keeps them (`DecodeStep`)."""
    return ms.ParameterTuple(
        ms.Parameter(Tensor(np.zeros(shape, np.float32), dtype), name=f"{name}_{index}",
                     requires_grad=False)
        for index in range(layers))
