"""Memory and communication of a layout, from a recorded forward pass (`plan.record`).

Everything is per device, for the devices of one pipeline stage (S = dp x mp of them), and
the report uses the worst stage. Slices come from the strategies: a tensor of n elements
whose strategy (or output layout) is (s_1, ..., s_r) has n / (s_1 ... s_r) elements on a
device. Sizes are exact for what the recording sees: no formula is fitted to a model.

Memory of stage k
-----------------
For every parameter p owned by stage k, with slice P = numel(p) / prod(split(p)):

    weights      4 P / z          fp32 master weights (the model stores float32)
    working copy c P              the compute-dtype copy MatMul keeps for the backward pass
                                  when the weight is cast (fp16: c = 2); with the optimizer
                                  shard (z > 1) MindSpore all-gathers that compute copy, so
                                  it is the gathered one; 4 P for an uncast (float32) weight
    gradients    4 P g            fp32; g = 2 when a step has several micro steps (micro
                                  batches or train.grad_accumulation): the running sum and
                                  the current micro step's gradients coexist
    optimizer    8 P / z          AdamWeightDecay's m and v in fp32

z is the optimizer-shard group (rules, optimizer parallel;
`replication.optimizer_shard_size`): with `parallel.optimizer_shard` a parameter is sliced
on dimension 0 over its replica group r = S / prod(split(p)) when that divides its dim-0
slice and the whole parameter is at least 64 KB (MindSpore's threshold); otherwise z = 1.
Gradients are not sharded (optimizer_level level1). A parameter used on a later stage
(GPT-2's tied embedding on the last stage) costs that stage a received copy and its gradient
(8 P).

Activations per micro batch, A_k, are the tensors the backward pass needs, summed over the
recorded operators (each entry's `saved` in `operators.OPERATORS`: MatMul keeps both
operands, Softmax its output, LayerNorm its input and statistics, GeLU its input and
output, Dropout a one-bit mask per element, Add and Cast nothing, ...), each counted once
(a cast shared by Q, K and V is one tensor, as MindSpore's graph optimiser merges equal
casts) and sliced by the strategy of the operator that keeps it. Weights and their casts
are counted above, not here. With `parallel.recompute` a recomputed cell (a block) keeps
only its inputs, and re-creates its activations during its own backward pass, so one
block's activations are added once (R_k):

    activations_k = m_k x A_k + R_k + W_k,   m_k = min(pp - k, micro_batch_num) micro
                                             batches in flight on stage k with 1F1B (1
                                             without pipeline)

W_k, the backward working set, is the largest sum, over the operators of stage k, of the
gradients of an operator's outputs and of its activation inputs: they are alive together
while its backward runs (for GPT-2 the vocabulary head's logits gradient).

For GPT-2 this gives, per layer and micro batch of b sequences of s tokens (hidden h,
heads a, model parallel t, data parallel d, c = 2 bytes for fp16, dropout on), with
T = b s / d tokens per device:

    T h (12.25 + 24 / t) + 16 T + 6.125 a s^2 (b / d) / t  bytes

which is Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2: s b h (10 + 24 / t) + 5 a s^2 b / t) adapted to our operators: the two
layer norms take float32 inputs (4 instead of 2 bytes each: 4 h more per token), the
softmax output is float32 (2 a s more per query), the dropout masks are bit masks (1/8
byte instead of 1 per element: 1.75 h less per token, 0.875 a s less per query), the
statistics of the two layer norms add 16 bytes per token, and the batch is split by d.
`gpt2_layer_activation_bytes` states it and a test checks it against the recording.
With `parallel.sequence_parallel` the layer norms' float32 inputs and statistics and the
dropout masks are split by t as well (the casts the projections take stay whole, gathered):

    T h (4 + 32.25 / t) + 16 T / t + 6.125 a s^2 (b / d) / t  bytes,

and a recomputed block's float32 input, which it keeps for its backward pass, 4 T h / t.

With `model.flash_attention` (FlashAttentionScore keeps q, k, v, its output and two float32
softmax statistics of 8 values per query and head, and a padding mask of one byte per
(query, key) pair of a sequence), a layer without attention dropout keeps, instead of the
float32 probabilities and their compute-dtype copy ((4 + c) a s^2 (b / d) / t),
64 a s (b / d) / t + c T h / t, plus s^2 b / d for a padding mask (BERT, the encoder).

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
- all-reduce, data parallel (G9): each parameter's gradient over its replica group r, once
  per step whatever micro_batch_num and grad_accumulation are (the train step accumulates
  micro batches first: MindSpore's Pipeline / GradAccumulation cells on Ascend); with the
  optimizer shard a reduce-scatter instead, plus an all-gather of the weights' compute-dtype
  copy for each micro step.
- all-reduce, the train step's own: one over all devices of two numbers (the weighted
  squared gradient norm and the overflow flag, `replication.norm_weights`), per step.
- send/receive, pipeline: every tensor crossing a stage boundary, forward and (if it needs a
  gradient) backward, per micro step; a parameter shared across stages once per step.
- bubble: the idle fraction of a 1F1B pipeline, (pp - 1) / (m + pp - 1) with
  m = micro_batch_num x grad_accumulation micro batches.

Compute per step
----------------
FLOPs one device of each stage executes per step in MatMul, BatchMatMul and
FlashAttentionScore: a call of output shape (..., m, n) and contracted size k costs
2 m n k x batch / prod(device matrix) per device (replicated work counts on every
replica). The backward pass costs it again for each operand that needs a gradient (input
and weight: 2x), a recomputed cell's forward pass runs twice, and all of it happens
micro_batch_num x grad_accumulation times a step. FlashAttentionScore counts its two
products, 4 b a s_q s_k d / (dp mp), twice that backward, and half of it again as
recomputation (its backward pass recomputes the scores). Every other operator (but views)
counts the bytes of its input and output slices, once forward, twice backward when it has
a gradient and once more when recomputed, and one launch per pass: the time model
(`timing`) runs those at the memory bandwidth and a launch cost.
"""

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List

