"""The plan's entries for element-wise operators, views, casts, constants and dropout: each
leaves its output split as its inputs are (`operator_entry.Operator` says what an entry
holds). A new operator of this kind is a function or two and a line in `ENTRIES`."""

import math
from typing import Optional

import mindspore as ms
from mindspore import Tensor

from model_zoo.layout.operator_entry import (Operator, broadcast_shapes, dtype_of,
                                             first_tensor_dtype, right_aligned_max, ring,
                                             shape_of, slice_bytes)


# --- element-wise operators ---------------------------------------------------------------------

def same_shape(call, args):
    return [(shape_of(args[0]), dtype_of(args[0]))], False


def _elementwise_shape(call, args):
    tensors = [a for a in args if isinstance(a, (Tensor, int, float, bool))]
    return [(broadcast_shapes(*[shape_of(a) for a in tensors]), first_tensor_dtype(args))], False


def _compare_shape(call, args):
    return [(broadcast_shapes(*[shape_of(a) for a in args[:2]]), ms.bool_)], False


def _select_shape(call, args):
    return [(broadcast_shapes(*[shape_of(a) for a in args[:3]]), dtype_of(args[1]))], False


def _broadcast_layout(call, strategy, position, rank):
    return right_aligned_max(strategy, rank)


def _check_broadcast(call, shapes, violation, devices_per_stage):
    """Broadcast operands agree on every dimension they share (size > 1 on both)."""
    rank = max(len(s) for s in shapes)
    for dim in range(rank):
        present = [(i, s[len(s) - rank + dim], call.strategy[i][len(s) - rank + dim])
                   for i, s in enumerate(shapes) if len(s) - rank + dim >= 0]
        shared = [(i, size, split) for i, size, split in present if size > 1]
        splits = {split for _, _, split in shared}
        if len(splits) > 1:
            first = shared[0]
            for i, size, split in shared[1:]:
                if split != first[2]:
                    violation("broadcast", f"split {split} differs from input {first[0]}'s "
                                           f"split {first[2]} of the same dimension (shapes "
                                           f"{shapes[first[0]]} and {shapes[i]}, strategy "
                                           f"{call.strategy})", i, len(shapes[i]) - rank + dim)


def _broadcast_gradient(call, where, forward, backward):
    """An activation broadcast along a dimension the output splits gets its gradient summed
    over that split in the backward pass; not along the batch (dimension 0): what is
    shared by the batch derives from a parameter, whose data-parallel reduction is counted
    with the parameter gradients."""
    out = call.outputs[0]
    for index, info in enumerate(call.tensors):
        if not info.needs_grad or info.param is not None:
            continue
        shape = (1,) * (len(out.shape) - len(info.shape)) + tuple(info.shape)
        summed = math.prod(split for dim, (size, split) in enumerate(zip(shape, out.layout or ()))
                           if dim > 0 and size == 1 and split > 1)
        if summed > 1:
            yield ("all_reduce", f"{where}: gradient of broadcast input {index}",
                   backward * ring(summed) * slice_bytes(info, call.strategy[index]),
                   (summed, 1), backward)


def _broadcasting(shape, saved="float inputs", gradient=True) -> Operator:
    """A broadcasting element-wise operator with a strategy of its own."""
    return Operator(shape, layout=_broadcast_layout, rule=_check_broadcast,
                    communication=_broadcast_gradient, saved=saved, gradient=gradient)


# --- views, casts, constants --------------------------------------------------------------------

def _cast_shape(call, args):
    return [(shape_of(args[0]), args[1])], False


def _reshape_shape(call, args):
    shape, target = shape_of(args[0]), list(args[1])
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = math.prod(shape) // known
    if math.prod(target) != math.prod(shape):
        raise ValueError(f"cannot reshape {shape} to {tuple(args[1])}")
    return [(tuple(target), dtype_of(args[0]))], False


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


def _transpose_shape(call, args):
    shape = shape_of(args[0])
    return [(tuple(shape[p] for p in args[1]), dtype_of(args[0]))], False


def _transpose_layout(call, strategy, position, rank):
    return tuple(strategy[0][p] for p in call.args[1])


def _expand_dims_shape(call, args):
    shape = list(shape_of(args[0]))
    axis = int(args[1])
    shape.insert(axis % (len(shape) + 1), 1)
    return [(tuple(shape), dtype_of(args[0]))], False


def _squeeze_shape(call, args):
    shape = shape_of(args[0])
    axis = call.attr("axis", ())
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = {a % len(shape) for a in axis} if axis else {d for d, s in enumerate(shape) if s == 1}
    return [(tuple(s for d, s in enumerate(shape) if d not in axes), dtype_of(args[0]))], False


def _fill_shape(call, args):
    shape = args[0]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = args[1] if len(args) > 1 and args[1] is not None else ms.float32
    return [(shape, dtype)], False


def _tile_shape(call, args):
    shape, multiples = shape_of(args[0]), tuple(args[1])
    shape = (1,) * (len(multiples) - len(shape)) + shape
    return [(tuple(s * m for s, m in zip(shape, multiples)), dtype_of(args[0]))], False


def _concat_axis(call, args, rank) -> int:
    # the axis is an argument of ops.concat, an attribute of ops.Concat(axis=...)
    axis = int(args[1]) if len(args) > 1 else int(call.attr("axis", 0))
    return axis % rank


