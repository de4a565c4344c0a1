"""How operators leave their outputs split, and the device matrix a strategy forms.

Shared by the rules (`rules.py`) and the cost model (`cost.py`). Rule tags (G1-G11) refer
to docs/mindspore-parallel-rules.md.
"""

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from model_zoo.plan.trace import OpCall

# --- output layouts (for redistribution and memory) -----------------------------------------

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "RealDiv", "Maximum", "Minimum", "Pow", "BiasAdd",
               "FloorDiv", "Select", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
               "GreaterEqual", "LogicalAnd", "LogicalOr"}


def _right_aligned_max(parts, rank):
    out = [1] * rank
    for part in parts:
        for d, value in enumerate(part):
            position = rank - len(part) + d
            if position >= 0:
                out[position] = max(out[position], value)
    return tuple(out)


def output_layout(call: "OpCall", position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` (see `_output_layout`), or None."""
    layout = _output_layout(call, position, shape)
    if layout is None or len(layout) != len(shape):
        return None
    return tuple(layout)


def _output_layout(call: "OpCall", position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` as the operator leaves it, or None.

    Operators with a strategy follow MindSpore's output tensor layouts (a contracted or
    reduced dimension is summed away, so it is not split afterwards); Cast and Reshape pass
    their input's layout on; other operators without a strategy are unknown.
    """
    strategy, rank = call.strategy, len(shape)
    tensors = call.tensors
    if strategy is None:
        if not tensors or tensors[0].layout is None:
            return None
        if call.name == "Cast":
            return tensors[0].layout
        if call.name == "Reshape":
            return reshape_layout(tensors[0].shape, tensors[0].layout, shape)
        return None
    if len(strategy) != len(tensors) and call.name != "OneHot":
        return None
    name = call.name
    try:
        if name == "MatMul" and call.out_strategy:   # checked by rule G6
            return call.out_strategy[0]
        if name in ("MatMul", "BatchMatMul"):
            x, w = strategy[0], strategy[1]
            ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
            m = x[-1] if ta else x[-2]
            n = w[-2] if tb else w[-1]
            return _right_aligned_max([x[:-2], w[:-2]], rank - 2) + (m, n)
        if name == "Gather":
            axis = int(call.args[2]) % len(strategy[0])
            return strategy[0][:axis] + strategy[1] + strategy[0][axis + 1:]
        if name == "OneHot":
            return strategy[0]
        if name == "SoftmaxCrossEntropyWithLogits":
            return strategy[0][:1] if position == 0 else strategy[0]
        if name == "LayerNorm":
            axis = call.attr("begin_norm_axis", -1) % len(strategy[0])
            return strategy[0] if position == 0 else strategy[0][:axis] + (1,) * (rank - axis)
        if name in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"):
            axis = call.args[1] if len(call.args) > 1 else ()
            axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
            axes = ({a % len(strategy[0]) for a in axis} if axis
                    else set(range(len(strategy[0]))))
            if call.attr("keep_dims", False):
                return tuple(1 if d in axes else s for d, s in enumerate(strategy[0]))
            return tuple(s for d, s in enumerate(strategy[0]) if d not in axes)
        if name == "Transpose":
            return tuple(strategy[0][p] for p in call.args[1])
        if name in ELEMENTWISE:
            return _right_aligned_max(strategy, rank)
        if len(strategy[0]) == rank:
            return strategy[0]
    except (IndexError, TypeError):
        return None
    return None


def reshape_layout(in_shape, in_layout, out_shape) -> Optional[tuple]:
    """The layout a Reshape leaves, when MindSpore can keep the slices where they are.

    Dimensions are matched in groups of equal products. A group's slices must be contiguous
    chunks of its row-major order: every dimension before its innermost split one is split
    into single indices (e.g. (batch, seq) split (batch, k): each device holds one sequence's
    k-th part) or has size 1. The group's split P then goes to its output dimensions from
    the outermost on: a dimension of size n takes all of P if P divides n, else n (one index
    per device) when n divides P, leaving P / n for the next. This is how (tokens, hidden)
    split (dp*mp, 1) reads as (batch, seq, hidden). Anything else needs a redistribution
    whose cost is not modelled: None (unknown).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if len(in_layout) != len(in_shape) or math.prod(in_shape) != math.prod(out_shape):
        return None
    out_layout = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        group_in, group_out = [], []
        product_in = product_out = 1
        while True:
            if product_in <= product_out and i < len(in_shape) and (
                    not group_in or product_in < product_out):
                group_in.append(i)
                product_in *= in_shape[i]
                i += 1
            elif product_out < product_in and j < len(out_shape) or (
                    not group_out and j < len(out_shape)):
                group_out.append(j)
                product_out *= out_shape[j]
                j += 1
            else:
                break
            if product_in == product_out and group_in and group_out:
                break
        if product_in != product_out:
            return None
        split_dims = [d for d in group_in if in_layout[d] != 1]
        if split_dims and any(in_layout[d] != in_shape[d] for d in group_in
                              if d < split_dims[-1] and in_shape[d] > 1):
            return None
        split = math.prod(in_layout[d] for d in group_in)
        layout = [1] * len(group_out)
        for position, d in enumerate(group_out):
            if split == 1:
                break
            if out_shape[d] % split == 0:
                layout[position], split = split, 1
            elif out_shape[d] > 1 and split % out_shape[d] == 0:
                layout[position], split = out_shape[d], split // out_shape[d]
            elif out_shape[d] > 1:
                return None
        if split != 1:
            return None
        out_layout.extend(layout)
    return tuple(out_layout) if len(out_layout) == len(out_shape) else None


def matmul_dims(call: "OpCall", strategy=None):
    """(batch splits, m, k of x, k of w, n) of a MatMul/BatchMatMul strategy."""
    x, w = strategy or call.strategy
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m, k_x = (x[-1], x[-2]) if ta else (x[-2], x[-1])
    k_w, n = (w[-1], w[-2]) if tb else (w[-2], w[-1])
    batch = _right_aligned_max([x[:-2], w[:-2]], max(len(x), len(w)) - 2)
    return batch, m, k_x, k_w, n


def device_matrix(call: "OpCall") -> tuple:
    """The operator's device matrix as MindSpore forms it (rule G4).

    MatMul/BatchMatMul: batch splits then [m, k, n]; Gather: the indices' strategy then the
    table's; OneHot: its (output) strategy; element-wise and the others: the inputs'
    strategies right-aligned, the largest split of each dimension.
    """
    strategy = call.strategy
    if call.name in ("MatMul", "BatchMatMul"):
        batch, m, k_x, _, n = matmul_dims(call)
        return batch + (m, k_x, n)
    if call.name == "Gather":
        return strategy[1] + strategy[0]
    if call.name == "OneHot":
        return strategy[0]
    return _right_aligned_max(strategy, max(len(part) for part in strategy))
