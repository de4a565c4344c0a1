"""The plan's entries for operators that contract, reduce, normalise or look up along a
dimension: MatMul and BatchMatMul, Gather, OneHot, the loss, LayerNorm, Softmax, the
reductions and FlashAttentionScore (`operator_entry.Operator` says what an entry holds). A
new operator of this kind is its functions and a line in `ENTRIES`."""

import math
from typing import TYPE_CHECKING

import mindspore as ms

from model_zoo.layout.elementwise import same_shape
from model_zoo.layout.operator_entry import (Operator, broadcast_shapes, collective, dtype_of,
                                             gather_factor, reduced_axes, right_aligned_max,
                                             ring, shape_of, slice_bytes)

if TYPE_CHECKING:
    from model_zoo.layout.recording import OpCall


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
    x, w = shape_of(args[0]), shape_of(args[1])
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m = x[-1] if ta else x[-2]
    k_x = x[-2] if ta else x[-1]
    k_w = w[-1] if tb else w[-2]
    n = w[-2] if tb else w[-1]
    if k_x != k_w:
        raise ValueError(f"contracted sizes differ: {k_x} and {k_w}")
    return [(broadcast_shapes(x[:-2], w[:-2]) + (m, n), dtype_of(args[0]))], False


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
    param, indices, axis = shape_of(args[0]), shape_of(args[1]), int(args[2])
    axis = axis % len(param)
    return [(param[:axis] + indices + param[axis + 1:], dtype_of(args[0]))], False


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
    shape = list(shape_of(args[0]))
    shape.insert(len(shape) if axis == -1 else axis, int(args[1]))
    return [(tuple(shape), dtype_of(args[2]))], False


def _check_one_hot(call, shapes, violation, devices_per_stage):
    out = call.strategy[0]
    if len(shapes[0]) > 2 and any(split != 1 for split in out[1:]):
        violation("OneHot", f"with indices of rank > 1 only dimension 0 may be split "
                            f"(strategy {out})", 0)


def _softmax_cross_entropy_shape(call, args):
    logits = shape_of(args[0])
    return [(logits[:1], dtype_of(args[0])), (logits, dtype_of(args[0]))], True


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


# --- normalisation, softmax, reductions, flash attention -------------------------------

def _check_softmax(call, shapes, violation, devices_per_stage):
    axes = call.attr("axis", -1)
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for axis in axes:
        dim = axis % len(shapes[0])
        if call.strategy[0][dim] != 1:
            violation("Softmax", f"the softmax axis is split {call.strategy[0][dim]} (strategy "
                                 f"{call.strategy[0]}, shape {shapes[0]}); it must be whole",
                      0, dim)


def _check_whole_axis(call, shapes, violation, devices_per_stage):
    """The axis an ArgMaxWithValue or CumSum runs along must be whole."""
    axis = call.attr("axis", -1) if call.name == "ArgMaxWithValue" else call.args[1]
    dim = axis % len(shapes[0])
    if call.strategy[0][dim] != 1:
        violation(call.name, f"axis {axis} is split {call.strategy[0][dim]} (strategy "
                             f"{call.strategy[0]}, shape {shapes[0]}); it must be whole", 0, dim)


def _arg_max_shape(call, args):
    """ArgMaxWithValue: the index (int64) and the value, the axis taken away."""
    shape = shape_of(args[0])
    axis = call.attr("axis", -1) % len(shape)
    out = (tuple(1 if d == axis else s for d, s in enumerate(shape))
           if call.attr("keep_dims", False) else shape[:axis] + shape[axis + 1:])
    return [(out, ms.int64), (out, dtype_of(args[0]))], True


def _arg_max_layout(call, strategy, position, rank):
    split = strategy[0]
    axis = call.attr("axis", -1) % len(split)
    return (tuple(1 if d == axis else s for d, s in enumerate(split))
            if call.attr("keep_dims", False) else split[:axis] + split[axis + 1:])


def _layer_norm_shape(call, args):
    shape = shape_of(args[0])
    axis = call.attr("begin_norm_axis", -1) % len(shape)
    stats = shape[:axis] + (1,) * (len(shape) - axis)
    return [(shape, dtype_of(args[0])), (stats, ms.float32), (stats, ms.float32)], True


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
    shape = shape_of(args[0])
    axes = reduced_axes(args, len(shape))
    if call.attr("keep_dims", False):
        out = tuple(1 if d in axes else s for d, s in enumerate(shape))
    else:
        out = tuple(s for d, s in enumerate(shape) if d not in axes)
    return [(out, dtype_of(args[0]))], False


def _reduce_layout(call, strategy, position, rank):
    axes = reduced_axes(call.args, len(strategy[0]))
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




def _flash_attention_shape(call, args):
    """FlashAttentionScore (BNSD): softmax max and sum (B, N, S1, 8) float32, an unused
    output, and the attention output shaped like the query."""
    query = shape_of(args[0])
    stats = (query[:3] + (8,), ms.float32)
    return [stats, stats, ((), dtype_of(args[0])), (query, dtype_of(args[0]))], True


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


ENTRIES = {
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
    # normalisation, softmax, reductions, attention
    "LayerNorm": Operator(_layer_norm_shape, layout=_layer_norm_layout, rule=_check_layer_norm,
                          saved="in0+stats", auxiliary_outputs=(1, 2)),
    "Softmax": Operator(same_shape, rule=_check_softmax, saved="out0"),
    "LogSoftmax": Operator(same_shape, rule=_check_softmax, saved="out0"),
    "ReduceSum": _reduction("nothing"),
    "ArgMaxWithValue": Operator(_arg_max_shape, layout=_arg_max_layout, rule=_check_whole_axis,
                                saved="out0"),
    "CumSum": Operator(same_shape, rule=_check_whole_axis, saved="nothing"),
    "ReduceMean": _reduction("nothing"),
    "ReduceMax": _reduction("in0+out0"),
    "ReduceMin": _reduction("in0+out0"),
    "ReduceProd": _reduction("in0+out0"),
    "FlashAttentionScore": Operator(_flash_attention_shape, rule=_check_flash_attention,
                                    saved="flash"),
}
