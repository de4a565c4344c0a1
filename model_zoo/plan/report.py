"""A whole plan: the config checked, recorded, costed, and printed.

`build_plan(config)` builds the model folder's training network without allocating it,
records its forward pass (`trace.record`), checks the layout and every strategy
(`rules`), and estimates memory, communication and compute (`cost`); `format_report`
prints it and `Plan.to_dict` is the JSON of `model-zoo plan --json`.

The model folder contract used here: `build_train_network(config, compute_dtype)` and
`plan_inputs(config, batch_size) -> [(shape, dtype), ...]`, the network's inputs for one
micro batch (model_zoo/models/base.py).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from model_zoo.errors import ConfigError, UserInputError
from model_zoo.plan import cost
from model_zoo.plan import timing
from model_zoo.plan.devices import DeviceProfile, load_profile
from model_zoo.plan.rules import Violation, check_layout, check_recording
from model_zoo.plan.trace import PlanError, Recording, ParamInfo, record



# --- a whole plan ---------------------------------------------------------------------------

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
    time: Optional[timing.StepTime] = None

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
                       "full_batch": parallel.full_batch},
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
            "pipeline_bubble": self.bubble,
            "time": self.time.to_dict() if self.time else None,
        }


def load_plan_config(path: str, overrides=None):
    """The config as `load_config` reads it, but with the layout left unchecked.

    The model and train sections are validated (a bad value there is a user error, exit 2);
    the parallel layout and batch divisibility become plan violations instead, so that one
    run reports all of them.
    """
    from model_zoo.config import apply_override, read_yaml
    raw = read_yaml(path)
    for override in overrides or []:
        apply_override(raw, override)
    return plan_config_from_dict(raw, path)


def plan_config_from_dict(raw: dict, path: str = "<dict>"):
    """`load_plan_config` for a config already read into a dict."""
    from model_zoo.config import typed_config
    config = typed_config(raw, path)
    config.model.validate()
    config.train.validate()
    return config


def network_inputs(module, config, network, batch_size: int):
    """The network's inputs for one micro batch, from the model folder's `plan_inputs`."""
    hook = getattr(module, "plan_inputs", None)
    if hook is None:
        raise PlanError(f"model {config.model.name!r}: the model folder must define "
                        f"plan_inputs(config, batch_size) returning its training network's "
                        f"inputs as (shape, dtype)")
    return list(hook(config, batch_size))


def micro_batch_size(config) -> int:
    """Sequences of the global batch in one micro batch: what every operator sees."""
    return config.parallel.micro_batch_size(config.train.global_batch_size,
                                            config.train.grad_accumulation)


def record_training_network(config, network) -> Recording:
    """The recorded forward pass of `config`'s training network at one micro batch."""
    from model_zoo.config import import_model
    parallel = config.parallel
    inputs = network_inputs(import_model(config.model.name), config, network,
                            micro_batch_size(config))
    dataset_layout = None if parallel.full_batch else parallel.devices_per_stage
    return record(network, inputs, stages=parallel.pipeline_stage, dataset_layout=dataset_layout)


def parameter_layouts(config, network) -> Dict[str, ParamInfo]:
    """{parameter name: its shape, split and stage} for `config`'s layout, as the plan sees
    it; `network` is built with the Ascend operators (weights need not be allocated)."""
    return record_training_network(config, network).params


def usable_parameters(plan, purpose: str) -> Dict[str, ParamInfo]:
    """The recorded parameters of a plan whose layout breaks no rule (memory aside), for
    `purpose` (e.g. "--save-strategy"); UserInputError naming the first broken rule."""
    if plan.violations or plan.recording is None:
        first = plan.violations[0].message if plan.violations else "nothing was recorded"
        raise UserInputError(f"{purpose}: the layout cannot be used for this model: {first}")
    return plan.recording.params


def recompute_text(parallel) -> str:
    """`parallel.recompute` as the report says it, with its per-stage counts and the
    stages' blocks when the config sets them."""
    text = {False: "off", True: "on", "selective": "selective"}[parallel.recompute]
    if parallel.recompute and parallel.recompute_blocks is not None:
        text += f" (blocks per stage {parallel.recompute_blocks})"
    if parallel.stage_blocks is not None:
        text += f", stage blocks {parallel.stage_blocks}"
    return text


def default_device(config) -> str:
    """The profile a config is planned on unless `--device` says: the Ascend 910B when it
    asks for what only the 910B runs (flash attention, bfloat16), else the Ascend 910."""
    needs_910b = (getattr(config.model, "flash_attention", False)
                  or config.train.precision == "bf16")
    return "ascend910b" if needs_910b else "ascend910"


