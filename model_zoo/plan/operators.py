"""What the plan knows of each MindSpore operator: one `Operator` entry per name (`OPERATORS`).

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
  `cost.saved_tensors`);
- `view`: its output is its input, reshaped (the same memory); `moves_data`: False for
  views and constants (no memory traffic, no kernel launch counted); `gradient`: False for
  operators without a backward pass; `auxiliary_outputs`: outputs only its own backward
  reads (statistics, masks).

Adding an operator is adding its entry here.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import mindspore as ms
from mindspore import Tensor

if TYPE_CHECKING:
    from model_zoo.plan.trace import OpCall

# What an operator keeps for backward ("x" = input 0, "w" = input 1): `cost.saved_tensors`.
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

def _shape(value) -> tuple:
    return tuple(value.shape) if isinstance(value, Tensor) else ()


def _dtype(value):
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


def _first_tensor_dtype(args):
    for arg in args:
        if isinstance(arg, Tensor):
            return arg.dtype
    return _dtype(args[0])


def _reduced_axes(args, rank) -> set:
    axis = args[1] if len(args) > 1 else ()
    axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
    return {a % rank for a in axis} if axis else set(range(rank))


# --- element-wise operators ---------------------------------------------------------------------

def _same_shape(call, args):
    return [(_shape(args[0]), _dtype(args[0]))], False


def _elementwise_shape(call, args):
    tensors = [a for a in args if isinstance(a, (Tensor, int, float, bool))]
    return [(broadcast_shapes(*[_shape(a) for a in tensors]), _first_tensor_dtype(args))], False


def _compare_shape(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:2]]), ms.bool_)], False


def _select_shape(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:3]]), _dtype(args[1]))], False


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
    return [(_shape(args[0]), args[1])], False


def _reshape_shape(call, args):
    shape, target = _shape(args[0]), list(args[1])
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = math.prod(shape) // known
    if math.prod(target) != math.prod(shape):
        raise ValueError(f"cannot reshape {shape} to {tuple(args[1])}")
    return [(tuple(target), _dtype(args[0]))], False


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
    shape = _shape(args[0])
    return [(tuple(shape[p] for p in args[1]), _dtype(args[0]))], False


def _transpose_layout(call, strategy, position, rank):
    return tuple(strategy[0][p] for p in call.args[1])


def _expand_dims_shape(call, args):
    shape = list(_shape(args[0]))
    axis = int(args[1])
    shape.insert(axis % (len(shape) + 1), 1)
    return [(tuple(shape), _dtype(args[0]))], False


def _squeeze_shape(call, args):
    shape = _shape(args[0])
    axis = call.attr("axis", ())
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = {a % len(shape) for a in axis} if axis else {d for d, s in enumerate(shape) if s == 1}
    return [(tuple(s for d, s in enumerate(shape) if d not in axes), _dtype(args[0]))], False


def _fill_shape(call, args):
    shape = args[0]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = args[1] if len(args) > 1 and args[1] is not None else ms.float32
    return [(shape, dtype)], False


def _tile_shape(call, args):
    shape, multiples = _shape(args[0]), tuple(args[1])
    shape = (1,) * (len(multiples) - len(shape)) + shape
    return [(tuple(s * m for s, m in zip(shape, multiples)), _dtype(args[0]))], False


def _concat_axis(call, args, rank) -> int:
    # the axis is an argument of ops.concat, an attribute of ops.Concat(axis=...)
    axis = int(args[1]) if len(args) > 1 else int(call.attr("axis", 0))
    return axis % rank


def _concat_shape(call, args):
    tensors = list(args[0])
    shape = list(_shape(tensors[0]))
    axis = _concat_axis(call, args, len(shape))
    shape[axis] = sum(_shape(t)[axis] for t in tensors)
    return [(tuple(shape), _dtype(tensors[0]))], False


def _check_concat(call, shapes, violation, devices_per_stage):
    axis = _concat_axis(call, call.args, len(shapes[0]))
    first = call.strategy[0]
    for index, part in enumerate(call.strategy):
        if part != first:
            violation("Concat", f"every input needs the same strategy ({first} vs {part})", index)
    if first[axis] != 1:
        violation("Concat", "the concatenated axis must not be split", 0, axis)


def _strided_slice_shape(call, args):
    shape = _shape(args[0])
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
    return [(tuple(out), _dtype(args[0]))], False


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


# --- products -------------------------------------------------------------------------------------

def matmul_dims(call: "OpCall", strategy=None):
    """(batch splits, m, k of x, k of w, n) of a MatMul/BatchMatMul strategy."""
    x, w = strategy or call.strategy
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m, k_x = (x[-1], x[-2]) if ta else (x[-2], x[-1])
    k_w, n = (w[-1], w[-2]) if tb else (w[-2], w[-1])
    batch = right_aligned_max([x[:-2], w[:-2]], max(len(x), len(w)) - 2)
    return batch, m, k_x, k_w, n


def _matmul_shape(call, args):
    x, w = _shape(args[0]), _shape(args[1])
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m = x[-1] if ta else x[-2]
    k_x = x[-2] if ta else x[-1]
    k_w = w[-1] if tb else w[-2]
    n = w[-2] if tb else w[-1]
    if k_x != k_w:
        raise ValueError(f"contracted sizes differ: {k_x} and {k_w}")
    return [(broadcast_shapes(x[:-2], w[:-2]) + (m, n), _dtype(args[0]))], False


def _matmul_layout(call, strategy, position, rank):
    if call.name == "MatMul" and call.out_strategy:   # checked by rule G6
        return call.out_strategy[0]
    _, m, _, _, n = matmul_dims(call, (strategy[0], strategy[1]))
    return right_aligned_max([strategy[0][:-2], strategy[1][:-2]], rank - 2) + (m, n)


def _matmul_device_matrix(call):
    batch, m, k_x, _, n = matmul_dims(call)
    return batch + (m, k_x, n)


def _check_matmul(call, shapes, violation, devices_per_stage):
    batch, m, k_x, k_w, n = matmul_dims(call)
    x, w = call.strategy
    tb = bool(call.attr("transpose_b", False))
    # Conservative (docs/mindspore-parallel-rules.md, "MatMul, details", unconfirmed):
    # MatMul's PCL exception (2-D, equal strategies, product S, unequal K shards) is not
    # used, and transpose_a is refused as matmul_info.cc@4a7a9e4b does.
    if call.name == "MatMul" and call.attr("transpose_a", False):
        violation("MatMul", "transpose_a with a strategy is rejected by some MindSpore "
                            "versions; transpose the input instead", 0)
    if k_x != k_w:
        violation("MatMul", f"the contracted dimension is split {k_x} in input 0 but {k_w} in "
                            f"input 1 (strategy {call.strategy}, transpose_b={tb}); MatMul "
                            f"needs equal splits", 1, len(w) - 1 if tb else len(w) - 2)
    for offset in range(1, min(len(x), len(w)) - 1):
        dx, dw = len(x) - 2 - offset, len(w) - 2 - offset
        size_x, size_w = shapes[0][dx], shapes[1][dw]
        if size_x > 1 and size_w > 1 and x[dx] != w[dw]:
            violation("BatchMatMul", f"batch dimension split {x[dx]} in input 0 but {w[dw]} in "
                                     f"input 1 (strategy {call.strategy})", 1, dw)


def _matmul_communication(call, where, forward, backward):
    """Partial sums over a split contracted dimension, and the gradients of the inputs the
    other operand's split leaves partial."""
    out, (x, w) = call.outputs[0], call.tensors[:2]
    _, m, k, _, n = matmul_dims(call)
    if k > 1 and call.out_strategy and call.out_strategy[0][0] == m * k:
        # rule G6: the partial sums are reduce-scattered over the rows; the backward pass
        # all-gathers the output's gradient back
        unscattered = slice_bytes(out, (m, n))
        yield ("reduce_scatter", f"{where}: partial sums (k split {k}) scattered over the rows",
               forward * collective(k) * unscattered, (k, 1), forward)
        yield ("all_gather", f"{where}: output gradient (rows split {m * k} -> {m})",
               backward * collective(k) * unscattered, (k, 1), backward)
    else:
        yield ("all_reduce", f"{where}: partial sums (k split {k})",
               forward * ring(k) * slice_bytes(out, out.layout), (k, 1), forward)
    if x.needs_grad:
        # an input all-gathered first (sequence parallel) gets its gradient reduce-scattered
        # back (AllGather's gradient in MindSpore's grad_comm_ops.py), which sums the partial
        # input gradients over that group too, so only the rest of the n split is all-reduced
        n_summed = n // math.gcd(n, gather_factor(x.layout, call.strategy[0]))
        yield ("all_reduce", f"{where}: input gradient (n split {n})",
               backward * ring(n_summed) * slice_bytes(x, call.strategy[0]), (n_summed, 1),
               backward)
    if w.needs_grad and w.param is None:
        yield ("all_reduce", f"{where}: operand gradient (m split {m})",
               backward * ring(m) * slice_bytes(w, call.strategy[1]), (m, 1), backward)