from model_zoo.parallel.config import ParallelConfig
from model_zoo.parallel.replication import mirror_group_size, optimizer_shard_size
from model_zoo.plan.operators import (collective, device_matrix, gather_factor, operator, ring,
                                      slice_bytes)

GIB = 2 ** 30
WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
STEP_FLAGS_BYTES = 8   # the train step's one all-reduce: squared gradient norm and overflow flag
ADAM_BYTES = 8
# Ascend's dropout keeps a bit mask (DropoutGenMask: one bit per element)
MASK_BYTES = 1 / 8
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_receive")

def gpt2_layer_activation_bytes(batch, seq, hidden, heads, dp=1, mp=1, compute_bytes=2,
                                dropout=True, sequence_parallel=False) -> float:
    """Closed form of one GPT-2 block's activations per device and micro batch.

    Per token (T = batch x seq / dp of them on a device), in units of `hidden`: the float32
    inputs of ln_1 and ln_2 (4 + 4), the compute-dtype casts of their outputs shared by Q, K,
    V and by the expansion (c + c), Q, K, V and the attention output's input (4c / mp), GELU's
    input and output (2 x 4c / mp), two one-bit dropout masks (2 / 8); plus the float32 mean
    and variance of both layer norms (16 bytes). Per query and head, in units of seq: the
    float32 softmax output (4), then the dropout bit mask and the dropped probabilities
    (1 / 8 + c), or without dropout the probabilities cast to the compute dtype (c; none in
    float32). For fp16 with dropout: T h (12.25 + 24 / mp) + 16 T + 6.125 a s^2 (batch / dp) / mp.
    With sequence parallel the layer norms' inputs and statistics and the two dropout masks
    are split over mp too (the casts Q, K, V and the expansion take are all-gathered, whole):
    for fp16 with dropout T h (4 + 32.25 / mp) + 16 T / mp + the same per-query term.
    """
    c, tokens = compute_bytes, batch * seq / dp
    stream = (8 + (2 * MASK_BYTES if dropout else 0)) * hidden + 16   # per token, split by
    if sequence_parallel:                                              # the stream's layout
        stream /= mp
    per_token = (2 * c + 12 * c / mp) * hidden + stream
    if dropout:
        per_query = 4 + MASK_BYTES + c
    else:
        per_query = 4 + (c if c != 4 else 0)
    return tokens * per_token + per_query * heads * seq * seq * (batch / dp) / mp


