"""`model-zoo advise`: every layout a model and its global batch allow on N devices, checked
against the rules, held against the device's memory and ranked by predicted throughput
(the memory, communication, compute and time models of this package).

Layouts: dp x mp x pp = N with mp dividing the heads and pp the layers (and, for a model
with experts, every expert_parallel dividing dp and the experts); m micro steps per
step, powers of two from 1 (from pp on a pipeline, where they are micro batches; gradient
accumulation otherwise) while the global batch divides; recompute off, selective (the
attention core) and full, on every block, and every fitting fully recomputed layout again
tailored (`Advisor.tailor`: per-stage `recompute_blocks`, uneven `stage_blocks`); the
optimizer shard on and off (dp > 1); sequence parallel on and off (mp > 1); on an Ascend 910B, flash
attention on and off; on a pipeline, 2 interleaved chunks a device as well as one
(`interleaves`: recorded with one chunk a stage, the stage borders' sends made two-fold).
The config's other settings (precision, vocab_emb_dp, dropout) are kept.

What does not change between layouts is recorded once. On N devices dp follows from mp and
pp, and every cost is affine in the per-device micro batch b (activations, their
communication and FLOPs grow with it; weights, their gradients' reduction and the launches
do not) and in the blocks per pipeline stage n (each block adds the same), so the costs
are interpolated exactly from four recordings, of b = u or 2u sequences per device through
n = 1 or 2 blocks per stage, for each (mp, pp, sequence parallel): they serve every micro
batch, micro step count and optimizer shard (u = 1, or the smallest power of two at which
the operators' shape rules hold: `Advisor.unit_batch`). Recompute marks checkpoints on the same
graph, so a layout without it uses those recordings with them cleared.
`tests/test_advisor.py` holds both shortcuts against full plans. The best layouts are then
planned in full (their own recording and every rule) before they are shown.
"""

import dataclasses
import math
import shlex
import time
from typing import Dict, List, Optional