MATMUL = Operator(_matmul_shape, layout=_matmul_layout, device_matrix=_matmul_device_matrix,
                  rule=_check_matmul, communication=_matmul_communication, saved="cross")


# --- lookups, one-hot, cross-entropy ------------------------------------------------------------

def _gather_shape(call, args):
    param, indices, axis = _shape(args[0]), _shape(args[1]), int(args[2])
    axis = axis % len(param)
    return [(param[:axis] + indices + param[axis + 1:], _dtype(args[0]))], False


def _gather_layout(call, strategy, position, rank):
    axis = int(call.args[2]) % len(strategy[0])
    return strategy[0][:axis] + strategy[1] + strategy[0][axis + 1:]


def _check_gather(call, shapes, violation, devices_per_stage):
    param, indices = call.strategy[0], call.strategy[1]
    axis = int(call.args[2]) % len(param)
    if param[axis] == 1:
        return
    # MindSpore's "batch and axis" mode: table (p, 1) on axis 0, ids split on dimension 0
    # only, p x i the whole stage (gather_info.cc)
    batch_and_axis = (axis == 0 and len(param) == 2 and param[1] == 1 and indices[0] > 1
                      and all(split == 1 for split in indices[1:])
                      and param[0] * indices[0] == devices_per_stage)
    if any(split != 1 for split in indices) and not batch_and_axis:
        dim = next(d for d, split in enumerate(indices) if split != 1)
        violation("Gather", f"the table is split {param[axis]} along the gathered axis "
                            f"(vocabulary split) so the indices must be whole, or split on "
                            f"dimension 0 only with table split x index split = the stage's "
                            f"{devices_per_stage} devices, but their strategy is {indices}",
                  1, dim)
    if len(param) > 2:
        violation("Gather", f"a vocabulary split needs a 1-D or 2-D table, got rank "
                            f"{len(param)}", 0)


