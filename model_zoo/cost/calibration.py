"""Published throughput measurements against the time model: read them, plan every row's
layout, predict its samples/s with a device profile, fit a profile's free constants, and
check the fit on what it was not fitted on (leave one group out).

`measurements/libai_a100.csv` holds the 42 runs LiBai v0.2.0 published for BERT-large and
GPT-2-medium shapes on A100s (docs/source/tutorials/get_started/Benchmark.md of
Oneflow-Inc/libai: data, tensor and pipeline parallel alone, two axes and three axes, 1-32
GPUs; columns in model_zoo/cost/measurements/README.md). A row becomes the project's
bert-large / gpt2-1024 config with the row's layers, layout and batch: pipeline runs take
the micro steps as micro batches, the others as gradient accumulation.
"""

import csv
import dataclasses
import os

MEASUREMENTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measurements")
MEASUREMENTS = os.path.join(MEASUREMENTS_DIR, "libai_a100.csv")
ASCEND_FILES = [os.path.join(MEASUREMENTS_DIR, name)
                for name in ("ascend_calibration.csv", "ascend_910b_runs.csv")]
# the rows each profile may be fitted on (each run carries its device: a file serves both
# Ascend profiles)
DEVICE_MEASUREMENTS = {"a100": [MEASUREMENTS], "ascend910": ASCEND_FILES,
                       "ascend910b": ASCEND_FILES}
# rows never fitted on, only predicted: MindFormers' own LLaMA-2 / LLaMA-3 / LLaMA-3.1
# tables (measurements/README.md)
DEVICE_CHECKS = {"ascend910b": [os.path.join(MEASUREMENTS_DIR,
                                             "mindformers_llama_check.csv")]}
LIBAI_CONFIGS = {"BERT": "model_zoo/bert/configs/bert-large.yaml",
                 "GPT-2": "model_zoo/gpt2/configs/gpt2-1024.yaml"}
# an Ascend row's family: the shipped config whose model it is (PanGu-alpha is a GPT-2
# shaped decoder; Baichuan2-7B a LLaMA-2 7B with a larger vocabulary)
FAMILY_CONFIGS = {"gpt2": "model_zoo/gpt2/configs/gpt2-1024.yaml",
                  "pangu-alpha": "model_zoo/gpt2/configs/gpt2-1024.yaml",
                  "baichuan2": "model_zoo/llama/configs/plan/llama2-7b-d1m8p1.yaml",
                  "bert": "model_zoo/bert/configs/bert-base.yaml",
                  "transformer": "model_zoo/transformer/configs/transformer-big.yaml",
                  "llama": "model_zoo/llama/configs/plan/llama2-7b-d1m8p1.yaml",
                  "llama2": "model_zoo/llama/configs/plan/llama2-7b-d1m8p1.yaml",
                  "llama3": "model_zoo/llama/configs/plan/llama2-7b-d1m8p1.yaml"}
LLAMA_FAMILIES = ("llama", "llama2", "llama3", "baichuan2")
ASCEND_DEVICES = {"Ascend 910": "ascend910", "Ascend 910A": "ascend910",
                  "Ascend 910 64GB": "ascend910b", "910B": "ascend910b",
                  "Atlas 800T A2": "ascend910b", "Atlas 900 A2 PoDc": "ascend910b"}


@dataclasses.dataclass
class Run:
    """One published measurement as a run of a shipped config."""
    name: str
    model: str                # with the device count, the group the run is compared in
    config: str               # the shipped config it runs
    overrides: list           # `--set` overrides that make it the measured run
    device: str               # device profile key
    devices_per_server: int
    devices: int
    layout: str               # dp x mp x pp
    samples_per_s: float      # measured
    exact: bool = True        # False: its lengths vary below seq_length (bucketed), so its
                              # work is not known and it only checks the fit
    check: bool = False       # from a file of runs kept apart: never fitted on
    workload: str = ""        # with the device count, the rows whose layouts are compared
                              # (which is fastest); default: the model


def read_rows(path: str = MEASUREMENTS, check: bool = False) -> list:
    """The runs of a measurements file: LiBai's columns or the Ascend files'."""
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    runs = [ascend_run(row) if "figure" in row else libai_run(row) for row in rows]
    for run in runs:
        run.check = check
    return runs


def device_runs(device: str, paths=None) -> list:
    """The runs a profile is fitted on and checked with (`paths`: other files instead),
    those of other devices left out."""
    runs = []
    if paths:
        runs = [run for path in paths for run in read_rows(path)]
    else:
        runs = ([run for path in DEVICE_MEASUREMENTS[device] for run in read_rows(path)]
                + [run for path in DEVICE_CHECKS.get(device, ())
                   for run in read_rows(path, check=True)])
    return [run for run in runs if run.device == device]