@dataclass
class StageMemory:
    stage: int
    weights: float = 0
    working_copy: float = 0
    gradients: float = 0
    optimizer: float = 0
    activations: float = 0
    activations_per_micro_batch: float = 0
    micro_batches_in_flight: int = 1
    recompute_peak: float = 0
    backward_working: float = 0
    parameters: int = 0            # elements of the parameter slices this device holds
    optimizer_parameters: float = 0   # elements this device's optimizer updates (/ z)

    @property
    def total(self) -> float:
        return (self.weights + self.working_copy + self.gradients + self.optimizer
                + self.activations)

    def to_dict(self):
        return {"stage": self.stage, "weights": self.weights, "working_copy": self.working_copy,
                "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations,
                "activations_per_micro_batch": self.activations_per_micro_batch,
                "micro_batches_in_flight": self.micro_batches_in_flight,
                "recompute_peak": self.recompute_peak,
                "backward_working": self.backward_working,
                "parameters_per_device": self.parameters,
                "total": self.total}


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


def _moved_bytes(call, params) -> float:
    """Bytes one pass of an operator reads and writes on one device: the slices of its
    inputs and outputs. A parameter, or the compute-dtype copy a Cast makes of it, where no
    strategy here says its layout is the slice its consumers' strategies give it."""
    def moved(info, split):
        param = params.get(info.param) if split is None and info.param else None
        whole = slice_bytes(info, split)
        return whole * param.slice_numel / max(param.numel, 1) if param else whole

    return (sum(moved(info, _input_split(call, index, info))
                for index, info in enumerate(call.tensors))
            + sum(moved(out, out.layout) for out in call.outputs))


def _input_split(call, index, info):
    if call.strategy is not None and index < len(call.strategy) and \
            len(call.strategy[index]) == len(info.shape):
        return call.strategy[index]
    return info.layout


def saved_tensors(call, differentiated=None):
    """[(TensorInfo, split, bytes per element or None)] the call keeps for backward.

    `differentiated`: keys of the tensors some differentiable operator consumes; a call
    none of whose outputs is among them (e.g. the maximum a stop_gradient takes) has no
    backward pass and keeps nothing.
    """
    if not call.outputs or not call.outputs[0].needs_grad:
        return []
    if differentiated is not None and not any(out.key in differentiated for out in call.outputs):
        return []
    tensors = call.tensors
    rule = operator(call.name).saved
    if rule == "nothing":
        return []
    kept = []

    def keep_input(index):
        if index < len(tensors):
            kept.append((tensors[index], _input_split(call, index, tensors[index]), None))

    def keep_output(index, bytes_per_element=None):
        if index < len(call.outputs):
            out = call.outputs[index]
            kept.append((out, out.layout, bytes_per_element))

    if rule == "cross" and len(tensors) >= 2:
        if tensors[1].needs_grad:
            keep_input(0)
        if tensors[0].needs_grad:
            keep_input(1)
    elif rule == "divide" and len(tensors) >= 2:
        keep_input(1)
        if tensors[1].needs_grad:
            keep_input(0)
    elif rule == "both":
        for index in range(len(tensors)):
            keep_input(index)
    elif rule == "out0":
        keep_output(0)
    elif rule == "out1":
        keep_output(1)
    elif rule == "in0":
        keep_input(0)
    elif rule == "in0+out0":
        keep_input(0)
        keep_output(0)
    elif rule == "flash":
        for index in (0, 1, 2):
            keep_input(index)
        if len(tensors) > 3 and len(tensors[3].shape) == 4:  # a padding mask, not the
            keep_input(3)                                     # shared compressed one
        for index in (0, 1, 3):
            keep_output(index)
    elif rule == "in0+stats":
        keep_input(0)
        keep_output(1)
        keep_output(2)
    elif rule == "mask":
        keep_output(1, MASK_BYTES)
    elif rule == "indices":
        if tensors and tensors[0].needs_grad:
            keep_input(1)
    else:
        for index, info in enumerate(tensors):
            if info.dtype.startswith(("Float", "BFloat")):
                keep_input(index)
    return [(info, split, size) for info, split, size in kept
            if info.param is None and info.numel > 1]