from model_zoo.errors import ConfigError, UserInputError
from model_zoo.cost.communication import estimate_communication, with_interleaved_sends
from model_zoo.cost.compute import estimate_compute
from model_zoo.cost.devices import load_profile
from model_zoo.cost.memory import backward_working_sets, estimate_memory
from model_zoo.cost.timing import StepTime, estimate_time
from model_zoo.layout.network import ascend_training_network, record_training_network
from model_zoo.layout.rules import check_parallel_section, check_recording


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout the advisor scores: the parallel section and the gradient accumulation
    it sets."""

    dp: int
    mp: int
    pp: int
    micro_steps: int
    recompute: object               # False, True or "selective"
    optimizer_shard: bool
    sequence_parallel: bool
    flash_attention: bool = False   # model.flash_attention (Ascend 910B)
    interleave: int = 1             # parallel.pipeline_interleave (interleaved 1F1B)
    stage_blocks: Optional[tuple] = None       # parallel.stage_blocks (None: even stages)
    recompute_blocks: Optional[tuple] = None   # parallel.recompute_blocks (None: all)
    ep: Optional[int] = None        # parallel.expert_parallel (None: a model without experts)

    def apply(self, config):
        """`config` with this layout (a new Config; `config` is not changed)."""
        pipeline = self.pp > 1
        parallel = dataclasses.replace(
            config.parallel, data_parallel=self.dp, model_parallel=self.mp,
            pipeline_stage=self.pp, micro_batch_num=self.micro_steps if pipeline else 1,
            recompute=self.recompute, optimizer_shard=self.optimizer_shard,
            sequence_parallel=self.sequence_parallel,
            recompute_blocks=_listed(self.recompute_blocks),
            stage_blocks=_listed(self.stage_blocks),
            pipeline_interleave=self.interleave, pipeline_scheduler="1f1b",
            expert_parallel=self.ep or 1)
        train = dataclasses.replace(config.train,
                                    grad_accumulation=1 if pipeline else self.micro_steps)
        model = config.model
        if self.flash_attention or model.flash_attention:
            model = dataclasses.replace(model, flash_attention=self.flash_attention)
        return dataclasses.replace(config, parallel=parallel, train=train, model=model)

    def describe(self) -> str:
        recompute = "selective recompute" if self.recompute == "selective" else "recompute"
        if self.recompute_blocks is not None:
            recompute = f"recompute of {'/'.join(map(str, self.recompute_blocks))} blocks a stage"
        options = [name for name, on in ((recompute, self.recompute),
                                         ("optimizer shard", self.optimizer_shard),
                                         ("sequence parallel", self.sequence_parallel),
                                         ("flash attention", self.flash_attention)) if on]
        if self.stage_blocks is not None:
            options.insert(0, f"stage blocks {'/'.join(map(str, self.stage_blocks))}")
        if self.interleave > 1:
            options.insert(0, f"{self.interleave} interleaved chunks")
        if self.pp > 1:
            options.insert(0, f"{self.micro_steps} micro batches")
        elif self.micro_steps > 1:
            options.insert(0, f"{self.micro_steps} accumulation steps")
        experts = f" x ep{self.ep}" if self.ep is not None else ""
        return (f"dp{self.dp} x mp{self.mp} x pp{self.pp}{experts}"
                + "".join(f", {o}" for o in options))

    def overrides(self) -> List[str]:
        pipeline = self.pp > 1
        return [f"parallel.data_parallel={self.dp}", f"parallel.model_parallel={self.mp}",
                f"parallel.pipeline_stage={self.pp}",
                f"parallel.micro_batch_num={self.micro_steps if pipeline else 1}",
                f"train.grad_accumulation={1 if pipeline else self.micro_steps}",
                f"parallel.recompute={str(self.recompute).lower()}",
                f"parallel.optimizer_shard={str(self.optimizer_shard).lower()}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}"] + (
                    ["model.flash_attention=true"] if self.flash_attention else []) + [
                    f"parallel.pipeline_interleave={self.interleave}",
                    "parallel.pipeline_scheduler=1f1b",
                    f"parallel.stage_blocks={_override(self.stage_blocks)}",
                    f"parallel.recompute_blocks={_override(self.recompute_blocks)}"] + (
                    [f"parallel.expert_parallel={self.ep}"] if self.ep is not None else [])


def _listed(blocks: Optional[tuple]) -> Optional[list]:
    return None if blocks is None else list(blocks)


def _override(blocks: Optional[tuple]) -> str:
    """A per-stage list as `--set` writes it (null: the config's default)."""
    return "null" if blocks is None else "[" + ",".join(map(str, blocks)) + "]"


@dataclasses.dataclass
class Scored:
    layout: Candidate
    memory: float                   # worst stage, bytes per device
    time: StepTime
    confirmed: Optional[bool] = None   # planned in full: every rule holds and it fits

    def to_dict(self) -> dict:
        return {"layout": dataclasses.asdict(self.layout), "describe": self.layout.describe(),
                "overrides": self.layout.overrides(), "memory_per_device": self.memory,
                "time": self.time.to_dict(), "confirmed": self.confirmed}


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(config, device_num: int, flash_attention: bool = False) -> List[Candidate]:
    """Every layout of the module docstring for `device_num` devices; with
    `flash_attention` (an Ascend 910B) each also with it on."""
    model, global_batch = config.model, config.train.global_batch_size
    flash = (False, True) if flash_attention else (model.flash_attention,)
    found = []
    for mp in _divisors(device_num):
        if model.num_heads % mp or model.hidden_size % mp:
            continue
        for pp in _divisors(device_num // mp):
            dp = device_num // (mp * pp)
            if model.num_layers % pp or global_batch % dp:
                continue
            micro = pp if pp > 1 else 1
            while (global_batch // dp) % micro == 0:
                for recompute in (False, "selective", True):
                    for shard in ((False, True) if dp > 1 else (False,)):
                        for sequence in ((False, True) if mp > 1 else (False,)):
                            # flash attention keeps no (seq x seq) tensor: selective
                            # recompute would mark nothing
                            found.extend(Candidate(dp, mp, pp, micro, recompute, shard,
                                                   sequence, on, interleave, ep=ep)
                                         for on in flash
                                         for interleave in interleaves(model, pp, micro)
                                         for ep in expert_parallels(model, dp)
                                         if not (on and recompute == "selective"))
                micro *= 2
    return found


def expert_parallels(model, dp: int) -> List[Optional[int]]:
    """The expert_parallel values tried: every divisor of dp that divides the experts, for
    a model with experts (`model.num_experts`); [None] for one without."""
    experts = getattr(model, "num_experts", 0)
    if not experts:
        return [None]
    return _divisors(math.gcd(dp, experts))


def interleaves(model, pp: int, micro_steps: int) -> List[int]:
    """The pipeline_interleave values tried: 1, and 2 on a pipeline whose layers cut into
    2 pp chunks and whose micro batches fill the stages in whole rounds (m a multiple of
    pp, as Megatron's interleaved schedule asks)."""
    if pp > 1 and model.pipeline_blocks % (2 * pp) == 0 and micro_steps % pp == 0:
        return [1, 2]
    return [1]


class Advisor:
    """Scores layouts of one config on one device profile, recording each shape once."""

    def __init__(self, config, device: str = "ascend910", devices_per_server: int = 0):
        if getattr(config.model, "moe_layer_freq", 1) > 1:
            raise UserInputError(
                f"model.moe_layer_freq={config.model.moe_layer_freq}: the advisor prices a "
                f"stage from one and two alike blocks, and this model alternates dense and "
                f"expert blocks; check its layouts with `model-zoo plan`")
        self.config = config
        self.profile = load_profile(device, devices_per_server)
        self.recordings: Dict[tuple, object] = {}
        self.recording_seconds = 0.0
        # a layout's estimates at the recordings' corners, by (layout, recompute): scoring
        # and tailoring ask for them with several stage blocks
        self.corners: Dict[tuple, dict] = {}

    def recording(self, layout: Candidate, micro_batch: int, blocks: int, recompute):
        """The recording of `micro_batch` sequences per device through `blocks` blocks per
        pipeline stage, with recompute as `recompute` says (off: a recording with its
        checkpoints cleared), and the violations its strategies have; cached by what shapes
        it."""
        selective = recompute == "selective"
        key = (layout.dp, layout.mp, layout.pp, layout.sequence_parallel,
               layout.flash_attention, layout.ep, micro_batch, blocks, selective)
        if key not in self.recordings:
            started = time.perf_counter()
            shape = dataclasses.replace(layout, micro_steps=max(layout.pp, 1),
                                        recompute="selective" if selective else True,
                                        optimizer_shard=False, interleave=1,
                                        stage_blocks=None, recompute_blocks=None)
            config = shape.apply(self.config)
            config = dataclasses.replace(
                config, model=dataclasses.replace(config.model, num_layers=blocks * layout.pp),
                train=dataclasses.replace(
                    config.train, global_batch_size=layout.dp * micro_batch * shape.micro_steps,
                    grad_accumulation=1))
            try:
                network = ascend_training_network(config)
            except ConfigError as err:   # a layer refuses the layout (e.g. flash attention
                self.recordings[key] = (None, None, [str(err)])   # with dropout)
                return None, [str(err)]
            rec = record_training_network(config, network)
            violations = check_recording(rec, config.parallel, config.parallel.device_num)
            self.recordings[key] = (rec, without_recompute(rec), violations)
            self.recording_seconds += time.perf_counter() - started
        rec, cleared, violations = self.recordings[key]
        return (rec if recompute else cleared), violations

    def unit_batch(self, layout: Candidate, micro_batch: int) -> Optional[int]:
        """The smallest power of two dividing `micro_batch` at which the layout's operators
        keep every rule, or None when none does (then `micro_batch` breaks one too). The
        rules on shapes are divisibility: what holds at u holds at every multiple of u, so
        recordings at u and 2u stand for the micro batch."""
        unit = 1
        while micro_batch % unit == 0:
            if not any(self.recording(layout, batch, blocks, True)[1]
                       for batch in (unit, 2 * unit) for blocks in (1, 2)):
                return unit
            unit *= 2
        return None

    def fix_backward_working(self, memory, layout: Candidate, unit: int, x: float, recompute):
        """Set each stage's backward working set W_k, the largest of its calls' (each affine
        in the micro batch, but their largest is not: a weight's gradient can lead at a
        small batch and an activation's at a large one), from the calls of the one-block
        recordings at u and 2u sequences (blocks repeat, so one is enough)."""
        at_unit, at_double = (backward_working_sets(self.recording(
            layout, batch, 1, recompute)[0]) for batch in (unit, 2 * unit))
        working = {}
        for (stage, low), (_, high) in zip(at_unit, at_double):
            working[stage] = max(working.get(stage, 0.0), low + (x - 1) * (high - low))
        for stage in memory:
            stage.backward_working = working.get(stage.stage, 0.0)
            stage.add_up_activations()

    def score(self, layout: Candidate) -> Optional[Scored]:
        """The layout's worst-stage memory and predicted time, or None when it breaks a
        rule (of the layout, or of its operators' strategies)."""
        config = layout.apply(self.config)
        parallel, train = config.parallel, config.train
        if check_parallel_section(parallel, parallel.device_num, config.model.pipeline_blocks,
                                  train.global_batch_size, train.grad_accumulation,
                                  config.model.seq_length):
            return None
        micro_batch = train.global_batch_size // (layout.dp * layout.micro_steps)
        unit = self.unit_batch(layout, micro_batch)
        if unit is None:
            return None
        blocks = parallel.blocks_per_stage(config.model.pipeline_blocks)
        memory, communication, compute = self.estimates(layout, config, unit, blocks,
                                                        layout.recompute)
        if layout.recompute_blocks is not None:   # the first r_k blocks of stage k
            # one recomputed block's activations (R_k), whatever r_k > 0 is
            peaks = [stage.recompute_peak for stage in memory]
            cleared = self.estimates(layout, config, unit, blocks, False)
            memory, communication, compute = (
                [affine(none, every, 1 + r / n) for none, every, r, n
                 in zip(without, with_all, layout.recompute_blocks, blocks)]
                for without, with_all in zip(cleared, (memory, communication, compute)))
            for stage, r, peak in zip(memory, layout.recompute_blocks, peaks):
                stage.recompute_peak = peak if r else 0.0
                stage.add_up_activations()
        step = estimate_time(compute, communication, memory, parallel, train.precision,
                             train.global_batch_size, config.model.seq_length,
                             self.profile, layout.micro_steps)
        return Scored(layout, max(m.total for m in memory), step)

    def estimates(self, layout: Candidate, config, unit: int, blocks: List[int], recompute):
        """(memory, communication, compute) per stage, stage k through blocks[k] blocks,
        interpolated from the recordings of u and 2u sequences through 1 and 2 blocks a
        stage (module docstring), recomputed as `recompute` says."""
        parallel, train = config.parallel, config.train
        micro_batch = train.global_batch_size // (layout.dp * layout.micro_steps)
        key = (dataclasses.replace(layout, stage_blocks=None, recompute_blocks=None),
               recompute)
        if key not in self.corners:
            corners = self.corners[key] = {}
            for batch in (unit, 2 * unit):
                for depth in (1, 2):
                    rec, _ = self.recording(layout, batch, depth, recompute)
                    corners[batch // unit, depth] = (
                        estimate_memory(rec, parallel, train.grad_accumulation),
                        with_interleaved_sends(estimate_communication(
                            rec, parallel, train.grad_accumulation), layout.interleave),
                        estimate_compute(rec, parallel, train.grad_accumulation))
        corners = self.corners[key]
        one, two = (affine(corners[1, depth], corners[2, depth], micro_batch / unit)
                    for depth in (1, 2))
        found = tuple([affine(a, b, n) for a, b, n in zip(at_one, at_two, blocks)]
                      for at_one, at_two in zip(one, two))
        self.fix_backward_working(found[0], layout, unit, micro_batch / unit, recompute)
        return found

    def tailor(self, layout: Candidate) -> Optional[Candidate]:
        """A fully recomputed layout with each stage's recomputed blocks cut to what its
        memory needs (an early 1F1B stage holds more micro batches in flight than a late
        one) and, on a pipeline of one chunk a device, blocks moved between stages while
        the step shortens (a last stage that also holds the vocabulary head takes fewer):
        MindFormers' per-stage `recompute` lists and `offset`, as `recompute_blocks` and
        `stage_blocks`. None when nothing changes or nothing fits. The search runs on the
        stages' memory and micro-step time, affine in their blocks and recomputed blocks;
        `score` then scores the layout it finds as any other."""
        if layout.recompute is not True or layout.recompute_blocks or layout.stage_blocks:
            return None
        config = layout.apply(self.config)
        micro_batch = config.train.global_batch_size // (layout.dp * layout.micro_steps)
        unit = self.unit_batch(layout, micro_batch)
        if unit is None:
            return None
        pp, total = layout.pp, config.model.pipeline_blocks
        # per stage: (memory, micro-step time, step-end time) at 1 and 2 blocks, without
        # and with every block recomputed
        figures = {}
        for recompute in (False, True):
            for depth in (1, 2):
                memory, communication, compute = self.estimates(layout, config, unit,
                                                                [depth] * pp, recompute)
                time = estimate_time(compute, communication, memory, config.parallel,
                                     config.train.precision, config.train.global_batch_size,
                                     config.model.seq_length, self.profile,
                                     layout.micro_steps)
                figures[recompute, depth] = [
                    (m.total, m.recompute_peak, (s.compute + s.exposed_communication)
                     / layout.micro_steps, s.step_end)
                    for m, s in zip(memory, time.stages)]
        cap = self.profile.usable_memory

        def at(recompute, k, n, field):
            return affine(figures[recompute, 1][k][field], figures[recompute, 2][k][field], n)

        def recomputed(k, n) -> Optional[int]:
            """The fewest of stage k's n blocks to recompute for it to fit."""
            none = at(False, k, n, 0)
            if none <= cap:
                return 0
            peak = at(True, k, n, 1)
            saved = (none - (at(True, k, n, 0) - peak)) / n   # per recomputed block
            if saved <= 0:
                return None
            r = max(1, math.ceil((none + peak - cap) / saved - 1e-9))
            return r if r <= n else None

        def step(stages) -> Optional[tuple]:
            chosen = [recomputed(k, n) for k, n in enumerate(stages)]
            if None in chosen:
                return None
            micro = [at(False, k, n, 2) + r / n * (at(True, k, n, 2) - at(False, k, n, 2))
                     for k, (n, r) in enumerate(zip(stages, chosen))]
            end = max(at(False, k, n, 3) for k, n in enumerate(stages))
            return ((sum(micro) - max(micro)) / layout.interleave
                    + layout.micro_steps * max(micro) + end), chosen

        stages = [total // pp] * pp
        best = step(stages)
        while best is not None and pp > 1 and layout.interleave == 1:
            moves = [stages[:i] + [stages[i] - 1] + stages[i + 1:] for i in range(pp)
                     if stages[i] > 1]
            moves = [[n + (k == j) for k, n in enumerate(m)] for m in moves for j in range(pp)
                     if sum(m) < total]
            tried = [(step(m), m) for m in moves]
            tried = [(found, m) for found, m in tried if found and found[0] < best[0]]
            if not tried:
                break
            best, stages = min(tried, key=lambda item: item[0][0])
        if best is None:
            return None
        chosen = tuple(best[1])
        even = all(n == total // pp for n in stages)
        if even and (chosen == tuple(stages) or not any(chosen)):
            return None   # every block recomputed or none: a layout tried as it is
        return dataclasses.replace(
            layout, recompute=any(chosen), stage_blocks=None if even else tuple(stages),
            recompute_blocks=chosen if any(chosen) else None)


def affine(at_one, at_two, x: float):
    """at_one + (x - 1) (at_two - at_one): the value at x of what is at_one at 1 and at_two
    at 2, through the cost estimates' dataclasses, lists and dicts (dicts whose reasons name
    a shape pair up in order, keeping the keys of `at_two`); values equal in both (a stage's
    index, a group) stay as they are."""
    if isinstance(at_one, bool) or at_one == at_two:
        return at_one
    if isinstance(at_one, (int, float)):
        return at_one + (x - 1) * (at_two - at_one)
    if isinstance(at_one, (list, tuple, dict)) and len(at_one) != len(at_two):
        raise ValueError("the two estimates differ in their items: not affine")
    if isinstance(at_one, (list, tuple)):
        return type(at_one)(affine(a, b, x) for a, b in zip(at_one, at_two))
    if isinstance(at_one, dict):
        return {key: affine(a, b, x) for (key, b), a in zip(at_two.items(), at_one.values())}
    if dataclasses.is_dataclass(at_one):
        return dataclasses.replace(at_one, **{
            f.name: affine(getattr(at_one, f.name), getattr(at_two, f.name), x)
            for f in dataclasses.fields(at_one)})
    return at_two


def without_recompute(rec):
    """The recording of the same graph without recomputed cells."""
    calls = [dataclasses.replace(call, recompute_root=None) for call in rec.calls]
    return dataclasses.replace(rec, calls=calls, checkpoints={})


@dataclasses.dataclass
class Advice:
    """What `model-zoo advise` found: counts, and the best layouts planned in full."""

    device_num: int
    profile: object
    layouts: int
    breaking_rules: int
    not_fitting: int
    fitting: int
    recordings: int
    recording_seconds: float
    seconds: float
    best: List[Scored]

    def to_dict(self) -> dict:
        return {"device_num": self.device_num, "device": self.profile.name,
                "devices_per_server": self.profile.devices_per_server,
                "memory_per_device": self.profile.memory,
                "usable_memory_per_device": self.profile.usable_memory, "layouts": self.layouts,
                "breaking_rules": self.breaking_rules, "not_fitting": self.not_fitting,
                "fitting": self.fitting, "recordings": self.recordings,
                "recording_seconds": self.recording_seconds, "seconds": self.seconds,
                "top": [s.to_dict() for s in self.best]}


def advise(config, device_num: int, device: Optional[str] = None, devices_per_server: int = 0,
           top: int = 5) -> Advice:
    """Score every layout, keep those that fit, rank them by samples/s and plan the best
    `top` in full (a layout the full plan refuses is replaced by the next one)."""
    from model_zoo.cost.build import build_plan, default_device
    device = device or default_device(config)
    if device_num < 1:
        raise UserInputError(f"--device-num must be >= 1, got {device_num}")
    if top < 1:
        raise UserInputError(f"--top must be >= 1, got {top}")
    started = time.perf_counter()
    advisor = Advisor(config, device, devices_per_server)
    candidates = layouts(config, device_num, flash_attention=device == "ascend910b")
    scored, broken, too_big = [], 0, 0
    for layout in candidates:   # grows by the layouts `tailor` derives
        result = advisor.score(layout)
        if result is None:
            broken += 1
            continue
        if result.memory > advisor.profile.usable_memory:   # the plan's `fits`
            too_big += 1
            continue
        scored.append(result)
        tailored = advisor.tailor(layout)   # recompute only where memory needs it
        if tailored is not None:
            candidates.append(tailored)
    scored.sort(key=lambda s: -s.time.samples_per_s)
    best = []
    for result in scored:
        if len(best) == top:
            break
        plan = build_plan(result.layout.apply(config), device=device,
                          devices_per_server=devices_per_server)
        result.confirmed = plan.ok
        if plan.ok:   # the full plan's own figures
            result.time, result.memory = plan.time, plan.worst_stage.total
            best.append(result)
    best.sort(key=lambda s: -s.time.samples_per_s)
    return Advice(device_num, advisor.profile, len(candidates), broken, too_big, len(scored),
                  len(advisor.recordings), advisor.recording_seconds,
                  time.perf_counter() - started, best)


def format_advice(advice: Advice, config_path: str) -> str:
    """The text `model-zoo advise` prints: counts, the ranked layouts, why the best wins."""
    gib, profile = 2 ** 30, advice.profile
    lines = [f"advise: {config_path} on {advice.device_num} x {profile.name} "
             f"({profile.devices_per_server} per server, {profile.memory / gib:.2f} GiB each, "
             f"{profile.usable_memory / gib:.2f} a run may fill)",
             f"  {advice.layouts} layouts: {advice.breaking_rules} break a rule, "
             f"{advice.not_fitting} do not fit, {advice.fitting} fit; "
             f"{advice.recordings} recordings in {advice.recording_seconds:.1f} s, "
             f"{advice.seconds:.1f} s in all", ""]
    if not advice.best:
        lines.append("no layout fits: more devices, a smaller global batch, or a device with "
                     "more memory")
        return "\n".join(lines)
    lines.append(f"  {'rank':>4} {'samples/s':>10} {'tokens/s':>11} {'MFU':>6} {'step s':>8} "
                 f"{'compute':>8} {'comm.':>7} {'bubble':>7} {'GiB':>6}  layout")
    for rank, result in enumerate(advice.best, 1):
        t = result.time.to_dict()
        lines.append(f"  {rank:>4} {t['samples_per_s']:>10.1f} {t['tokens_per_s']:>11,.0f} "
                     f"{100 * t['mfu']:>5.1f}% {t['step_s']:>8.3f} {t['compute_s']:>8.3f} "
                     f"{t['communication_s']:>7.3f} {t['bubble_s']:>7.3f} "
                     f"{result.memory / gib:>6.2f}  {result.layout.describe()}")
    lines.append("")
    lines.append("why the best wins: " + why_best(advice.best))
    lines.append("best: " + " ".join(f"--set {shlex.quote(o)}"
                                     for o in advice.best[0].layout.overrides()))
    return "\n".join(lines)


def why_best(best: List[Scored]) -> str:
    """The parts of the step the best layout saves against the runner-up."""
    if len(best) < 2:
        return "it is the only layout that fits and keeps every rule"
    first, second = best[0].time.to_dict(), best[1].time.to_dict()
    parts = {"compute": "compute_s", "communication": "communication_s",
             "pipeline bubble": "bubble_s", "optimizer": "optimizer_s"}
    saved = sorted(((second[key] - first[key], name) for name, key in parts.items()),
                   reverse=True)
    text = ", ".join(f"{name} {_seconds(-delta, sign=True)}" for delta, name in saved
                     if abs(delta) >= 1e-3 * second["step_s"])
    return (f"against #2 ({best[1].layout.describe()}), a step of "
            f"{_seconds(first['step_s'])} instead of {_seconds(second['step_s'])}: "
            + (text or "the same parts, within 0.1%"))


def _seconds(value: float, sign: bool = False) -> str:
    form = "+" if sign else ""
    return (f"{value * 1e3:{form}.2f} ms" if abs(value) < 1 else f"{value:{form}.3f} s")
