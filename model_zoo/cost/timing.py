"""Step time of a layout, from the plan's compute and communication and a device profile.

Per device of pipeline stage k, for one step of m = micro_batch_num x grad_accumulation
micro steps (`compute.estimate_compute`, `communication.estimate_communication` count it all):

    compute_k   = F_matmul / (peak e_matmul) + F_attention / (peak e_attention)
                  + B_other / (bandwidth e_memory) + launches x overhead
    exposed_k   = the collectives inside the forward and backward passes (model parallel,
                  redistributions) and the pipeline's sends and receives: each volume /
                  link bandwidth + latency x ring steps
    sync_k      = the data-parallel gradient reduction, once per step, after the last
                  micro step (MindSpore's Pipeline and GradAccumulation cells reduce the
                  summed gradients), the AdamW update, memory bound (it reads the
                  weight, gradient and two moments and writes three of them: 28 bytes per
                  parameter of the device's optimizer slice), and the optimizer shard's
                  weight gathers, once per step before the first micro step

    t_k  = (compute_k + exposed_k) / m, one micro step of stage k
    step = (sum_k t_k - max_k t_k) / v + m max_k t_k + max_k sync_k

i.e. a 1F1B pipeline (GPipe has the same bubble) as a flow shop: the first micro batch
passes every stage, the other m - 1 follow at the pace of the slowest stage; the bubble is
sum_k t_k - max_k t_k: (pp - 1) micro steps when the stages are even, less when one stage
(a last stage that also holds the vocabulary projection) is slower than the others. With
v = pipeline_interleave chunks a device the pipeline fills and drains in chunks, a v-th of
a stage's micro step each (Megatron's interleaved 1F1B; the sends grow v-fold, counted by
the communication estimate, which sees every chunk border).
A collective's link is the slower one its group spans: its ranks, in MindSpore's rank order
(the stage outermost, then the device matrix with its last dimension fastest:
model-parallel groups are neighbours, data-parallel groups stride dp x mp / replicas), sit
inside one server when the group's extent fits in `devices_per_server`; inside a server a
group of n ranks on a full mesh of links (a profile's `peers`) sends over n - 1 of them
(`devices.Link.bandwidth_for`). Not modelled: overlap of communication with compute (the
fitted link bandwidths absorb the average of it), memory pressure, and the host.
"""

import math
from dataclasses import dataclass
from typing import List

from model_zoo.cost.devices import DeviceProfile

OPTIMIZER_BYTES_PER_PARAMETER = 28   # AdamW: read w, g, m, v (16) and write w, m, v (12), fp32
# gradients are reduced in buckets of this size: MindSpore's comm_fusion "auto" mode fuses
# all-reduces up to 64 MB (set_auto_parallel_context), PyTorch's DDP uses 25 MB buckets
GRADIENT_FUSION_BYTES = 64 * 2 ** 20


@dataclass
class StageTime:
    stage: int
    compute: float = 0.0
    exposed_communication: float = 0.0
    gradient_sync: float = 0.0
    optimizer: float = 0.0
    weight_gather: float = 0.0   # the optimizer shard's gathers, before the first micro step

    @property
    def step_end(self) -> float:
        """What the stage spends once a step, outside its micro steps."""
        return self.gradient_sync + self.optimizer + self.weight_gather

    def to_dict(self):
        return {"stage": self.stage, "compute_s": self.compute,
                "exposed_communication_s": self.exposed_communication,
                "gradient_sync_s": self.gradient_sync, "optimizer_s": self.optimizer,
                "weight_gather_s": self.weight_gather}


@dataclass
class StepTime:
    stages: List[StageTime]
    step: float
    bubble: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float

    @property
    def slowest(self) -> StageTime:
        return max(self.stages, key=lambda s: s.compute + s.exposed_communication)

    def to_dict(self):
        slowest = self.slowest
        return {"step_s": self.step, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "compute_s": slowest.compute,
                "communication_s": slowest.exposed_communication
                + max(s.gradient_sync + s.weight_gather for s in self.stages),
                "bubble_s": self.bubble,
                "optimizer_s": max(s.optimizer for s in self.stages),
                "stages": [s.to_dict() for s in self.stages]}


