"""MindSpore's strategy rules, checked on every recorded call and on the layout itself.

Tags (G1-G11 and per-operator names) are those of docs/mindspore-parallel-rules.md, which
cites the MindSpore sources each rule comes from.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig
from model_zoo.plan.layouts import ELEMENTWISE, device_matrix, matmul_dims

if TYPE_CHECKING:
    from model_zoo.plan.trace import OpCall, Recording

# --- the rules --------------------------------------------------------------------------------

@dataclass
class Violation:
    """A broken rule: where (cell path, operator, input, dimension) and why."""

    rule: str
    message: str
    path: str = ""
    op: str = ""
    input: Optional[int] = None
    dim: Optional[int] = None

    def __str__(self):
        where = f"{self.path} ({self.op})" if self.path else "layout"
        if self.input is not None:
            where += f" input {self.input}"
        if self.dim is not None:
            where += f" dimension {self.dim}"
        return f"{where}: {self.message} [{self.rule}]"

    def to_dict(self):
        return {"rule": self.rule, "path": self.path, "op": self.op, "input": self.input,
                "dim": self.dim, "message": self.message, "text": str(self)}


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def _input_shapes(call: "OpCall") -> List[tuple]:
    shapes = [t.shape for t in call.tensors]
    if call.name == "OneHot" and shapes:
        axis = call.attr("axis", -1)
        shape = list(shapes[0])
        shape.insert(len(shape) if axis == -1 else axis, int(call.args[1]))
        shapes[0] = tuple(shape)
    return shapes


def check_call(call: "OpCall", devices_per_stage: int, device_num: int) -> List[Violation]:
    """Every rule one strategy-bearing call must satisfy."""
    found = []
    strategy, name = call.strategy, call.name

    def violation(rule, message, index=None, dim=None):
        found.append(Violation(rule, message, call.path, name, index, dim))

    shapes = _input_shapes(call)
    described = f"strategy {strategy} for input shapes {tuple(shapes)}"
    if len(strategy) != len(shapes):
        violation("G1", f"{len(strategy)} strategy tuples for {len(shapes)} tensor inputs "
                        f"({described})")
        return found
    for index, (part, shape) in enumerate(zip(strategy, shapes)):
        if len(part) != len(shape):
            violation("G1", f"strategy {part} has {len(part)} values but the input {shape} "
                            f"has rank {len(shape)}", index)
            continue
        for dim, (split, size) in enumerate(zip(part, shape)):
            if split < 1 or size % split:
                violation("G2", f"split {split} does not divide size {size} of input shape "
                                f"{shape} (strategy {part})", index, dim)
            elif is_power_of_two(device_num) and not is_power_of_two(split):
                violation("G3", f"split {split} is not a power of 2 (device number "
                                f"{device_num})", index, dim)
    if found:
        return found
    matrix = device_matrix(call)
    product = math.prod(matrix)
    if devices_per_stage % product:
        violation("G4", f"device matrix {matrix} (product {product}) does not divide the "
                        f"{devices_per_stage} devices of a pipeline stage ({described})")
    check = OPERATOR_RULES.get(name)
    if check is None and name in ELEMENTWISE:
        check = _check_broadcast
    if check is not None:
        check(call, shapes, violation, devices_per_stage)
    if call.out_strategy is not None:
        _check_output_strategy(call, shapes, violation)
    return found


def _check_output_strategy(call, shapes, violation):
    """Rule G6: only a 2-D MatMul takes an output strategy here (MindSpore accepts one for
    a few other operators, e.g. an axis-0 Gather, which no layer uses and the plan does not
    model). For x (a, b) and
    a weight split c ways on n, it is (a, c) (all-reduce of the partial sums) or (a*b, c)
    (reduce-scatter over the b group, the rows split a*b ways) [matmul_info.cc
    CheckOutputStrategy]."""
    out = call.out_strategy
    if call.name != "MatMul":
        violation("G6", f"output strategy {out}: the plan models output strategies only for "
                        f"a 2-D MatMul (MindSpore rejects them for most operators)")
        return
    if any(len(shape) != 2 for shape in shapes):
        violation("G6", f"output strategy {out} needs 2-D MatMul inputs, got shapes "
                        f"{tuple(shapes)}")
        return
    if len(out) != 1 or len(out[0]) != 2:
        violation("G6", f"output strategy {out} must be one tuple of 2 values")
        return
    _, m, k, _, n = matmul_dims(call)
    rows, columns = out[0]
    out_shape = call.outputs[0].shape if call.outputs else None
    if columns != n:
        violation("G6", f"output strategy {out}: the columns must be split {n} like the "
                        f"weight's output features (strategy {call.strategy})", dim=1)
    if rows not in (m, m * k):
        violation("G6", f"output strategy {out}: the rows must be split {m} (all-reduce) or "
                        f"{m * k} (reduce-scatter) for input strategy {call.strategy}", dim=0)
    elif out_shape is not None and out_shape[0] % rows:
        violation("G6", f"output strategy {out}: split {rows} does not divide the output's "
                        f"{out_shape[0]} rows", dim=0)


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


def _check_softmax(call, shapes, violation, devices_per_stage):
    axes = call.attr("axis", -1)
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for axis in axes:
        dim = axis % len(shapes[0])
        if call.strategy[0][dim] != 1:
            violation("Softmax", f"the softmax axis is split {call.strategy[0][dim]} (strategy "
                                 f"{call.strategy[0]}, shape {shapes[0]}); it must be whole",
                      0, dim)


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


def _check_one_hot(call, shapes, violation, devices_per_stage):
    out = call.strategy[0]
    if len(shapes[0]) > 2 and any(split != 1 for split in out[1:]):
        violation("OneHot", f"with indices of rank > 1 only dimension 0 may be split "
                            f"(strategy {out})", 0)


def _check_cross_entropy(call, shapes, violation, devices_per_stage):
    logits, labels = call.strategy[0], call.strategy[1]
    if logits != labels:
        violation("loss", f"logits strategy {logits} and labels strategy {labels} must be "
                          f"identical", 1)
    if logits[-1] != 1:
        violation("loss", f"the class dimension is split {logits[-1]} (strategy {logits}); "
                          f"it must be whole", 0, len(logits) - 1)


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


def _check_concat(call, shapes, violation, devices_per_stage):
    # the axis is an argument of ops.concat, an attribute of ops.Concat(axis=...)
    axis = int(call.args[1]) if len(call.args) > 1 else int(call.attr("axis", 0))
    axis %= len(shapes[0])
    first = call.strategy[0]
    for index, part in enumerate(call.strategy):
        if part != first:
            violation("Concat", f"every input needs the same strategy ({first} vs {part})", index)
    if first[axis] != 1:
        violation("Concat", "the concatenated axis must not be split", 0, axis)


OPERATOR_RULES = {
    "MatMul": _check_matmul, "BatchMatMul": _check_matmul, "Softmax": _check_softmax,
    "LogSoftmax": _check_softmax, "LayerNorm": _check_layer_norm, "Gather": _check_gather,
    "OneHot": _check_one_hot, "SoftmaxCrossEntropyWithLogits": _check_cross_entropy,
    "StridedSlice": _check_strided_slice, "Concat": _check_concat,
    "FlashAttentionScore": _check_flash_attention,
}


def check_recording(rec: "Recording", parallel: ParallelConfig, device_num: int) -> List[Violation]:
    """Every strategy-bearing call, parameter layouts and the order of pipeline stages."""
    found, seen = [], set()
    per_stage = parallel.devices_per_stage
    for call in rec.strategy_calls():
        key = (id(call.prim), tuple(t.shape for t in call.tensors))
        if key in seen:
            continue
        seen.add(key)
        found.extend(check_call(call, per_stage, device_num))
    for param in rec.params.values():
        splits = {split for _, _, split in param.consumers}
        if len(splits) > 1:
            (path_a, _, a), (path_b, index, b) = param.consumers[0], next(
                c for c in param.consumers if c[2] != param.consumers[0][2])
            found.append(Violation(
                "parameter", f"parameter {param.name} is split {a} by {path_a} but {b} here; "
                             f"every user of a parameter must split it alike",
                path_b, "", index))
    last = 0
    for call in rec.calls:
        if not call.staged:
            continue
        if call.stage < last:
            found.append(Violation("pipeline", f"runs on stage {call.stage} after an operator "
                                               f"of stage {last}; stages must not decrease in "
                                               f"execution order", call.path, call.name))
            break
        last = max(last, call.stage)
    return found


def check_layout(parallel: ParallelConfig, device_num: int, blocks: int,
                 global_batch_size: int, accumulation: int,
                 seq_length: int) -> List[Violation]:
    """The layout's own rules: device number (G10), product, stages, micro batches, batch."""
    found = []

    def violation(rule, message):
        found.append(Violation(rule, message))

    for key in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num"):
        if getattr(parallel, key) < 1:
            violation("layout", f"parallel.{key} must be >= 1, got {getattr(parallel, key)}")
    if found:
        return found
    if not (device_num in (1, 2, 4) or device_num % 8 == 0) or device_num > 4096:
        violation("G10", f"device number {device_num} must be 1, 2, 4 or a multiple of 8 "
                         f"(at most 4096)")
    product = parallel.device_num
    if product != device_num:
        violation("layout", f"data_parallel {parallel.dp} x model_parallel {parallel.mp} x "
                            f"pipeline_stage {parallel.pipeline_stage} = {product} differs from "
                            f"the device number {device_num}")
    try:
        parallel.recomputed_blocks(blocks)   # checks stage_blocks too
    except ConfigError as err:
        violation("pipeline", str(err))
    if parallel.pipeline_stage > 1 and parallel.micro_batch_num < parallel.pipeline_stage:
        violation("pipeline", f"parallel.micro_batch_num={parallel.micro_batch_num} must be at "
                              f"least parallel.pipeline_stage={parallel.pipeline_stage}: each "
                              f"stage needs a micro batch in flight")
    try:
        parallel.check_batch(global_batch_size, accumulation)
    except ConfigError as err:
        violation("batch", str(err))
    try:
        parallel.check_sequence_parallel()
        parallel.check_sequence_split(parallel.micro_batch_size(global_batch_size, accumulation),
                                      seq_length)
    except ConfigError as err:
        violation("layout", str(err))
    return found