def _gather_communication(call, where, forward, backward):
    """A table split along the gathered axis (the vocabulary) sums the partial lookups."""
    out = call.outputs[0]
    axis = int(call.args[2]) % len(call.strategy[0])
    p = call.strategy[0][axis]
    yield ("all_reduce", f"{where}: vocabulary-split lookup (split {p})",
           forward * ring(p) * slice_bytes(out, out.layout), (p, 1), forward)


def _one_hot_shape(call, args):
    axis = call.attr("axis", -1)
    shape = list(_shape(args[0]))
    shape.insert(len(shape) if axis == -1 else axis, int(args[1]))
    return [(tuple(shape), _dtype(args[2]))], False


def _check_one_hot(call, shapes, violation, devices_per_stage):
    out = call.strategy[0]
    if len(shapes[0]) > 2 and any(split != 1 for split in out[1:]):
        violation("OneHot", f"with indices of rank > 1 only dimension 0 may be split "
                            f"(strategy {out})", 0)


def _softmax_cross_entropy_shape(call, args):
    logits = _shape(args[0])
    return [(logits[:1], _dtype(args[0])), (logits, _dtype(args[0]))], True


def _softmax_cross_entropy_layout(call, strategy, position, rank):
    return strategy[0][:1] if position == 0 else strategy[0]


def _check_cross_entropy(call, shapes, violation, devices_per_stage):
    logits, labels = call.strategy[0], call.strategy[1]
    if logits != labels:
        violation("loss", f"logits strategy {logits} and labels strategy {labels} must be "
                          f"identical", 1)
    if logits[-1] != 1:
        violation("loss", f"the class dimension is split {logits[-1]} (strategy {logits}); "
                          f"it must be whole", 0, len(logits) - 1)


# --- normalisation, softmax, reductions, dropout, flash attention -------------------------------

def _check_softmax(call, shapes, violation, devices_per_stage):
    axes = call.attr("axis", -1)
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for axis in axes:
        dim = axis % len(shapes[0])
        if call.strategy[0][dim] != 1:
            violation("Softmax", f"the softmax axis is split {call.strategy[0][dim]} (strategy "
                                 f"{call.strategy[0]}, shape {shapes[0]}); it must be whole",
                      0, dim)


def _layer_norm_shape(call, args):
    shape = _shape(args[0])
    axis = call.attr("begin_norm_axis", -1) % len(shape)
    stats = shape[:axis] + (1,) * (len(shape) - axis)
    return [(shape, _dtype(args[0])), (stats, ms.float32), (stats, ms.float32)], True


