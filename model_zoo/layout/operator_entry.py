"""`Operator`: what the plan knows of one MindSpore operator, and the helpers entries share.

An entry holds everything the plan needs of that operator:
- `shape`: its outputs' (shape, dtype) from its inputs, without computing:
  `(call, args) -> ([(shape, dtype), ...], as_tuple)`; tests/test_plan.py checks them
  against MindSpore's kernels on a tiny model. None: the recording computes the operator on
  its (small) inputs instead;
- `layout`: how its strategy leaves output `position` split, as MindSpore's output tensor
  layouts do (a contracted or reduced dimension is summed away, so it is not split
  afterwards): `(call, strategy, position, rank) -> splits`; default: the first input's
  strategy when the ranks agree;
- `device_matrix`: the device matrix its strategy forms (rule G4); default: the inputs'
  strategies right-aligned, the largest split of each dimension;
- `rule`: its own strategy rule beyond G1-G4 (docs/mindspore-parallel-rules.md):
  `(call, shapes, violation, devices_per_stage)`, calling `violation(rule, message, input,
  dim)` for each broken one;
- `communication`: what its strategy makes it exchange beyond the redistribution of its
  inputs: `(call, where, forward, backward)` yields `(kind, what, bytes, group, times)`;
- `saved`: what it keeps for its backward pass (`SAVED_KINDS`, read by
  `cost.memory.saved_tensors`);
- `view`: its output is its input, reshaped (the same memory); `moves_data`: False for
  views and constants (no memory traffic, no kernel launch counted); `gradient`: False for
  operators without a backward pass; `auxiliary_outputs`: outputs only its own backward
  reads (statistics, masks).

The entries live with their kind: `elementwise` (element-wise operators, views, casts,
constants, dropout) and `contracting` (products, lookups, the loss, normalisation, softmax,
reductions, flash attention); `operators` looks them up.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import mindspore as ms
from mindspore import Tensor

# What an operator keeps for backward ("x" = input 0, "w" = input 1): `cost.memory.saved_tensors`.
SAVED_KINDS = {
    "float inputs": "every floating-point input",
    "nothing": "nothing (its gradient needs no tensor)",
    "cross": "each operand whose partner needs a gradient (a product)",
    "divide": "the divisor, and the dividend when the divisor needs a gradient",
    "both": "every input",
    "out0": "its output",
    "out1": "its second output",
    "in0": "its first input",
    "in0+out0": "its first input and its output",
    "in0+stats": "its input and its statistics (outputs 1 and 2)",
    "mask": "its mask (output 1), one bit an element",
    "indices": "the indices, when the table needs a gradient",
    "flash": "q, k, v, a padding mask, the softmax statistics and the output",
}


@dataclass(frozen=True)
class Operator:
    """The plan's knowledge of one operator (module docstring)."""

    shape: Optional[Callable] = None
    layout: Optional[Callable] = None
    device_matrix: Optional[Callable] = None
    rule: Optional[Callable] = None
    communication: Optional[Callable] = None
    saved: str = "float inputs"
    view: bool = False
    moves_data: bool = True
    gradient: bool = True
    auxiliary_outputs: tuple = ()

    def __post_init__(self):
        if self.saved not in SAVED_KINDS:   # cost.saved_tensors would read it as the default
            raise ValueError(f"saved={self.saved!r} is none of {sorted(SAVED_KINDS)}")


# --- helpers ------------------------------------------------------------------------------------

def shape_of(value) -> tuple:
    return tuple(value.shape) if isinstance(value, Tensor) else ()


def dtype_of(value):
    if isinstance(value, Tensor):
        return value.dtype
    if isinstance(value, bool):
        return ms.bool_
    return ms.int64 if isinstance(value, int) else ms.float32


def broadcast_shapes(*shapes) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def right_aligned_max(parts, rank) -> tuple:
    """The largest split of each dimension of `parts` aligned on their last dimension."""
    out = [1] * rank
    for part in parts:
        for d, value in enumerate(part):
            position = rank - len(part) + d
            if position >= 0:
                out[position] = max(out[position], value)
    return tuple(out)


def ring(n) -> float:
    """Bytes a device sends per byte of an all-reduce over n devices (ring algorithm)."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def collective(n) -> float:
    """Bytes a device sends per byte of an all-gather or reduce-scatter over n devices."""
    return (n - 1) / n if n > 1 else 0.0


def slice_bytes(info, split, bytes_per_element=None) -> float:
    """Bytes of one device's slice of `info` split `split`."""
    size = bytes_per_element if bytes_per_element is not None else info.nbytes / max(info.numel, 1)
    parts = math.prod(split) if split else 1
    return info.numel * size / parts


def gather_factor(have, wanted) -> int:
    """How many slices of a tensor laid out `have` an operator wanting `wanted` gathers
    (rule G8; 1 when it only takes a part of its slice, or the layout is unknown)."""
    if have is None or len(have) != len(wanted):
        return 1
    return math.prod(h // w if h % w == 0 else 1 if w % h == 0 else h
                     for h, w in zip(have, wanted))


def first_tensor_dtype(args):
    for arg in args:
        if isinstance(arg, Tensor):
            return arg.dtype
    return dtype_of(args[0])


def reduced_axes(args, rank) -> set:
    axis = args[1] if len(args) > 1 else ()
    axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
    return {a % rank for a in axis} if axis else set(range(rank))
