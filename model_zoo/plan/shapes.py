"""Shape rules: the output (shape, dtype) of each operator, from its inputs, without computing.

Each rule takes the recorded call and the real arguments and returns
([(shape, dtype), ...], as_tuple). `tests/test_plan.py` checks them against MindSpore's
kernels on a tiny model.
"""

import math

import mindspore as ms
from mindspore import Tensor

# --- shape rules: output (shape, dtype) of each operator, without computing ------------------

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


def _first_tensor_dtype(args):
    for arg in args:
        if isinstance(arg, Tensor):
            return arg.dtype
    return _dtype(args[0])


def _same(call, args):
    return [(_shape(args[0]), _dtype(args[0]))], False


def _elementwise(call, args):
    tensors = [a for a in args if isinstance(a, (Tensor, int, float, bool))]
    return [(broadcast_shapes(*[_shape(a) for a in tensors]), _first_tensor_dtype(args))], False


def _compare(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:2]]), ms.bool_)], False


def _select(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:3]]), _dtype(args[1]))], False


def _cast(call, args):
    return [(_shape(args[0]), args[1])], False


def _reshape(call, args):
    shape, target = _shape(args[0]), list(args[1])
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = math.prod(shape) // known
    if math.prod(target) != math.prod(shape):
        raise ValueError(f"cannot reshape {shape} to {tuple(args[1])}")
    return [(tuple(target), _dtype(args[0]))], False


def _transpose(call, args):
    shape = _shape(args[0])
    return [(tuple(shape[p] for p in args[1]), _dtype(args[0]))], False


def _matmul_shape(call, x, w):
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m = x[-1] if ta else x[-2]
    k_x = x[-2] if ta else x[-1]
    k_w = w[-1] if tb else w[-2]
    n = w[-2] if tb else w[-1]
    if k_x != k_w:
        raise ValueError(f"contracted sizes differ: {k_x} and {k_w}")
    return broadcast_shapes(x[:-2], w[:-2]) + (m, n)


def _matmul(call, args):
    return [(_matmul_shape(call, _shape(args[0]), _shape(args[1])), _dtype(args[0]))], False


def _strided_slice(call, args):
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


def _gather(call, args):
    param, indices, axis = _shape(args[0]), _shape(args[1]), int(args[2])
    axis = axis % len(param)
    return [(param[:axis] + indices + param[axis + 1:], _dtype(args[0]))], False


def _one_hot(call, args):
    axis = call.attr("axis", -1)
    shape = list(_shape(args[0]))
    shape.insert(len(shape) if axis == -1 else axis, int(args[1]))
    return [(tuple(shape), _dtype(args[2]))], False


def _softmax_cross_entropy(call, args):
    logits = _shape(args[0])
    return [(logits[:1], _dtype(args[0])), (logits, _dtype(args[0]))], True


def _layer_norm(call, args):
    shape = _shape(args[0])
    axis = call.attr("begin_norm_axis", -1) % len(shape)
    stats = shape[:axis] + (1,) * (len(shape) - axis)
    return [(shape, _dtype(args[0])), (stats, ms.float32), (stats, ms.float32)], True


def _reduce(call, args):
    shape = _shape(args[0])
    axis = args[1] if len(args) > 1 else ()
    axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
    axes = {a % len(shape) for a in axis} if axis else set(range(len(shape)))
    if call.attr("keep_dims", False):
        out = tuple(1 if d in axes else s for d, s in enumerate(shape))
    else:
        out = tuple(s for d, s in enumerate(shape) if d not in axes)
    return [(out, _dtype(args[0]))], False


def _fill_like_shape(call, args):
    shape = args[0]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = args[1] if len(args) > 1 and args[1] is not None else ms.float32
    return [(shape, dtype)], False


def _dropout(call, args):
    return [(_shape(args[0]), _dtype(args[0])), (_shape(args[0]), _dtype(args[0]))], True


def _expand_dims(call, args):
    shape = list(_shape(args[0]))
    axis = int(args[1])
    shape.insert(axis % (len(shape) + 1), 1)
    return [(tuple(shape), _dtype(args[0]))], False


def _squeeze(call, args):
    shape = _shape(args[0])
    axis = call.attr("axis", ())
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = {a % len(shape) for a in axis} if axis else {d for d, s in enumerate(shape) if s == 1}
    return [(tuple(s for d, s in enumerate(shape) if d not in axes), _dtype(args[0]))], False


def _tile(call, args):
    shape, multiples = _shape(args[0]), tuple(args[1])
    shape = (1,) * (len(multiples) - len(shape)) + shape
    return [(tuple(s * m for s, m in zip(shape, multiples)), _dtype(args[0]))], False


def _concat(call, args):
    tensors = list(args[0])
    axis = int(args[1]) if len(args) > 1 else int(call.attr("axis", 0))
    shape = list(_shape(tensors[0]))
    axis %= len(shape)
    shape[axis] = sum(_shape(t)[axis] for t in tensors)
    return [(tuple(shape), _dtype(tensors[0]))], False


def _flash_attention(call, args):
    """FlashAttentionScore (BNSD): softmax max and sum (B, N, S1, 8) float32, an unused
    output, and the attention output shaped like the query."""
    query = _shape(args[0])
    stats = (query[:3] + (8,), ms.float32)
    return [stats, stats, ((), _dtype(args[0])), (query, _dtype(args[0]))], True


SHAPE_RULES = {
    "Cast": _cast, "Reshape": _reshape, "Transpose": _transpose, "MatMul": _matmul,
    "BatchMatMul": _matmul, "StridedSlice": _strided_slice, "Gather": _gather,
    "OneHot": _one_hot, "SoftmaxCrossEntropyWithLogits": _softmax_cross_entropy,
    "LayerNorm": _layer_norm, "ReduceSum": _reduce, "ReduceMean": _reduce,
    "ReduceMax": _reduce, "ReduceMin": _reduce, "Ones": _fill_like_shape,
    "Zeros": _fill_like_shape, "Dropout": _dropout, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "Tile": _tile, "Concat": _concat, "Select": _select,
    "FlashAttentionScore": _flash_attention,
}
for _name in ("Add", "Sub", "Mul", "Div", "RealDiv", "Maximum", "Minimum", "Pow", "BiasAdd",
              "FloorDiv", "AddExt", "SubExt", "Muls", "Divs"):
    SHAPE_RULES[_name] = _elementwise
for _name in ("Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
              "LogicalAnd", "LogicalOr"):
    SHAPE_RULES[_name] = _compare
for _name in ("GeLU", "FastGeLU", "ReLU", "Tanh", "Sigmoid", "Erf", "Exp", "Log", "Neg", "Sqrt",
              "Rsqrt", "Square", "Abs", "Softmax", "LogSoftmax", "ZerosLike", "OnesLike",
              "Identity", "LogicalNot", "Reciprocal", "SiLU"):
    SHAPE_RULES[_name] = _same

VIEWS = {"Reshape", "ExpandDims", "Squeeze"}

# outputs that only serve the operator's own backward pass (statistics, masks, gradients)
AUXILIARY_OUTPUTS = {"LayerNorm": (1, 2), "Dropout": (1,), "SoftmaxCrossEntropyWithLogits": (1,)}

NO_GRADIENT = {"OneHot", "Ones", "Zeros", "ZerosLike", "OnesLike", "Equal", "NotEqual", "Less",
               "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr",
               "LogicalNot", "StopGradient"}