def _concat_shape(call, args):
    tensors = list(args[0])
    shape = list(shape_of(tensors[0]))
    axis = _concat_axis(call, args, len(shape))
    shape[axis] = sum(shape_of(t)[axis] for t in tensors)
    return [(tuple(shape), dtype_of(tensors[0]))], False


def _check_concat(call, shapes, violation, devices_per_stage):
    axis = _concat_axis(call, call.args, len(shapes[0]))
    first = call.strategy[0]
    for index, part in enumerate(call.strategy):
        if part != first:
            violation("Concat", f"every input needs the same strategy ({first} vs {part})", index)
    if first[axis] != 1:
        violation("Concat", "the concatenated axis must not be split", 0, axis)


def _strided_slice_shape(call, args):
    shape = shape_of(args[0])
    begin, end, strides = args[1], args[2], args[3]
    for mask in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"):
        if call.attr(mask, 0):
            raise ValueError(f"{mask} is not supported by the plan's shape rule")
    out = list(shape)
    for d, (b, e, s) in enumerate(zip(begin, end, strides)):
        size = shape[d]
        b = min(max(b + size if b < 0 else b, 0), size)
        e = min(max(e + size if e < 0 else e, 0), size)
        out[d] = max(0, -(-(e - b) // s))
    return [(tuple(out), dtype_of(args[0]))], False


def _check_strided_slice(call, shapes, violation, devices_per_stage):
    begin, end, strides = call.args[1], call.args[2], call.args[3]
    for dim, split in enumerate(call.strategy[0]):
        if split == 1 or dim >= len(begin):
            continue
        size = shapes[0][dim]
        if begin[dim] != 0 or end[dim] < size or strides[dim] != 1:
            violation("StridedSlice", f"split dimension {dim} must be taken whole with stride 1 "
                                      f"(begin {begin[dim]}, end {end[dim]}, stride "
                                      f"{strides[dim]})", 0, dim)

def _dropout_shape(call, args):
    return [(shape_of(args[0]), dtype_of(args[0])), (shape_of(args[0]), dtype_of(args[0]))], True


ENTRIES = {
    # views and constants: no data moved
    "Reshape": Operator(_reshape_shape, saved="nothing", view=True, moves_data=False),
    "ExpandDims": Operator(_expand_dims_shape, saved="nothing", view=True, moves_data=False),
    "Squeeze": Operator(_squeeze_shape, saved="nothing", view=True, moves_data=False),
    "Identity": Operator(same_shape, saved="nothing", moves_data=False),
    "Depend": Operator(same_shape, saved="nothing", view=True, moves_data=False),
    # a write into a parameter (an MoE layer's routing record): outside the gradient
    "Assign": Operator(same_shape, saved="nothing", gradient=False),
    "Ones": Operator(_fill_shape, saved="nothing", moves_data=False, gradient=False),
    "Zeros": Operator(_fill_shape, saved="nothing", moves_data=False, gradient=False),
    "ZerosLike": Operator(same_shape, saved="nothing", moves_data=False, gradient=False),
    "OnesLike": Operator(same_shape, saved="nothing", moves_data=False, gradient=False),
    "Shape": Operator(moves_data=False),
    # layout changes and copies
    "Cast": Operator(_cast_shape, saved="nothing"),
    "Transpose": Operator(_transpose_shape, layout=_transpose_layout, saved="nothing"),
    "StridedSlice": Operator(_strided_slice_shape, rule=_check_strided_slice, saved="nothing"),
    "Tile": Operator(_tile_shape, saved="nothing"),
    "Concat": Operator(_concat_shape, rule=_check_concat, saved="nothing"),
    "Split": Operator(saved="nothing"),
    "StopGradient": Operator(gradient=False),
    # broadcasting element-wise operators
    "Add": _broadcasting(_elementwise_shape, saved="nothing"),
    "Sub": _broadcasting(_elementwise_shape, saved="nothing"),
    "BiasAdd": _broadcasting(_elementwise_shape, saved="nothing"),
    "Mul": _broadcasting(_elementwise_shape, saved="cross"),
    "Div": _broadcasting(_elementwise_shape, saved="divide"),
    "RealDiv": _broadcasting(_elementwise_shape, saved="divide"),
    "Maximum": _broadcasting(_elementwise_shape, saved="both"),
    "Minimum": _broadcasting(_elementwise_shape, saved="both"),
    "Pow": _broadcasting(_elementwise_shape, saved="both"),
    "FloorDiv": _broadcasting(_elementwise_shape),
    "Select": _broadcasting(_select_shape, saved="nothing"),
    **{name: _broadcasting(_compare_shape, gradient=False)
       for name in ("Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
                    "LogicalAnd", "LogicalOr")},
    # element-wise operators without a strategy of their own (the functional forms)
    "AddExt": Operator(_elementwise_shape, saved="nothing"),
    "SubExt": Operator(_elementwise_shape, saved="nothing"),
    "Muls": Operator(_elementwise_shape),
    "Divs": Operator(_elementwise_shape),
    # unary element-wise operators, dropout
    "Dropout": Operator(_dropout_shape, saved="mask", auxiliary_outputs=(1,)),
    "Neg": Operator(same_shape, saved="nothing"),
    "LogicalNot": Operator(same_shape, gradient=False),
    **{name: Operator(same_shape, saved="out0")
       for name in ("Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt", "ReLU", "Reciprocal")},
    **{name: Operator(same_shape, saved="in0+out0") for name in ("GeLU", "FastGeLU")},
    **{name: Operator(same_shape, saved="in0")
       for name in ("Erf", "Square", "Log", "SiLU", "Abs")},
}