def _layer_norm_layout(call, strategy, position, rank):
    axis = call.attr("begin_norm_axis", -1) % len(strategy[0])
    return strategy[0] if position == 0 else strategy[0][:axis] + (1,) * (rank - axis)


def _check_layer_norm(call, shapes, violation, devices_per_stage):
    rank = len(shapes[0])
    norm_axis = call.attr("begin_norm_axis", -1) % rank
    params_axis = call.attr("begin_params_axis", -1) % rank
    x = call.strategy[0]
    for dim in range(norm_axis, rank):
        if x[dim] != 1:
            violation("LayerNorm", f"normalised axis split {x[dim]} (strategy {x}, shape "
                                   f"{shapes[0]}); normalised axes must be whole", 0, dim)
    for index in (1, 2):
        if index < len(call.strategy) and call.strategy[index] != x[params_axis:]:
            violation("LayerNorm", f"gamma/beta strategy {call.strategy[index]} must equal the "
                                   f"input's strategy from begin_params_axis, {x[params_axis:]}",
                      index)


def _reduce_shape(call, args):
    shape = _shape(args[0])
    axes = _reduced_axes(args, len(shape))
    if call.attr("keep_dims", False):
        out = tuple(1 if d in axes else s for d, s in enumerate(shape))
    else:
        out = tuple(s for d, s in enumerate(shape) if d not in axes)
    return [(out, _dtype(args[0]))], False


def _reduce_layout(call, strategy, position, rank):
    axes = _reduced_axes(call.args, len(strategy[0]))
    if call.attr("keep_dims", False):
        return tuple(1 if d in axes else s for d, s in enumerate(strategy[0]))
    return tuple(s for d, s in enumerate(strategy[0]) if d not in axes)


def _reduce_communication(call, where, forward, backward):
    """A reduction over a split dimension sums the devices' partial results."""
    out = call.outputs[0]
    reduced = math.prod(call.strategy[0]) // max(1, math.prod(out.layout or ()))
    yield ("all_reduce", f"{where}: reduction over a split dimension",
           forward * ring(reduced) * slice_bytes(out, out.layout), (reduced, 1), forward)


def _reduction(saved) -> Operator:
    return Operator(_reduce_shape, layout=_reduce_layout, communication=_reduce_communication,
                    saved=saved)


def _dropout_shape(call, args):
    return [(_shape(args[0]), _dtype(args[0])), (_shape(args[0]), _dtype(args[0]))], True


def _flash_attention_shape(call, args):
    """FlashAttentionScore (BNSD): softmax max and sum (B, N, S1, 8) float32, an unused
    output, and the attention output shaped like the query."""
    query = _shape(args[0])
    stats = (query[:3] + (8,), ms.float32)
    return [stats, stats, ((), _dtype(args[0])), (query, _dtype(args[0]))], True


def _check_flash_attention(call, shapes, violation, devices_per_stage):
    """BNSD q, k, v split alike on batch and heads only; the mask split like the batch."""
    query = call.strategy[0]
    for index in (1, 2):
        if call.strategy[index] != query:
            violation("FlashAttentionScore", f"query, key and value must be split alike, got "
                                             f"{query} and {call.strategy[index]}", index)
    for dim in (2, 3):
        if query[dim] != 1:
            violation("FlashAttentionScore", f"the sequence and head-size axes of BNSD inputs "
                                             f"must be whole (strategy {query})", 0, dim)
    if shapes[0][3] % 16 or shapes[0][3] > 512:
        violation("FlashAttentionScore", f"the head size must be a multiple of 16 up to 512, "
                                         f"got {shapes[0][3]}", 0, 3)
    if len(call.strategy) > 3:
        mask = call.strategy[-1]
        wanted = (1, 1) if len(mask) == 2 else (query[0], 1, 1, 1)
        if mask != wanted:
            violation("FlashAttentionScore", f"the attention mask must be split {wanted} "
                                             f"(got {mask})", len(call.strategy) - 1)


# --- the registry ---------------------------------------------------------------------------------

