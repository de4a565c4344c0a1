"""MindSpore's strategy rules, checked on every recorded call and on the layout itself.

The rules every strategy obeys (G1-G4, G6) are here; each operator's own rule is in its
entry (`layout.operators.OPERATORS`).

Tags (G1-G11 and per-operator names) are those of docs/mindspore-parallel-rules.md, which
cites the MindSpore sources each rule comes from.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig
from model_zoo.layout.contracting import matmul_dims
from model_zoo.layout.operators import device_matrix, operator

if TYPE_CHECKING:
    from model_zoo.layout.recording import OpCall, Recording

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
    check = operator(name).rule
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
    last, chunk = 0, 0
    for call in rec.calls:
        if not call.staged:
            continue
        if call.stage < last and call.stage == 0 and chunk + 1 < parallel.pipeline_interleave:
            chunk, last = chunk + 1, 0   # the next interleaved chunk starts on stage 0
        if call.stage < last:
            wrap = (" (but back to stage 0 once a parallel.pipeline_interleave chunk)"
                    if parallel.pipeline_interleave > 1 else "")
            found.append(Violation("pipeline", f"runs on stage {call.stage} after an operator "
                                               f"of stage {last}; stages must not decrease in "
                                               f"execution order{wrap}", call.path, call.name))
            break
        last = max(last, call.stage)
    return found


def check_parallel_section(parallel: ParallelConfig, device_num: int, blocks: int,
                           global_batch_size: int, accumulation: int,
                           seq_length: int) -> List[Violation]:
    """The rules the parallel section itself breaks: device number (G10), product, stages,
    micro batches, batch, sequence split (the operators' strategies: `check_recording`)."""
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
        parallel.check_pipeline_schedule()
        parallel.block_chunks(blocks)        # and the interleaved chunks
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
