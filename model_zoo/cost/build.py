"""A plan: a config's layout checked, and its memory, communication, compute and step time
estimated, for one device profile (`build_plan`). `model-zoo plan` prints it
(`plan.report`), the advisor ranks layouts by it, and `Plan.to_dict` is the JSON of
`model-zoo plan --json`.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

from model_zoo.cost.communication import estimate_communication, pipeline_bubble
from model_zoo.cost.compute import estimate_compute
from model_zoo.cost.devices import DeviceProfile, load_profile
from model_zoo.cost.memory import estimate_memory
from model_zoo.cost.timing import StepTime, estimate_time
from model_zoo.errors import UserInputError
from model_zoo.layout.network import checked_recording, layout_violations, micro_batch_size
from model_zoo.layout.recording import Recording
from model_zoo.layout.rules import Violation


@dataclass
class Plan:
    """The result of `build_plan`: violations, recording, memory and communication."""

    config: Any
    config_path: str
    device_num: int
    profile: DeviceProfile
    micro_batch: int
    violations: List[Violation]
    recording: Optional[Recording] = None
    memory: list = field(default_factory=list)
    communication: list = field(default_factory=list)
    compute: list = field(default_factory=list)
    bubble: float = 0.0
    time: Optional[StepTime] = None

    @property
    def device(self) -> str:
        return self.profile.key

    @property
    def device_name(self) -> str:
        return self.profile.name

    @property
    def device_memory(self) -> int:
        return self.profile.memory

    @property
    def worst_stage(self):
        return max(self.memory, key=lambda m: m.total) if self.memory else None

    @property
    def fits(self) -> bool:
        """The worst stage within what a run may fill of the device (`usable_memory`)."""
        return bool(self.memory) and self.worst_stage.total <= self.profile.usable_memory

    @property
    def ok(self) -> bool:
        return not self.violations and self.fits

    @property
    def parameter_count(self) -> int:
        return sum(p.numel for p in self.recording.params.values()) if self.recording else 0

    @property
    def checked_calls(self) -> int:
        return len(self.recording.strategy_calls()) if self.recording else 0

    def to_dict(self) -> dict:
        parallel, train, model = self.config.parallel, self.config.train, self.config.model
        worst = self.worst_stage
        comm_worst = max(self.communication, key=lambda c: c.total) if self.communication else None
        worst_compute = max(self.compute, key=lambda c: c.total) if self.compute else None
        return {
            "config": self.config_path, "model": model.name, "ok": self.ok,
            "parameters": self.parameter_count,
            "layout": {"device_num": self.device_num, "data_parallel": parallel.dp,
                       "model_parallel": parallel.mp, "pipeline_stage": parallel.pipeline_stage,
                       "devices_per_stage": parallel.devices_per_stage,
                       "micro_batch_num": parallel.micro_batch_num,
                       "optimizer_shard": parallel.optimizer_shard,
                       "recompute": parallel.recompute,
                       "recompute_blocks": parallel.recompute_blocks,
                       "stage_blocks": parallel.stage_blocks,
                       "vocab_emb_dp": parallel.vocab_emb_dp,
                       "full_batch": parallel.full_batch,
                       "pipeline_interleave": parallel.pipeline_interleave,
                       "pipeline_scheduler": parallel.pipeline_scheduler},
            "batch": {"global": train.global_batch_size,
                      "grad_accumulation": train.grad_accumulation,
                      "micro_batch": self.micro_batch, "precision": train.precision},
            "checked_operator_calls": self.checked_calls,
            "violations": [v.to_dict() for v in self.violations],
            "device": {"name": self.device_name, "memory": self.device_memory,
                       "usable_memory": self.profile.usable_memory,
                       "key": self.device,
                       "devices_per_server": self.profile.devices_per_server},
            "memory": {"stages": [m.to_dict() for m in self.memory],
                       "worst_stage": worst.stage if worst else None,
                       "total": worst.total if worst else None, "fits": self.fits},
            "communication": {"stages": [c.to_dict() for c in self.communication],
                              "worst_stage": comm_worst.stage if comm_worst else None,
                              **({kind: comm_worst.bytes[kind] for kind in comm_worst.bytes}
                                 if comm_worst else {})},
            "compute": {"stages": [c.to_dict() for c in self.compute],
                        "worst_stage": worst_compute.stage if worst_compute else None,
                        "flops": worst_compute.total if worst_compute else None},
            # per step, all devices: the model's work (MFU's numerator: routed experts
            # only) and what the devices execute (recomputation and replicas included)
            "flops": {"model": sum(c.model for c in self.compute) if self.compute else None,
                      "executed": (sum(c.total for c in self.compute)
                                   * self.config.parallel.devices_per_stage
                                   if self.compute else None)},
            "pipeline_bubble": self.bubble,
            "time": self.time.to_dict() if self.time else None,
        }


def default_device(config) -> str:
    """The profile a config is planned on unless `--device` says: the Ascend 910B when it
    asks for what only the 910B runs (flash attention, bfloat16), else the Ascend 910."""
    needs_910b = (getattr(config.model, "flash_attention", False)
                  or config.train.precision == "bf16")
    return "ascend910b" if needs_910b else "ascend910"


def build_plan(config, config_path: str = "", device_num: Optional[int] = None,
               device: Optional[str] = None, customize=None,
               devices_per_server: int = 0, device_memory: int = 0) -> Plan:
    """Check `config`'s layout and operators and estimate its cost (see the module doc).

    Args:
        config: a Config (from `load_plan_config`).
        config_path: shown in the report.
        device_num: the devices the job will have (default: dp x mp x pp).
        device: a device profile's key (`devices.DEVICE_KEYS`): the memory the estimate is
            held against, and the speeds that time the step (`timing`).
        customize: optional function called with the built network before the recording
            (the tests use it to break strategies on purpose).
        devices_per_server: overrides the profile's server size (0: the profile's).
        device_memory: the memory of the chip the job runs on, when known (the launch
            reads it from the server: `parallel.context.server_chip`); 0: the profile's.
    """
    if devices_per_server < 0:
        raise UserInputError(f"--devices-per-server must be >= 1, got {devices_per_server}")
    device = device or default_device(config)
    profile = load_profile(device, devices_per_server)
    if device_memory:   # the runtime keeps as much of it as of the profile's chip
        profile.usable_memory = device_memory - (profile.memory - profile.usable_memory)
        profile.memory = device_memory
    parallel, train = config.parallel, config.train
    device_num = device_num or parallel.device_num
    if device_num < 1:
        raise UserInputError(f"--device-num must be >= 1, got {device_num}")
    violations = layout_violations(config, device_num)
    micro_batch = micro_batch_size(config)
    if getattr(config.model, "flash_attention", False) and device != "ascend910b":
        violations.append(Violation(
            "flash_attention", f"model.flash_attention: FlashAttentionScore runs on Ascend "
                               f"910B (Atlas A2) only, not on {profile.name}; plan with "
                               f"--device ascend910b"))
    if train.precision == "bf16" and device == "ascend910":
        violations.append(Violation(
            "precision", "train.precision=bf16: the Ascend 910 has no bfloat16 Cube unit; "
                         "plan with --device ascend910b (or a100), or use fp16"))
    plan = Plan(config, config_path, device_num, profile, micro_batch, violations)
    plan.recording = checked_recording(config, violations, device_num, customize)
    if plan.recording is None:
        return plan
    plan.memory = estimate_memory(plan.recording, parallel, train.grad_accumulation)
    plan.communication = estimate_communication(plan.recording, parallel,
                                                     train.grad_accumulation)
    plan.compute = estimate_compute(plan.recording, parallel, train.grad_accumulation)
    plan.bubble = pipeline_bubble(parallel, train.grad_accumulation)
    plan.time = estimate_time(plan.compute, plan.communication, plan.memory, parallel,
                                     train.precision, train.global_batch_size,
                                     config.model.seq_length, profile,
                                     parallel.micro_batch_num * train.grad_accumulation)
    return plan