OPERATORS = {
    # views and constants: no data moved
    "Reshape": Operator(_reshape_shape, saved="nothing", view=True, moves_data=False),
    "ExpandDims": Operator(_expand_dims_shape, saved="nothing", view=True, moves_data=False),
    "Squeeze": Operator(_squeeze_shape, saved="nothing", view=True, moves_data=False),
    "Identity": Operator(_same_shape, saved="nothing", moves_data=False),
    "Ones": Operator(_fill_shape, saved="nothing", moves_data=False, gradient=False),
    "Zeros": Operator(_fill_shape, saved="nothing", moves_data=False, gradient=False),
    "ZerosLike": Operator(_same_shape, saved="nothing", moves_data=False, gradient=False),
    "OnesLike": Operator(_same_shape, saved="nothing", moves_data=False, gradient=False),
    "Shape": Operator(moves_data=False),
    # layout changes and copies
    "Cast": Operator(_cast_shape, saved="nothing"),
    "Transpose": Operator(_transpose_shape, layout=_transpose_layout, saved="nothing"),
    "StridedSlice": Operator(_strided_slice_shape, rule=_check_strided_slice, saved="nothing"),
    "Tile": Operator(_tile_shape, saved="nothing"),
    "Concat": Operator(_concat_shape, rule=_check_concat, saved="nothing"),
    "Split": Operator(saved="nothing"),
    "StopGradient": Operator(gradient=False),
    # products
    "MatMul": MATMUL,
    "BatchMatMul": MATMUL,
    # lookups, one-hot, the loss
    "Gather": Operator(_gather_shape, layout=_gather_layout,
                       device_matrix=lambda call: call.strategy[1] + call.strategy[0],
                       rule=_check_gather, communication=_gather_communication,
                       saved="indices"),
    "OneHot": Operator(_one_hot_shape, layout=lambda call, strategy, position, rank: strategy[0],
                       device_matrix=lambda call: call.strategy[0], rule=_check_one_hot,
                       saved="nothing", gradient=False),
    "SoftmaxCrossEntropyWithLogits": Operator(
        _softmax_cross_entropy_shape, layout=_softmax_cross_entropy_layout,
        rule=_check_cross_entropy, saved="out1", auxiliary_outputs=(1,)),
    # normalisation, softmax, reductions, dropout, attention
    "LayerNorm": Operator(_layer_norm_shape, layout=_layer_norm_layout, rule=_check_layer_norm,
                          saved="in0+stats", auxiliary_outputs=(1, 2)),
    "Softmax": Operator(_same_shape, rule=_check_softmax, saved="out0"),
    "LogSoftmax": Operator(_same_shape, rule=_check_softmax, saved="out0"),
    "ReduceSum": _reduction("nothing"),
    "ReduceMean": _reduction("nothing"),
    "ReduceMax": _reduction("in0+out0"),
    "ReduceMin": _reduction("in0+out0"),
    "Dropout": Operator(_dropout_shape, saved="mask", auxiliary_outputs=(1,)),
    "FlashAttentionScore": Operator(_flash_attention_shape, rule=_check_flash_attention,
                                    saved="flash"),
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
    # unary element-wise operators
    "Neg": Operator(_same_shape, saved="nothing"),
    "LogicalNot": Operator(_same_shape, gradient=False),
    **{name: Operator(_same_shape, saved="out0")
       for name in ("Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt", "ReLU", "Reciprocal")},
    **{name: Operator(_same_shape, saved="in0+out0") for name in ("GeLU", "FastGeLU")},
    **{name: Operator(_same_shape, saved="in0")
       for name in ("Erf", "Square", "Log", "SiLU", "Abs")},
}

UNKNOWN = Operator()   # an operator without an entry: computed when recorded, no rules


def operator(name: str) -> Operator:
    """The entry of operator `name` (UNKNOWN when it has none)."""
    return OPERATORS.get(name, UNKNOWN)


def output_layout(call: "OpCall", position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` as the operator leaves it, or None
    (unknown). Operators with a strategy follow their entry's `layout`; Cast and Reshape
    pass their input's layout on; other operators without a strategy are unknown."""
    layout = _output_layout(call, position, shape)
    if layout is None or len(layout) != len(shape):
        return None
    return tuple(layout)


def _output_layout(call, position, shape):
    strategy, rank, tensors = call.strategy, len(shape), call.tensors
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
    rule = operator(call.name).layout
    try:
        if rule is not None:
            return rule(call, strategy, position, rank)
        return strategy[0] if len(strategy[0]) == rank else None
    except (IndexError, TypeError):
        return None


def device_matrix(call: "OpCall") -> tuple:
    """The operator's device matrix as MindSpore forms it (rule G4; the entry's
    `device_matrix`, else the inputs' strategies right-aligned)."""
    rule = operator(call.name).device_matrix
    if rule is not None:
        return rule(call)
    return right_aligned_max(call.strategy, max(len(part) for part in call.strategy))
