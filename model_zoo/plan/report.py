"""The text of `model-zoo plan`: a plan (`cost.build.build_plan`) as the report prints it,
and why a plan fails (also the launch scripts' layout step, `plan.launch`)."""

from typing import List

from model_zoo.cost.build import Plan


def gib(value: float) -> str:
    return f"{value / 2 ** 30:.2f}"


def count_text(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(int(value))


def format_report(plan: Plan, max_violations: int = 20) -> str:
    config, lines = plan.config, []
    parallel, train, model = config.parallel, config.train, config.model
    on = {True: "on", False: "off"}
    lines.append(f"plan: {plan.config_path or model.name}")
    lines.append(f"  model {model.name}: {count_text(plan.parameter_count)} parameters "
                 f"({model.num_layers} layers, hidden {model.hidden_size}, heads "
                 f"{model.num_heads}, sequence {model.seq_length}, vocabulary {model.vocab_size})")
    lines.append(f"  layout: {plan.device_num} devices; data_parallel {parallel.dp} x "
                 f"model_parallel {parallel.mp} x pipeline_stage {parallel.pipeline_stage} "
                 f"({parallel.devices_per_stage} devices per stage)")
    interleave = (f" in {parallel.pipeline_interleave} interleaved chunks a device "
                  f"({parallel.pipeline_scheduler})" if parallel.pipeline_interleave > 1 else "")
    lines.append(f"          micro batches {parallel.micro_batch_num}{interleave}, optimizer shard "
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
        lines.append(f"memory per device, GiB ({plan.device_name}: {gib(plan.device_memory)})")
        lines.append(f"  {'stage':>5} {'weights':>8} {'copies':>8} {'grads':>8} "
                     f"{'optimizer':>9} {'activ.':>8} {'= micro x n + recomp. + bwd':>26} "
                     f"{'total':>8}")
        for m in plan.memory:
            detail = (f"{gib(m.activations_per_micro_batch)} x {m.micro_batches_in_flight}"
                      f" + {gib(m.recompute_peak)} + {gib(m.backward_working)}")
            lines.append(f"  {m.stage:>5} {gib(m.weights):>8} {gib(m.working_copy):>8} "
                         f"{gib(m.gradients):>8} {gib(m.optimizer):>9} "
                         f"{gib(m.activations):>8} {detail:>26} {gib(m.total):>8}")
        worst = plan.worst_stage
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        usable = plan.profile.usable_memory
        lines.append(f"  worst stage {worst.stage}: {gib(worst.total)} of the "
                     f"{gib(usable)} GiB a run may fill ({gib(plan.device_memory)} GiB "
                     f"device; {100 * worst.total / usable:.0f}%): {verdict}")
    if plan.communication:
        lines.append("")
        lines.append("communication per device per step, GiB")
        lines.append(f"  {'stage':>5} {'all-reduce':>11} {'all-gather':>11} "
                     f"{'reduce-scatter':>15} {'all-to-all':>11} {'send/receive':>13} "
                     f"{'total':>8}")
        for c in plan.communication:
            lines.append(f"  {c.stage:>5} {gib(c.bytes['all_reduce']):>11} "
                         f"{gib(c.bytes['all_gather']):>11} "
                         f"{gib(c.bytes['reduce_scatter']):>15} "
                         f"{gib(c.bytes['all_to_all']):>11} "
                         f"{gib(c.bytes['send_receive']):>13} {gib(c.total):>8}")
        worst = max(plan.communication, key=lambda c: c.total)
        largest = sorted(worst.details.items(), key=lambda item: -item[1][0])[:5]
        if largest:
            lines.append(f"  largest on stage {worst.stage}:")
            for (kind, reason), (amount, count) in largest:
                times = f" ({count} ops)" if count > 1 else ""
                lines.append(f"    {gib(amount):>8}  {kind.replace('_', '-')}: {reason}{times}")
        pp, v = parallel.pipeline_stage, parallel.pipeline_interleave
        micro = parallel.micro_batch_num * train.grad_accumulation * v
        chunks = " x interleave" if v > 1 else ""
        lines.append(f"  pipeline bubble: {100 * plan.bubble:.1f}% "
                     f"((pp - 1) / (micro x accumulation{chunks} + pp - 1) = "
                     f"{pp - 1}/{micro + pp - 1})")
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
        reasons.append(f"needs {gib(plan.worst_stage.total)} GiB per device, a run may "
                       f"fill {gib(plan.profile.usable_memory)} of {plan.device_name}'s "
                       f"{gib(plan.device_memory)}")
    return reasons


def format_time(plan: Plan) -> List[str]:
    """The predicted step time (`timing`): per stage, then the step and its throughput."""
    time, profile = plan.time, plan.profile
    micro = plan.config.parallel.micro_batch_num * plan.config.train.grad_accumulation
    lines = ["", f"time per step, seconds (predicted for {profile.name}, "
                 f"{profile.devices_per_server} per server)",
             f"  {'stage':>5} {'compute':>9} {'exposed comm.':>14} {'gradient sync':>14} "
             f"{'optimizer':>10} {'weight gather':>14}"]
    for stage in time.stages:
        lines.append(f"  {stage.stage:>5} {stage.compute:>9.3f} "
                     f"{stage.exposed_communication:>14.3f} {stage.gradient_sync:>14.3f} "
                     f"{stage.optimizer:>10.3f} {stage.weight_gather:>14.3f}")
    slowest = time.slowest
    per_micro = (slowest.compute + slowest.exposed_communication) / micro
    once = max(s.step_end for s in time.stages)
    lines.append(f"  step {time.step:.3f} s = {micro} micro steps x {per_micro:.3f} s "
                 f"(stage {slowest.stage}) + bubble {time.bubble:.3f} s + once a step "
                 f"(weight gather, gradient sync, optimizer) {once:.3f} s")
    lines.append(f"  {time.samples_per_s:,.1f} samples/s, {time.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {100 * time.mfu:.1f}%")
    return lines


def recompute_text(parallel) -> str:
    """`parallel.recompute` as the report says it, with its per-stage counts and the
    stages' blocks when the config sets them."""
    text = {False: "off", True: "on", "selective": "selective"}[parallel.recompute]
    if parallel.recompute and parallel.recompute_blocks is not None:
        text += f" (blocks per stage {parallel.recompute_blocks})"
    if parallel.stage_blocks is not None:
        text += f", stage blocks {parallel.stage_blocks}"
    return text