def layout_overrides(dp, mp, pp, micro_batches, recompute, optimizer_shard, global_batch,
                     accumulation, precision="fp16") -> list:
    """The `--set` overrides of a measured run's layout and batch."""
    return [f"parallel.data_parallel={dp}", f"parallel.model_parallel={mp}",
            f"parallel.pipeline_stage={pp}", f"parallel.micro_batch_num={micro_batches}",
            f"parallel.recompute={str(recompute).lower()}",
            f"parallel.optimizer_shard={str(optimizer_shard).lower()}",
            f"train.global_batch_size={global_batch}", f"train.grad_accumulation={accumulation}",
            f"train.precision={precision}"]


def libai_stage_blocks(layers: int, pp: int) -> list:
    """The blocks LiBai puts on each pipeline stage when the config names none (its
    `auto_pipeline_stage_id`, `_DistributeUtil._init_placement_group` in
    libai/utils/distributed.py): with 4 or more stages it lays out layers + min(pp - 1,
    layers / pp) slots, later stages a slot more, and cuts the list at the real layers, so
    the last stage, which also holds the head and the loss, gets fewer blocks (24 layers on
    4 stages: 6, 7, 7, 4). A stage left with none keeps one here (our stages hold a block at
    least), taken from the stage before it."""
    if pp < 4 or layers < 8 or layers % pp:
        return [layers // pp] * pp
    slots = layers + min(pp - 1, layers // pp)
    per_stage, later = slots // pp, slots % pp
    owners = []
    for stage in range(pp):
        owners += [stage] * (per_stage + (stage >= pp - later))
    blocks = [owners[:layers].count(stage) for stage in range(pp)]
    for stage in range(pp - 1, 0, -1):
        if blocks[stage] == 0:
            blocks[stage], blocks[stage - 1] = 1, blocks[stage - 1] - 1
    return blocks


def libai_run(row: dict) -> Run:
    dp, tp, pp = int(row["dp"]), int(row["tp"]), int(row["pp"])
    micro_steps = int(row["global_batch"]) // (int(row["micro_batch"]) * dp)
    overrides = [f"model.num_layers={row['layers']}"] + layout_overrides(
        dp, tp, pp, micro_steps if pp > 1 else 1, row["recompute"] == "1", False,
        int(row["global_batch"]), 1 if pp > 1 else micro_steps)
    if pp > 1:
        blocks = libai_stage_blocks(int(row["layers"]), pp)
        overrides.append(f"parallel.stage_blocks=[{','.join(map(str, blocks))}]")
    return Run(f"{row['model']} {row['config']}", row["model"], LIBAI_CONFIGS[row["model"]],
               overrides, "a100", int(row["gpus_per_node"]),
               int(row["nodes"]) * int(row["gpus_per_node"]), f"{dp}x{tp}x{pp}",
               float(row["samples_per_s"]))


def ascend_run(row: dict) -> Run:
    """A row of the Ascend files (columns in model_zoo/cost/measurements/README.md): its
    model's dimensions set on the family's config; the vocabulary rounded up to a multiple
    of 128 (as Megatron pads it) so that every model-parallel split divides it; per-stage
    recompute lists (`selective:a/b/...`: the first a blocks of stage 0 recomputed, ...),
    uneven stages and interleaved chunks as the run set them."""
    dp, mp, pp = int(row["dp"]), int(row["mp"]), int(row["pp"])
    accumulation = int(row["grad_accum"] or 1) if pp == 1 else 1
    micro_batches = int(row["micro_batch_num"] or 1) if pp > 1 else 1
    global_batch = int(row["global_batch"])
    seq, devices = int(row["seq"]), int(row["devices"])
    if row["unit"] == "tokens/s/p":
        samples_per_s = float(row["figure"]) * devices / seq
    else:   # ms/step
        samples_per_s = global_batch / (float(row["figure"]) / 1000)
    recompute = row["recompute"]
    flash = row["flash_attention"] == "TRUE"
    overrides = [
        f"model.num_layers={row['layers']}", f"model.hidden_size={row['hidden']}",
        f"model.num_heads={row['heads']}", f"model.seq_length={seq}",
        f"model.vocab_size={-(-int(row['vocab']) // 128) * 128}"] + layout_overrides(
        dp, mp, pp, micro_batches,
        "selective" if recompute == "selective" else recompute not in ("", "none"),
        row["optimizer_shard"] == "TRUE", global_batch, accumulation,
        "bf16" if row["precision"] == "bf16" else "fp16")
    if recompute.startswith("selective:"):
        overrides.append(f"parallel.recompute_blocks=[{recompute[10:].replace('/', ',')}]")
    overrides.append(f"parallel.sequence_parallel="
                     f"{str(mp > 1 and row['seq_parallel'] == 'TRUE').lower()}")
    interleave = int(row.get("pp_interleave") or 1)
    stages = [int(n) for n in (row.get("stage_blocks") or "").split("/") if n.strip()]
    if pp > 1 and interleave > 1:
        overrides.append(f"parallel.pipeline_interleave={interleave}")
    elif pp > 1 and len(stages) == pp and len(set(stages)) > 1:
        overrides.append(f"parallel.stage_blocks=[{','.join(map(str, stages))}]")
    if row["family"] in LLAMA_FAMILIES + ("transformer",):
        overrides.append(f"model.ffn_hidden_size={row['ffn']}")
    if row["family"] in LLAMA_FAMILIES:
        overrides.append(f"model.num_kv_heads={row['kv_heads']}")
    if flash:   # FlashAttentionScore takes no attention dropout (the runs have none)
        overrides += ["model.flash_attention=true", "model.attention_dropout=0.0"]
    elif row["family"] in LLAMA_FAMILIES:
        overrides.append("model.flash_attention=false")
    grouped = row["family"] not in LLAMA_FAMILIES and row["kv_heads"] not in ("", row["heads"])
    return Run(f"{row['model']} ({row['device']})", row["model"].split()[0],
               FAMILY_CONFIGS[row["family"]], overrides, ASCEND_DEVICES[row["device"]], 8,
               devices, f"{dp}x{mp}x{pp}", samples_per_s,
               # the Transformer's batches are bucketed to 16-128 tokens; a sliding window
               # computes less attention than the causal one the model counts; GPT-2 has
               # no grouped key/value heads to run a multi-query model's
               exact=(row["family"] != "transformer" and not grouped
                      and "sliding" not in row.get("notes", "")),
               workload=f"{row['model']}, {seq} tokens")


def plan_rows(runs: list) -> list:
    """(run, plan) for every run, planned with its device's profile."""
    from model_zoo.config import load_config
    from model_zoo.cost.build import build_plan
    planned = []
    for run in runs:
        config = load_config(run.config, run.overrides, layout_checked=False)
        planned.append((run, build_plan(config, run.config, device=run.device,
                                        devices_per_server=run.devices_per_server)))
    return planned


def fitting_runs(planned: list, profile) -> list:
    """The (run, plan) pairs `profile`'s constants are fitted on (`DeviceProfile.fitted_on`):
    the runs of known work not kept apart as checks, all of them or only the data-parallel
    ones."""
    return [(run, plan) for run, plan in planned if run.exact and not run.check and (
        profile.fitted_on == "all" or run.layout.endswith("x1x1"))]


def axes(run) -> int:
    """How many of data, model and pipeline parallel a run uses (more than one way)."""
    return sum(int(size) > 1 for size in run.layout.split("x"))


def single_axis_fit(planned: list, profile, names) -> tuple:
    """The runs of two or more axes predicted by a fit on the runs of one axis (or none):
    (relative error of every row, None for the rows fitted on; {group: whether its
    fastest multi-axis layout is predicted fastest}; every error None and {} when there is
    nothing to fit on or nothing to predict."""
    fitted_on = [(run, plan) for run, plan in fitting_runs(planned, profile) if axes(run) < 2]
    predicted = [(run, plan) for run, plan in planned if axes(run) >= 2]
    if not fitted_on or not predicted or not names:
        return [None] * len(planned), {}
    fitted = with_constants(profile, fit(fitted_on, profile, names))
    found = dict(zip((id(plan) for _, plan in predicted), errors(predicted, fitted)))
    return ([found.get(id(plan)) for _, plan in planned],
            fastest_agree(predicted, fitted))


def predict(plan, profile) -> float:
    """Samples/s of a plan's layout on `profile` (the plan's own profile by default)."""
    from model_zoo.cost.timing import estimate_time
    config = plan.config
    profile = dataclasses.replace(profile, devices_per_server=plan.profile.devices_per_server)
    return estimate_time(plan.compute, plan.communication, plan.memory, config.parallel,
                         config.train.precision, config.train.global_batch_size,
                         config.model.seq_length, profile,
                         config.parallel.micro_batch_num * config.train.grad_accumulation
                         ).samples_per_s


def errors(planned: list, profile) -> list:
    """Relative error (predicted / measured - 1) of every planned row."""
    return [predict(plan, profile) / run.samples_per_s - 1 for run, plan in planned]


# the constants a profile may fit: (where in the profile, name in its YAML)
FREE = {"inside_server.bandwidth_gbs": ("inside_server", "bandwidth", 1e9),
        "between_servers.bandwidth_gbs": ("between_servers", "bandwidth", 1e9),
        "matmul": (None, "matmul_efficiency", 1), "attention": (None, "attention_efficiency", 1),
        "memory_bound": (None, "memory_efficiency", 1),
        "kernel_overhead_us": (None, "kernel_overhead", 1e-6)}


def with_constants(profile, values: dict):
    """`profile` with the fitted constants `values` ({YAML name: value in YAML units})."""
    for name, value in values.items():
        link, attribute, unit = FREE[name]
        if link is None:
            profile = dataclasses.replace(profile, **{attribute: value * unit})
        else:
            moved = dataclasses.replace(getattr(profile, link), **{attribute: value * unit})
            profile = dataclasses.replace(profile, **{link: moved})
    return profile


def constants_of(profile, names) -> dict:
    found = {}
    for name in names:
        link, attribute, unit = FREE[name]
        holder = profile if link is None else getattr(profile, link)
        found[name] = getattr(holder, attribute) / unit
    return found


def fit(planned: list, profile, names, iterations: int = 100) -> dict:
    """The values of the constants `names` that minimise the squared log errors of the
    predicted samples/s: Levenberg-Marquardt on the logarithms of the constants, with a
    numerical Jacobian (20 rows and 4 constants: each evaluation is arithmetic on the
    plans, no new recording)."""
    import numpy as np
    start = constants_of(profile, names)
    theta = np.log([start[name] for name in names])

    def residuals(point):
        values = dict(zip(names, np.exp(point)))
        return np.log1p(errors(planned, with_constants(profile, values)))

    current, damping = residuals(theta), 1e-3
    for _ in range(iterations):
        jacobian = np.stack([(residuals(theta + h) - current) / 1e-6
                             for h in np.eye(len(theta)) * 1e-6], axis=1)
        normal = jacobian.T @ jacobian
        gradient = jacobian.T @ current
        while damping < 1e12:
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12),
                                   -gradient)
            trial = residuals(theta + step)
            if trial @ trial < current @ current:
                theta, current, damping = theta + step, trial, damping / 3
                break
            damping *= 4
        else:
            break
        if np.abs(step).max() < 1e-7:
            break
    return dict(zip(names, (float(v) for v in np.exp(theta))))


