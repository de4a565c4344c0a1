"""Rotary position embedding (Su et al., 2021) with its strategies: heads split over mp
(dp, mp, 1, 1). The tables are the half-split layout of Hugging Face's LLaMA."""

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from model_zoo.errors import ConfigError
from model_zoo.nn.backend import cpu_kernel
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
