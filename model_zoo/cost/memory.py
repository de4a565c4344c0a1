"""Memory and communication of a layout, from a recorded forward pass (`layout.trace.record`).

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
recorded operators (each entry's `saved` in `layout.operators.OPERATORS`: MatMul keeps both
operands, Softmax its output, LayerNorm its input and statistics, GeLU its input and
output, Dropout a one-bit mask per element, Add and Cast nothing, ...), each counted once
(a cast shared by Q, K and V is one tensor, as MindSpore's graph optimiser merges equal
casts) and sliced by the strategy of the operator that keeps it. Weights and their casts
are counted above, not here. With `parallel.recompute` a recomputed cell (a block) keeps
only its inputs (a tensor several blocks read, such as the rotary (cos, sin) of a LLaMA,
once), and re-creates its activations during its own backward pass, so one block's
activations are added once (R_k):

    activations_k = m_k x A_k + R_k + W_k,   m_k = min(pp - k, micro_batch_num) micro
                                             batches in flight on stage k with 1F1B (1
                                             without pipeline; with interleaved chunks
                                             `micro_batches_in_flight`)

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
"""

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List

from model_zoo.layout.operator_entry import slice_bytes
from model_zoo.layout.operators import operator
from model_zoo.parallel.config import ParallelConfig
from model_zoo.parallel.replication import optimizer_shard_size

WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
ADAM_BYTES = 8
# Ascend's dropout keeps a bit mask (DropoutGenMask: one bit per element)
MASK_BYTES = 1 / 8


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

    def add_up_activations(self):
        """activations = m_k A_k + R_k + W_k (module docstring), from the parts."""
        self.activations = (self.micro_batches_in_flight * self.activations_per_micro_batch
                            + self.recompute_peak + self.backward_working)

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


def input_split(call, index, info):
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
            kept.append((tensors[index], input_split(call, index, tensors[index]), None))

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


def stage_count(rec, parallel):
    return max(parallel.pipeline_stage, 1 + max((c.stage for c in rec.calls), default=0))


def cast_bytes(rec) -> Dict[str, int]:
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
        amount += sum(slice_bytes(info, input_split(call, index, info))
                      for index, info in enumerate(call.tensors)
                      if info.needs_grad and info.param is None)
        found.append((call.stage, amount))
    return found


def estimate_memory(rec, parallel: ParallelConfig, accumulation: int = 1) -> List[StageMemory]:
    """Memory per device of every pipeline stage (formulas in the module docstring)."""
    stages = [StageMemory(k) for k in range(stage_count(rec, parallel))]
    casts = cast_bytes(rec)
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
    kept = set()   # (stage, tensor): an input several recomputed blocks read is kept once
    for root, inputs in rec.checkpoints.items():
        stage = root_stage.get(root)
        if stage is None:
            stage = next((c.stage for c in rec.calls if c.recompute_root == root), 0)
        for info in inputs:
            if info.param is None and (stage, info.key) not in kept:
                kept.add((stage, info.key))
                per_micro[stage] += slice_bytes(info, info.layout)
    working = [0.0] * len(stages)
    for stage, amount in backward_working_sets(rec):
        working[stage] = max(working[stage], amount)
    for memory in stages:
        k = memory.stage
        memory.activations_per_micro_batch = per_micro[k]
        memory.micro_batches_in_flight = micro_batches_in_flight(
            parallel, k, parallel.micro_batch_num * accumulation)
        memory.recompute_peak = max((amount for root, amount in inside.items()
                                     if root_stage.get(root) == k), default=0.0)
        memory.backward_working = working[k]
        memory.add_up_activations()
    return stages


def micro_batches_in_flight(parallel: ParallelConfig, stage: int, micro_steps: int) -> int:
    """Micro batches whose activations stage `stage` holds at its peak: pp - stage in a 1F1B
    pipeline (the forward passes before its first backward), at most the micro steps. With
    v = pipeline_interleave chunks, the warm-up Megatron's interleaved schedule runs,
    2 (pp - stage - 1) + (v - 1) pp chunk passes and the one in progress, each a v-th of the
    stage's activations, rounded up (MindSpore's interleaved 1F1B: the same order, not
    measured here)."""
    pp, v = parallel.pipeline_stage, parallel.pipeline_interleave
    if pp == 1:
        return 1
    if v == 1:
        return min(pp - stage, micro_steps)
    chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, micro_steps * v)
    return math.ceil(chunks / v)
