"""Compute of a layout, from a recorded forward pass (`layout.trace.record`).

Compute per step
----------------
FLOPs one device of each stage executes per step in MatMul, BatchMatMul and
FlashAttentionScore (`attention` of them in attention's 4-D BatchMatMuls and
FlashAttentionScore, the others at the MatMul efficiency): a call of output shape (..., m,
n) and contracted size k costs 2 m n k x batch / prod(device matrix) per device
(replicated work counts on every replica). The backward pass costs it again for each
operand that needs a gradient (input and weight: 2x), a recomputed cell's forward pass
runs twice, and all of it happens micro_batch_num x grad_accumulation times a step.
FlashAttentionScore counts its two products, 4 b a s_q s_k d / (dp mp) (about half of it
under a causal mask, whose blocks above the diagonal the kernel skips), twice that
backward, and half of it again as recomputation (its backward pass recomputes the scores).
The model's FLOPs (for MFU) are the products' whole work, forward and backward, without
recomputation, of the model's work only: a mixture of experts' dispatch and combine
products move tokens (none), and its experts' products count the share of their E C slots
a group's k N routed choices fill, k N / (E C) (`nn.moe` marks the primitives). Every
other operator (but views) counts the bytes of its input and output slices, once
forward, twice backward when it has a gradient and once more when recomputed, and one
launch per pass: the time model (`timing`) runs those at the memory bandwidth and a launch
cost.
"""

import math
from dataclasses import dataclass
from typing import List

from model_zoo.cost.memory import input_split, stage_count
from model_zoo.layout.operator_entry import slice_bytes
from model_zoo.layout.operators import device_matrix, operator
from model_zoo.parallel.config import ParallelConfig

# FlashAttentionScore's causal masks (2: the compressed lower-left triangle, 3: lower right):
# the kernel computes only the blocks below the diagonal
CAUSAL_SPARSE_MODES = (2, 3)


@dataclass
class StageCompute:
    """What one device of a stage executes per step: MatMul FLOPs (forward, backward,
    recompute; `attention` of them in BatchMatMul and FlashAttentionScore), the bytes the
    other operators read and write, and the operator launches. `model` is the stage's
    FLOPs of the whole model (all devices, no recomputation), for MFU."""

    stage: int
    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    attention: float = 0.0
    memory_bytes: float = 0.0
    launches: float = 0.0
    model: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute

    def to_dict(self):
        return {"stage": self.stage, "forward": self.forward, "backward": self.backward,
                "recompute": self.recompute, "total": self.total,
                "attention": self.attention, "memory_bound_bytes": self.memory_bytes,
                "launches": self.launches, "model_flops": self.model}


def _moved_bytes(call, params) -> float:
    """Bytes one pass of an operator reads and writes on one device: the slices of its
    inputs and outputs. A parameter, or the compute-dtype copy a Cast makes of it, where no
    strategy here says its layout is the slice its consumers' strategies give it."""
    def moved(info, split):
        param = params.get(info.param) if split is None and info.param else None
        whole = slice_bytes(info, split)
        return whole * param.slice_numel / max(param.numel, 1) if param else whole

    return (sum(moved(info, input_split(call, index, info))
                for index, info in enumerate(call.tensors))
            + sum(moved(out, out.layout) for out in call.outputs))


def matmul_flops(call, whole: bool = False) -> float:
    """FLOPs of one MatMul/BatchMatMul call on one device (module docstring), or of the
    whole product (`whole`)."""
    x, out = call.tensors[0], call.outputs[0]
    contracted = x.shape[-2] if call.attr("transpose_a", False) else x.shape[-1]
    parts = 1
    if call.strategy and len(call.strategy) == 2 and not whole:  # (a malformed one is
        parts = math.prod(device_matrix(call))                     # reported by the check)
    return 2.0 * out.numel * contracted / parts


def estimate_compute(rec, parallel: ParallelConfig,
                     accumulation: int = 1) -> List[StageCompute]:
    """FLOPs, memory-bound bytes and launches per device of every stage per step (module
    docstring). An operator other than a product moves its inputs and outputs once
    forward, twice backward (reading the output gradient and what it saved, writing the
    input gradients) when it has a gradient, and once more when recomputed."""
    stages = [StageCompute(k) for k in range(stage_count(rec, parallel))]
    micro_steps = parallel.micro_batch_num * accumulation
    routed = {}   # an MoE layer's cell -> the share of its experts' slots routed tokens fill
    for call in rec.calls:
        compute = stages[call.stage]
        differentiable = bool(call.outputs) and call.outputs[0].needs_grad
        passes = 1 + (2 if differentiable else 0) + (1 if call.recompute_root else 0)
        moves_data = operator(call.name).moves_data
        if moves_data:
            compute.launches += micro_steps * passes
        if call.name == "FlashAttentionScore":
            # its two products (scores, context); the backward pass computes the four
            # gradient products and recomputes the scores
            query, key = call.tensors[0].shape, call.tensors[1].shape   # BNSD
            whole = micro_steps * 2 * 2 * math.prod(query) * key[2]
            compute.model += 3 * whole   # MFU counts the whole products, with or without
            if call.attr("sparse_mode", 0) in CAUSAL_SPARSE_MODES:   # flash attention
                # a causal mask skips the blocks above the diagonal: about (s + 1) / 2s
                whole *= (query[2] + 1) / (2 * query[2])
            flops = whole / math.prod(call.strategy[0] if call.strategy else (1,))
            compute.forward += flops
            compute.backward += 2 * flops
            compute.recompute += flops / 2
            compute.attention += 3.5 * flops
            continue
        if call.name not in ("MatMul", "BatchMatMul") or not call.outputs:
            if moves_data:
                compute.memory_bytes += micro_steps * passes * _moved_bytes(call, rec.params)
            continue
        flops = micro_steps * matmul_flops(call)
        gradients = sum(1 for info in call.tensors[:2] if info.needs_grad)
        done = flops * (1 + gradients + (1 if call.recompute_root is not None else 0))
        compute.forward += flops
        compute.backward += flops * gradients
        if call.recompute_root is not None:
            compute.recompute += flops
        work = call.attr("model_work", None)
        if call.name == "BatchMatMul" and len(call.outputs[0].shape) == 4 and work is None:
            compute.attention += done   # attention's (batch, heads, ...) products; the
                                        # experts' (dp/ep, E, slots, ...) ones are MatMul-like
        if work == "moves tokens" and call.attr("routed_choices", None):
            _, count, slots = call.tensors[0].shape     # dispatch (G, N, E C)
            routed[call.cell] = min(1.0, call.attr("routed_choices") * count / slots)
        share = {"moves tokens": 0.0, "expert slots": routed.get(call.cell, 1.0)}.get(work, 1.0)
        compute.model += share * (1 + gradients) * micro_steps * matmul_flops(call, whole=True)
    return stages