def _stage_count(rec, parallel):
    return max(parallel.pipeline_stage, 1 + max((c.stage for c in rec.calls), default=0))


def _cast_bytes(rec) -> Dict[str, int]:
    """Parameter name -> itemsize of the smallest compute-dtype copy made of it."""
    found = {}
    for call in rec.calls:
        if call.name == "Cast" and call.tensors and call.tensors[0].param and call.outputs:
            source, out = call.tensors[0], call.outputs[0]
            out_size = out.nbytes // max(out.numel, 1)
            if out.dtype != source.dtype:
                found[source.param] = min(found.get(source.param, 99), out_size)
    return found


def backward_working_sets(rec) -> List[tuple]:
    """(stage, bytes) of every call: the gradients of its outputs and of its activation
    inputs, alive together while its backward pass runs (W_k is the largest per stage)."""
    found = []
    for call in rec.calls:
        amount = sum(slice_bytes(out, out.layout) for out in call.outputs if out.needs_grad)
        amount += sum(slice_bytes(info, _input_split(call, index, info))
                      for index, info in enumerate(call.tensors)
                      if info.needs_grad and info.param is None)
        found.append((call.stage, amount))
    return found


def estimate_memory(rec, parallel: ParallelConfig, accumulation: int = 1) -> List[StageMemory]:
    """Memory per device of every pipeline stage (formulas in the module docstring)."""
    stages = [StageMemory(k) for k in range(_stage_count(rec, parallel))]
    casts = _cast_bytes(rec)
    gradient_sets = 2 if parallel.micro_batch_num * accumulation > 1 else 1
    for param in rec.params.values():
        memory = stages[param.stage]
        slice_numel = param.slice_numel
        z = optimizer_shard_size(param, parallel)
        memory.parameters += slice_numel
        memory.weights += WEIGHT_BYTES * slice_numel / z
        if param.name in casts:
            memory.working_copy += casts[param.name] * slice_numel
        if z > 1 and param.name not in casts:  # a float32 weight gathered as it is
            memory.working_copy += WEIGHT_BYTES * slice_numel
        if param.requires_grad:
            memory.gradients += gradient_sets * GRADIENT_BYTES * slice_numel
            memory.optimizer += ADAM_BYTES * slice_numel / z
            memory.optimizer_parameters += slice_numel / z
        for other in param.used_on_stages - {param.stage}:
            stages[other].working_copy += (WEIGHT_BYTES + casts.get(param.name, 0)) * slice_numel
            if param.requires_grad:
                stages[other].gradients += gradient_sets * GRADIENT_BYTES * slice_numel

    per_micro = [0.0] * len(stages)
    inside = defaultdict(float)        # recompute root -> activations it re-creates
    root_stage = {}
    seen = set()
    differentiated = {info.key for call in rec.calls if operator(call.name).gradient
                      for info in call.tensors}
    for call in rec.calls:
        for info, split, size in saved_tensors(call, differentiated):
            if (call.recompute_root, info.key) in seen:
                continue
            seen.add((call.recompute_root, info.key))
            amount = slice_bytes(info, split, size)
            if call.recompute_root is None:
                per_micro[call.stage] += amount
            else:
                inside[call.recompute_root] += amount
                root_stage.setdefault(call.recompute_root, call.stage)
    for root, inputs in rec.checkpoints.items():
        stage = root_stage.get(root)
        if stage is None:
            stage = next((c.stage for c in rec.calls if c.recompute_root == root), 0)
        per_micro[stage] += sum(slice_bytes(info, info.layout) for info in inputs
                                if info.param is None)
    working = [0.0] * len(stages)
    for stage, amount in backward_working_sets(rec):
        working[stage] = max(working[stage], amount)
    pp = parallel.pipeline_stage
    for memory in stages:
        k = memory.stage
        memory.activations_per_micro_batch = per_micro[k]
        memory.micro_batches_in_flight = (min(pp - k, parallel.micro_batch_num * accumulation)
                                          if pp > 1 else 1)
        memory.recompute_peak = max((amount for root, amount in inside.items()
                                     if root_stage.get(root) == k), default=0.0)
        memory.backward_working = working[k]
        memory.activations = (memory.micro_batches_in_flight * per_micro[k]
                              + memory.recompute_peak + memory.backward_working)
    return stages