def build_plan(config, config_path: str = "", device_num: Optional[int] = None,
               device: Optional[str] = None, customize=None,
               devices_per_server: int = 0) -> Plan:
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
    """
    from mindspore.nn.utils import no_init_parameters
    from model_zoo.config import import_model
    from model_zoo.nn.backend import kernels_for
    from model_zoo.nn.layers import dtype_of

    if devices_per_server < 0:
        raise UserInputError(f"--devices-per-server must be >= 1, got {devices_per_server}")
    device = device or default_device(config)
    profile = load_profile(device, devices_per_server)
    parallel, train = config.parallel, config.train
    device_num = device_num or parallel.device_num
    if device_num < 1:
        raise UserInputError(f"--device-num must be >= 1, got {device_num}")
    violations = check_layout(parallel, device_num, config.model.pipeline_blocks,
                              train.global_batch_size, train.grad_accumulation,
                              config.model.seq_length)
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
    if any(v.rule == "layout" and "must be >= 1" in v.message for v in violations):
        return plan
    module = import_model(config.model.name)
    try:
        with no_init_parameters(), kernels_for("Ascend"):
            network = module.build_train_network(config, dtype_of(train.precision))
    except ConfigError as err:
        violations.append(Violation("build", str(err)))
        return plan
    if customize is not None:
        customize(network)
    plan.recording = record_training_network(config, network)
    violations.extend(check_recording(plan.recording, parallel, device_num))
    plan.memory = cost.estimate_memory(plan.recording, parallel, train.grad_accumulation)
    plan.communication = cost.estimate_communication(plan.recording, parallel,
                                                     train.grad_accumulation)
    plan.compute = cost.estimate_compute(plan.recording, parallel, train.grad_accumulation)
    plan.bubble = cost.pipeline_bubble(parallel, train.grad_accumulation)
    plan.time = timing.estimate_time(plan.compute, plan.communication, plan.memory, parallel,
                                     train.precision, train.global_batch_size,
                                     config.model.seq_length, profile,
                                     parallel.micro_batch_num * train.grad_accumulation)
    return plan


# --- the report -------------------------------------------------------------------------------

def _gib(value: float) -> str:
    return f"{value / 2 ** 30:.2f}"


def _count(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(int(value))


def format_report(plan: Plan, max_violations: int = 20) -> str:
    config, lines = plan.config, []
    parallel, train, model = config.parallel, config.train, config.model
    on = {True: "on", False: "off"}
    lines.append(f"plan: {plan.config_path or model.name}")
    lines.append(f"  model {model.name}: {_count(plan.parameter_count)} parameters "
                 f"({model.num_layers} layers, hidden {model.hidden_size}, heads "
                 f"{model.num_heads}, sequence {model.seq_length}, vocabulary {model.vocab_size})")
    lines.append(f"  layout: {plan.device_num} devices; data_parallel {parallel.dp} x "
                 f"model_parallel {parallel.mp} x pipeline_stage {parallel.pipeline_stage} "
                 f"({parallel.devices_per_stage} devices per stage)")
    lines.append(f"          micro batches {parallel.micro_batch_num}, optimizer shard "
                 f"{on[parallel.optimizer_shard]}, recompute {recompute_text(parallel)}, "
                 f"vocab_emb_dp {on[parallel.vocab_emb_dp]}, sequence parallel "
                 f"{on[parallel.sequence_parallel]}, precision {train.precision}")
    lines.append(f"  batch: global {train.global_batch_size} = {train.grad_accumulation} "
                 f"accumulation x {parallel.micro_batch_num} micro batches x "
                 f"{plan.micro_batch} sequences; each operator sees {plan.micro_batch}")
    lines.append(f"  checked: {plan.checked_calls} operator calls with a strategy, "
                 f"{len(plan.violations)} violation(s)")
    if plan.memory:
        lines.append("")
        lines.append(f"memory per device, GiB ({plan.device_name}: {_gib(plan.device_memory)})")
        lines.append(f"  {'stage':>5} {'weights':>8} {'copies':>8} {'grads':>8} "
                     f"{'optimizer':>9} {'activ.':>8} {'= micro x n + recomp. + bwd':>26} "
                     f"{'total':>8}")
        for m in plan.memory:
            detail = (f"{_gib(m.activations_per_micro_batch)} x {m.micro_batches_in_flight}"
                      f" + {_gib(m.recompute_peak)} + {_gib(m.backward_working)}")
            lines.append(f"  {m.stage:>5} {_gib(m.weights):>8} {_gib(m.working_copy):>8} "
                         f"{_gib(m.gradients):>8} {_gib(m.optimizer):>9} "
                         f"{_gib(m.activations):>8} {detail:>26} {_gib(m.total):>8}")
        worst = plan.worst_stage
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        usable = plan.profile.usable_memory
        lines.append(f"  worst stage {worst.stage}: {_gib(worst.total)} of the "
                     f"{_gib(usable)} GiB a run may fill ({_gib(plan.device_memory)} GiB "
                     f"device; {100 * worst.total / usable:.0f}%): {verdict}")
    if plan.communication:
        lines.append("")
        lines.append("communication per device per step, GiB")
        lines.append(f"  {'stage':>5} {'all-reduce':>11} {'all-gather':>11} "
                     f"{'reduce-scatter':>15} {'send/receive':>13} {'total':>8}")
        for c in plan.communication:
            lines.append(f"  {c.stage:>5} {_gib(c.bytes['all_reduce']):>11} "
                         f"{_gib(c.bytes['all_gather']):>11} "
                         f"{_gib(c.bytes['reduce_scatter']):>15} "
                         f"{_gib(c.bytes['send_receive']):>13} {_gib(c.total):>8}")
        worst = max(plan.communication, key=lambda c: c.total)
        largest = sorted(worst.details.items(), key=lambda item: -item[1][0])[:5]
        if largest:
            lines.append(f"  largest on stage {worst.stage}:")
            for (kind, reason), (amount, count) in largest:
                times = f" ({count} ops)" if count > 1 else ""
                lines.append(f"    {_gib(amount):>8}  {kind.replace('_', '-')}: {reason}{times}")
        pp = parallel.pipeline_stage
        micro = parallel.micro_batch_num * train.grad_accumulation
        lines.append(f"  pipeline bubble: {100 * plan.bubble:.1f}% "
                     f"((pp - 1) / (micro x accumulation + pp - 1) = {pp - 1}/{micro + pp - 1})")
    if plan.compute:
        lines.append("")
        lines.append("compute per device per step, MatMul TFLOP")
        lines.append(f"  {'stage':>5} {'forward':>9} {'backward':>9} {'recompute':>10} "
                     f"{'total':>9}")
        for c in plan.compute:
            lines.append(f"  {c.stage:>5} {c.forward / 1e12:>9.2f} {c.backward / 1e12:>9.2f} "
                         f"{c.recompute / 1e12:>10.2f} {c.total / 1e12:>9.2f}")
    if plan.time:
        lines.extend(format_time(plan))
    lines.append("")
    if plan.violations:
        lines.append(f"violations ({len(plan.violations)}):")
        for violation in plan.violations[:max_violations]:
            lines.append(f"  {violation}")
        if len(plan.violations) > max_violations:
            lines.append(f"  ... and {len(plan.violations) - max_violations} more "
                         f"(--json lists all)")
    verdict = "OK" if plan.ok else "FAILED"
    reasons = failure_reasons(plan, f"{len(plan.violations)} violation(s)")
    lines.append(f"{verdict}" + (": " + "; ".join(reasons) if reasons else ""))
    return "\n".join(lines)


def failure_reasons(plan: Plan, violations: str) -> List[str]:
    """Why `plan` fails: `violations` if it breaks a rule, and the memory it lacks."""
    reasons = [violations] if plan.violations else []
    if plan.memory and not plan.fits:
        reasons.append(f"needs {_gib(plan.worst_stage.total)} GiB per device, a run may "
                       f"fill {_gib(plan.profile.usable_memory)} of {plan.device_name}'s "
                       f"{_gib(plan.device_memory)}")
    return reasons


def format_time(plan: Plan) -> List[str]:
    """The predicted step time (`timing`): per stage, then the step and its throughput."""
    time, profile = plan.time, plan.profile
    micro = plan.config.parallel.micro_batch_num * plan.config.train.grad_accumulation
    lines = ["", f"time per step, seconds (predicted for {profile.name}, "
                 f"{profile.devices_per_server} per server)",
             f"  {'stage':>5} {'compute':>9} {'exposed comm.':>14} {'gradient sync':>14} "
             f"{'optimizer':>10}"]
    for stage in time.stages:
        lines.append(f"  {stage.stage:>5} {stage.compute:>9.3f} "
                     f"{stage.exposed_communication:>14.3f} {stage.gradient_sync:>14.3f} "
                     f"{stage.optimizer:>10.3f}")
    slowest = time.slowest
    per_micro = (slowest.compute + slowest.exposed_communication) / micro
    sync = max(s.gradient_sync + s.optimizer for s in time.stages)
    lines.append(f"  step {time.step:.3f} s = {micro} micro steps x {per_micro:.3f} s "
                 f"(stage {slowest.stage}) + bubble {time.bubble:.3f} s + gradient sync and "
                 f"optimizer {sync:.3f} s")
    lines.append(f"  {time.samples_per_s:,.1f} samples/s, {time.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {100 * time.mfu:.1f}%")
    return lines