def spearman(first: list, second: list) -> float:
    """Spearman's rank correlation of two equally long lists (no ties expected)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        found = [0] * len(values)
        for rank, index in enumerate(order):
            found[index] = rank
        return found
    a, b, n = ranks(first), ranks(second), len(first)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def groups(planned: list, workloads: bool = False) -> dict:
    """{(model, devices): [(row, plan), ...]}: the rows one model ran on one device count;
    with `workloads`, keyed by the run's workload instead (the rows whose layouts are
    compared: a published table's runs of one model at other lengths are not a choice)."""
    found = {}
    for run, plan in planned:
        key = (run.workload or run.model) if workloads else run.model
        found.setdefault((key, run.devices), []).append((run, plan))
    return found


def fastest_agree(planned: list, profile) -> dict:
    """{group: whether the layout predicted fastest is the one measured fastest}, for the
    groups of more than one layout (rows of one configuration, e.g. the same run on two
    server types, are not a choice between layouts)."""
    return {key: _fastest_agree(members, profile)
            for key, members in groups(planned, workloads=True).items() if _choice(members)}


def _choice(members: list) -> bool:
    return len({tuple(run.overrides) for run, _ in members}) > 1


def _fastest_agree(members: list, profile) -> bool:
    measured = max(members, key=lambda m: m[0].samples_per_s)
    predicted = max(members, key=lambda m: predict(m[1], profile))
    return measured[0].overrides == predicted[0].overrides


def leave_one_group_out(planned: list, profile, names) -> tuple:
    """Each (model, devices) group predicted by a fit on the other groups' rows (those
    `fitting_runs` allows): (the relative error of every row, in `planned`'s order;
    {group: whether its predicted fastest layout is its measured fastest}, for groups of
    more than one row; the same among the group's layouts of two or three axes). A group
    whose rows are all the fit has is not predicted: None."""
    found, agree, agree_multi = {}, {}, {}
    for key, members in groups(planned).items():
        held_out = {id(plan) for _, plan in members}
        rest = [(run, plan) for run, plan in fitting_runs(planned, profile)
                if id(plan) not in held_out]
        if not rest:
            found.update((id(plan), None) for _, plan in members)
            continue
        fitted = with_constants(profile, fit(rest, profile, names))
        found.update(zip((id(plan) for _, plan in members), errors(members, fitted)))
        agree.update(fastest_agree(members, fitted))
        agree_multi.update(fastest_agree(
            [(run, plan) for run, plan in members if axes(run) >= 2], fitted))
    return [found[id(plan)] for _, plan in planned], agree, agree_multi