def _generic(path: str) -> str:
    """A cell path with block indices replaced by *, to sum the same operator of all layers."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def estimate_communication(rec, parallel: ParallelConfig,
                           accumulation: int = 1) -> List[StageCommunication]:
    """Bytes each device of every stage sends per step, by kind (module docstring)."""
    stages = [StageCommunication(k) for k in range(_stage_count(rec, parallel))]
    micro_steps = parallel.micro_batch_num * accumulation
    casts = _cast_bytes(rec)
    calls = rec.calls
    crossing = set()
    # the stages' devices, `devices_per_stage` apart: placed as one group spanning them all
    # (the pipeline goes at the pace of its slowest boundary)
    between_stages = (parallel.pipeline_stage, parallel.devices_per_stage)
    for call in calls:
        comm = stages[call.stage]
        forward = micro_steps * (2 if call.recompute_root else 1)
        backward = micro_steps
        where = _generic(call.path)
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
                if gather > 1:
                    amount = collective(gather) * slice_bytes(info, wanted)
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
                split = info.layout or _input_split(call, index, info)
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
                    # the compute-dtype copy is gathered (fp16: half of the fp32 weight)
                    gathered = casts.get(param.name, WEIGHT_BYTES) * param.slice_numel
                    comm.add("all_gather", "weights (optimizer shard)",
                             micro_steps * collective(replicas) * gathered, mirrors,
                             micro_steps)
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
    stages = [StageCompute(k) for k in range(_stage_count(rec, parallel))]
    micro_steps = parallel.micro_batch_num * accumulation
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
            flops = whole / math.prod(call.strategy[0] if call.strategy else (1,))
            compute.forward += flops
            compute.backward += 2 * flops
            compute.recompute += flops / 2
            compute.attention += 3.5 * flops
            compute.model += 3 * whole
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
        if call.name == "BatchMatMul":
            compute.attention += done
        compute.model += (1 + gradients) * micro_steps * matmul_flops(call, whole=True)
    return stages


def pipeline_bubble(parallel: ParallelConfig, accumulation: int = 1) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline: (pp - 1) / (m + pp - 1), where the
    pipeline runs m = micro_batch_num x grad_accumulation micro batches a step (on a
    pipeline, accumulation is more micro batches: `context.loss_network_micro_batches`)."""
    pp = parallel.pipeline_stage
    micro = parallel.micro_batch_num * accumulation
    return (pp - 1) / (micro + pp - 1) if pp > 1 else 0.0
