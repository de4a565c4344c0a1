"""Communication of a layout, from a recorded forward pass (`layout.trace.record`).

Communication per step
----------------------
Bytes one device sends, by kind, for one step of micro_batch_num x grad_accumulation micro
steps. A ring all-reduce of B bytes over n devices sends 2 (n - 1) / n B; an all-gather or
reduce-scatter (n - 1) / n B of the full result.

- all-reduce, model parallel: a MatMul whose contracted dimension is split k ways sums its
  partial products, forward (B = its output slice); in the backward pass the input gradient
  of a MatMul whose n dimension is split c ways is summed over c (B = the input slice).
  A vocabulary-split Gather sums the partial lookups (forward). Operators inside a
  recomputed cell communicate twice in the forward direction (mp_comm_recompute).
- reduce-scatter, model parallel: a MatMul whose output strategy splits the rows k more
  ways than its input (sequence parallel's row-split projection, rule G6) reduce-scatters
  the partial sums instead (B = the output slice before scattering), and all-gathers the
  output's gradient back in the backward pass.
- all-gather / reduce-scatter, redistribution (rule G8): where an operator wants a tensor
  less split than its producer left it (e.g. the whole class dimension of the loss after a
  vocabulary-split head, or the tokens a column-split projection takes whole under sequence
  parallel), MindSpore all-gathers it; the backward pass is counted as a reduce-scatter of
  the same size (MindSpore's AllGather gradient). That reduce-scatter also sums the partial
  input gradients of a MatMul whose n dimension is split over the same group, so their
  all-reduce is not counted again (MindSpore mirrors only parameters' gradients; Megatron's
  sequence parallel does the same).
- all-to-all, redistribution: where an operator wants a tensor split as many ways as its
  producer left it but along another dimension (the mixture of experts' move from token
  groups to experts and back, `nn.moe`), MindSpore sends each of the k devices its part:
  (k - 1) / k of the slice, forward and backward (an AllToAll each way). The k devices
  are the consumer's split of the new dimension; in MindSpore's device matrix the
  replicas its strategy leaves (the devices over its product) are the last dimension, so
  they stride that many times the splits of the later dimensions.
- all-reduce, data parallel (G9): each parameter's gradient over its replica group r, once
  per step whatever micro_batch_num and grad_accumulation are (the train step accumulates
  micro batches first: MindSpore's Pipeline / GradAccumulation cells on Ascend); with the
  optimizer shard a reduce-scatter instead, plus an all-gather of the weights' compute-dtype
  copy, also once per step (MindSpore compiles it into the step's graph, before the micro
  steps it calls: the dry run's exported MindIR has every AllGather there).
- all-reduce, the train step's own: one over all devices of two numbers (the weighted
  squared gradient norm and the overflow flag, `replication.norm_weights`), per step.
- send/receive, pipeline: every tensor crossing a stage boundary, forward and (if it needs a
  gradient) backward, per micro step; a parameter shared across stages once per step.
- bubble: the idle fraction of a 1F1B pipeline, (pp - 1) / (v m + pp - 1) with
  m = micro_batch_num x grad_accumulation micro batches and v = pipeline_interleave.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List

from model_zoo.cost.memory import (GRADIENT_BYTES, WEIGHT_BYTES, cast_bytes, input_split,
                                   stage_count)
from model_zoo.layout.operator_entry import collective, gather_factor, ring, slice_bytes
from model_zoo.layout.operators import operator
from model_zoo.parallel.config import ParallelConfig
from model_zoo.parallel.replication import mirror_group_size, optimizer_shard_size

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_receive")
STEP_FLAGS_BYTES = 8   # the train step's one all-reduce: squared gradient norm and overflow flag


@dataclass
class StageCommunication:
    stage: int
    bytes: Dict[str, float] = field(default_factory=lambda: {kind: 0.0 for kind in KINDS})
    details: Dict[tuple, List[float]] = field(default_factory=dict)
    groups: Dict[tuple, List[int]] = field(default_factory=dict)

    def add(self, kind, reason, amount, group=(1, 1), times=1):
        """`amount` bytes sent in `times` collectives over a group of `group` = (ranks,
        stride between them); `details` sums bytes and operators by (kind, reason),
        `groups` keeps the group and the collectives for the time model (`timing`)."""
        if amount <= 0:
            return
        self.bytes[kind] += amount
        entry = self.details.setdefault((kind, reason), [0.0, 0])
        entry[0] += amount
        entry[1] += 1
        self.groups.setdefault((kind, reason), [*group, 0])[2] += times

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def to_dict(self):
        return {"stage": self.stage, **self.bytes, "total": self.total,
                "details": [{"kind": kind, "what": reason, "bytes": amount, "count": count,
                             "group_size": self.groups[(kind, reason)][0]}
                            for (kind, reason), (amount, count) in sorted(
                                self.details.items(), key=lambda item: -item[1][0])]}


def with_interleaved_sends(stages: List[StageCommunication], interleave: int):
    """The estimate of a pipeline recorded without interleave, its stage borders' sends
    made `interleave`-fold: with that many chunks a device a micro batch crosses each
    border once per chunk (the advisor's recordings keep one chunk a stage; a full plan
    records the chunks and counts their borders itself). Left out: the interleave - 1
    sends from the last stage back to the first, which the recordings do not have."""
    if interleave == 1:
        return stages
    for comm in stages:
        for (kind, reason), entry in comm.details.items():
            if kind == "send_receive" and reason.startswith("stage "):
                comm.bytes[kind] += (interleave - 1) * entry[0]
                entry[0] *= interleave
                entry[1] *= interleave
                comm.groups[(kind, reason)][2] *= interleave
    return stages


def all_to_all_stride(have: tuple, wanted: tuple, devices_per_stage: int) -> int:
    """Rank distance between the devices of an all-to-all from layout `have` to `wanted`
    (module docstring): the replicas of `wanted` times the splits after the first
    dimension it splits more than `have` does."""
    moved = next(d for d, (h, w) in enumerate(zip(have, wanted)) if w > h)
    return devices_per_stage // math.prod(wanted) * math.prod(wanted[moved + 1:])


def _generic_path(path: str) -> str:
    """A cell path with block indices replaced by *, to sum the same operator of all layers."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def estimate_communication(rec, parallel: ParallelConfig,
                           accumulation: int = 1) -> List[StageCommunication]:
    """Bytes each device of every stage sends per step, by kind (module docstring)."""
    stages = [StageCommunication(k) for k in range(stage_count(rec, parallel))]
    micro_steps = parallel.micro_batch_num * accumulation
    casts = cast_bytes(rec)
    calls = rec.calls
    crossing = set()
    # the stages' devices, `devices_per_stage` apart: placed as one group spanning them all
    # (the pipeline goes at the pace of its slowest boundary)
    between_stages = (parallel.pipeline_stage, parallel.devices_per_stage)
    for call in calls:
        comm = stages[call.stage]
        forward = micro_steps * (2 if call.recompute_root else 1)
        backward = micro_steps
        where = _generic_path(call.path)
        tensors = call.tensors
        if call.strategy is not None and call.outputs and len(call.strategy) == len(tensors):
            own = operator(call.name).communication
            for kind, what, amount, group, times in (
                    own(call, where, forward, backward) if own else ()):
                comm.add(kind, what, amount, group, times)
            for index, info in enumerate(tensors):
                if info.param is not None:
                    continue
                wanted = call.strategy[index]
                have = info.layout
                gather = gather_factor(have, wanted)
                if gather == 1:
                    continue
                amount = collective(gather) * slice_bytes(info, wanted)
                if math.prod(have) == math.prod(wanted):
                    group = (gather, all_to_all_stride(have, wanted,
                                                       parallel.devices_per_stage))
                    comm.add("all_to_all", f"{where}: input {index} moved {have} -> "
                                           f"{wanted}", forward * amount, group, forward)
                    if info.needs_grad:
                        comm.add("all_to_all", f"{where}: gradient of input {index} "
                                               f"{wanted} -> {have}", backward * amount,
                                 group, backward)
                else:
                    comm.add("all_gather", f"{where}: input {index} redistributed "
                                           f"{have} -> {wanted}", forward * amount,
                             (gather, 1), forward)
                    if info.needs_grad:
                        comm.add("reduce_scatter", f"{where}: gradient of input {index} "
                                                   f"{wanted} -> {have}", backward * amount,
                                 (gather, 1), backward)
        for index, info in enumerate(tensors):
            if info.param is not None or info.producer is None:
                continue
            source = calls[info.producer].stage
            if source != call.stage and (info.key, call.stage) not in crossing:
                crossing.add((info.key, call.stage))
                split = info.layout or input_split(call, index, info)
                amount = slice_bytes(info, split)
                stages[source].add("send_receive",
                                   f"stage {source} -> {call.stage}: {info.shape} activations",
                                   micro_steps * amount, between_stages, micro_steps)
                if info.needs_grad:
                    stages[call.stage].add("send_receive", f"stage {call.stage} -> {source}: "
                                                           f"{info.shape} gradients",
                                           micro_steps * amount, between_stages, micro_steps)
    for param in rec.params.values():
        replicas = mirror_group_size(param, parallel)
        grad_bytes = GRADIENT_BYTES * param.slice_numel
        z = optimizer_shard_size(param, parallel)
        # replicas are the devices of the stage holding the same slice: the parameter's
        # split takes the device matrix's inner dimensions, so they stride the rest
        mirrors = (replicas, max(1, parallel.devices_per_stage // replicas))
        for stage in {param.stage} | param.used_on_stages:
            comm = stages[stage]
            if param.requires_grad and replicas > 1:
                # once per step: micro batches and accumulation slices are summed first
                if z > 1:
                    comm.add("reduce_scatter", "parameter gradients (optimizer shard)",
                             collective(replicas) * grad_bytes, mirrors)
                    # the compute-dtype copy is gathered (fp16: half of the fp32 weight),
                    # once a step: MindSpore compiles the gathers into the step's graph,
                    # not into the micro step it calls m times (the dry run's MindIR)
                    gathered = casts.get(param.name, WEIGHT_BYTES) * param.slice_numel
                    comm.add("all_gather", "weights (optimizer shard)",
                             collective(replicas) * gathered, mirrors)
                else:
                    comm.add("all_reduce", "parameter gradients (data parallel)",
                             ring(replicas) * grad_bytes, mirrors)
        for other in param.used_on_stages - {param.stage}:
            amount = WEIGHT_BYTES * param.slice_numel
            stages[param.stage].add("send_receive", f"shared parameter {param.name}", amount,
                                    between_stages)
            if param.requires_grad:
                stages[other].add("send_receive", f"gradient of shared {param.name}", amount,
                                  between_stages)
    if parallel.device_num > 1:
        for comm in stages:
            comm.add("all_reduce", "gradient norm and overflow flag (all devices)",
                     ring(parallel.device_num) * STEP_FLAGS_BYTES, (parallel.device_num, 1))
    return stages


def pipeline_bubble(parallel: ParallelConfig, accumulation: int = 1) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline: (pp - 1) / (v m + pp - 1), where the
    pipeline runs m = micro_batch_num x grad_accumulation micro batches a step (on a
    pipeline, accumulation is more micro batches: `context.micro_batching`) through
    v = pipeline_interleave chunks a device: it fills and drains in chunk-sized steps, a
    v-th of a stage's micro step (Narayanan et al. 2021, the interleaved schedule)."""
    pp = parallel.pipeline_stage
    micro = parallel.micro_batch_num * accumulation * parallel.pipeline_interleave
    return (pp - 1) / (micro + pp - 1) if pp > 1 else 0.0