def spans_servers(size: int, stride: int, devices_per_server: int) -> bool:
    """True when a group of `size` ranks `stride` apart (aligned) spans several servers."""
    return size > 1 and size * stride > devices_per_server


def ring_steps(kind: str, size: int) -> int:
    """Latency-bound steps of one collective over `size` ranks (ring algorithms)."""
    if kind == "all_reduce":
        return 2 * (size - 1)
    if kind == "send_receive":
        return 1
    return size - 1


def collective_seconds(kind, amount, size, stride, times, profile: DeviceProfile) -> float:
    """Time of `times` executions of a collective sending `amount` bytes in all."""
    link = (profile.between_servers
            if spans_servers(size, stride, profile.devices_per_server)
            else profile.inside_server)
    # a send/receive goes over one link, whatever the group it is placed in spans
    peers = 2 if kind == "send_receive" else size
    return amount / link.bandwidth_for(peers) + times * ring_steps(kind, size) * link.latency


def estimate_time(compute, communication, memory, parallel, precision: str,
                  global_batch: int, tokens_per_sample: int,
                  profile: DeviceProfile, micro_steps: int) -> StepTime:
    """The step time of a layout (module docstring). `compute`, `communication`, `memory`
    are the plan's per-stage estimates."""
    peak = profile.peak(precision)
    stages = []
    for comp, comm, mem in zip(compute, communication, memory):
        stage = StageTime(comp.stage)
        stage.compute = ((comp.total - comp.attention) / (peak * profile.matmul_efficiency)
                         + comp.attention / (peak * profile.attention_efficiency)
                         + comp.memory_bytes
                         / (profile.memory_bandwidth * profile.memory_efficiency)
                         + comp.launches * profile.kernel_overhead)
        for (kind, reason), (amount, _) in comm.details.items():
            size, stride, times = comm.groups[(kind, reason)]
            if reason.startswith("parameter gradients"):
                # reduced in fused buckets, not one collective per parameter
                times = math.ceil(amount / GRADIENT_FUSION_BYTES)
                stage.gradient_sync += collective_seconds(kind, amount, size, stride, times,
                                                          profile)
            elif reason == "weights (optimizer shard)":
                stage.weight_gather += collective_seconds(kind, amount, size, stride, times,
                                                          profile)
            else:
                stage.exposed_communication += collective_seconds(kind, amount, size, stride,
                                                                  times, profile)
        stage.optimizer = (OPTIMIZER_BYTES_PER_PARAMETER * mem.optimizer_parameters
                           / (profile.memory_bandwidth * profile.memory_efficiency))
        if stage.gradient_sync:
            # the buckets are reduced while the last micro step's backward pass goes on;
            # what is left once it ends, at least the last bucket, is exposed
            backward = stage.compute * comp.backward / max(comp.total, 1) / micro_steps
            buckets = max(1, math.ceil(sum(
                amount for (_, reason), (amount, _) in comm.details.items()
                if reason.startswith("parameter gradients")) / GRADIENT_FUSION_BYTES))
            stage.gradient_sync = max(stage.gradient_sync / buckets,
                                      stage.gradient_sync - backward)
        stages.append(stage)
    per_micro = [(s.compute + s.exposed_communication) / micro_steps for s in stages]
    # the fill and drain go in chunk-sized steps with interleaved chunks
    pipeline = ((sum(per_micro) - max(per_micro)) / parallel.pipeline_interleave
                + micro_steps * max(per_micro))
    step = pipeline + max(s.step_end for s in stages)
    model_flops = sum(c.model for c in compute)
    return StepTime(stages=stages, step=step, bubble=pipeline - micro_steps * max(per_micro),
                    samples_per_s=global_batch / step,
                    tokens_per_s=global_batch * tokens_per_sample / step,
                    mfu=model_flops / (step * parallel.device_num * peak))
