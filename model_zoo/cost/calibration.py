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
# the rows each profile is fitted on
DEVICE_MEASUREMENTS = {"a100": MEASUREMENTS,
                       "ascend910": os.path.join(MEASUREMENTS_DIR, "ascend_calibration.csv"),
                       "ascend910b": os.path.join(MEASUREMENTS_DIR, "ascend_calibration.csv")}
LIBAI_CONFIGS = {"BERT": "model_zoo/bert/configs/bert-large.yaml",
                 "GPT-2": "model_zoo/gpt2/configs/gpt2-1024.yaml"}
# an Ascend row's family: the shipped config whose model it is (PanGu-alpha is a GPT-2
# shaped decoder; Baichuan2-7B a LLaMA-2 7B with a larger vocabulary)
FAMILY_CONFIGS = {"gpt2": "model_zoo/gpt2/configs/gpt2-1024.yaml",
                  "pangu-alpha": "model_zoo/gpt2/configs/gpt2-1024.yaml",
                  "baichuan2": "model_zoo/llama/configs/plan/llama2-7b-d1m8p1.yaml",
                  "bert": "model_zoo/bert/configs/bert-base.yaml",
                  "transformer": "model_zoo/transformer/configs/transformer-big.yaml"}
ASCEND_DEVICES = {"Ascend 910": "ascend910", "Ascend 910A": "ascend910",
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


def read_rows(path: str = MEASUREMENTS) -> list:
    """The runs of a measurements file: LiBai's columns or the Ascend file's."""
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [ascend_run(row) if "figure" in row else libai_run(row) for row in rows]


def layout_overrides(dp, mp, pp, micro_batches, recompute, optimizer_shard, global_batch,
                     accumulation) -> list:
    """The `--set` overrides of a measured run's layout and batch (fp16, as all were)."""
    return [f"parallel.data_parallel={dp}", f"parallel.model_parallel={mp}",
            f"parallel.pipeline_stage={pp}", f"parallel.micro_batch_num={micro_batches}",
            f"parallel.recompute={str(recompute).lower()}",
            f"parallel.optimizer_shard={str(optimizer_shard).lower()}",
            f"train.global_batch_size={global_batch}", f"train.grad_accumulation={accumulation}",
            "train.precision=fp16"]


def libai_run(row: dict) -> Run:
    dp, tp, pp = int(row["dp"]), int(row["tp"]), int(row["pp"])
    micro_steps = int(row["global_batch"]) // (int(row["micro_batch"]) * dp)
    overrides = [f"model.num_layers={row['layers']}"] + layout_overrides(
        dp, tp, pp, micro_steps if pp > 1 else 1, row["recompute"] == "1", False,
        int(row["global_batch"]), 1 if pp > 1 else micro_steps)
    return Run(f"{row['model']} {row['config']}", row["model"], LIBAI_CONFIGS[row["model"]],
               overrides, "a100", int(row["gpus_per_node"]),
               int(row["nodes"]) * int(row["gpus_per_node"]), f"{dp}x{tp}x{pp}",
               float(row["samples_per_s"]))


def ascend_run(row: dict) -> Run:
    """A row of ascend_calibration.csv (columns in model_zoo/cost/measurements/README.md): its
    model's dimensions set on the family's config; the vocabulary rounded up to a multiple
    of 128 (as Megatron pads it) so that every model-parallel split divides it."""
    dp, mp, pp = int(row["dp"]), int(row["mp"]), int(row["pp"])
    accumulation = int(row["grad_accum"] or 1)
    micro_batches = int(row["micro_batch_num"] or 1) if pp > 1 else 1
    global_batch = int(row["global_batch"])
    seq, devices = int(row["seq"]), int(row["devices"])
    if row["unit"] == "tokens/s/p":
        samples_per_s = float(row["figure"]) * devices / seq
    else:   # ms/step
        samples_per_s = global_batch / (float(row["figure"]) / 1000)
    overrides = [
        f"model.num_layers={row['layers']}", f"model.hidden_size={row['hidden']}",
        f"model.num_heads={row['heads']}", f"model.seq_length={seq}",
        f"model.vocab_size={-(-int(row['vocab']) // 128) * 128}"] + layout_overrides(
        dp, mp, pp, micro_batches, row["recompute"] not in ("", "none"),
        row["optimizer_shard"] == "TRUE", global_batch, accumulation)
    if row["family"] in ("baichuan2", "transformer"):
        overrides.append(f"model.ffn_hidden_size={row['ffn']}")
    if row["family"] == "baichuan2":
        overrides += [f"model.num_kv_heads={row['kv_heads']}",
                      f"model.flash_attention={row['flash_attention'] == 'TRUE'}".lower()]
    return Run(f"{row['model']} ({row['device']})", row["model"].split()[0],
               FAMILY_CONFIGS[row["family"]], overrides, ASCEND_DEVICES[row["device"]], 8,
               devices, f"{dp}x{mp}x{pp}", samples_per_s,
               exact=row["family"] != "transformer")   # batches bucketed to 16-128 tokens


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
    the runs of known work, all of them or only the data-parallel ones."""
    return [(run, plan) for run, plan in planned if run.exact and (
        profile.fitted_on == "all" or run.layout.endswith("x1x1"))]


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


def groups(planned: list) -> dict:
    """{(model, devices): [(row, plan), ...]}: the rows one model ran on one device count."""
    found = {}
    for run, plan in planned:
        found.setdefault((run.model, run.devices), []).append((run, plan))
    return found


def fastest_agree(planned: list, profile) -> dict:
    """{group: whether the layout predicted fastest is the one measured fastest}, for the
    groups of more than one row."""
    return {key: _fastest_agree(members, profile)
            for key, members in groups(planned).items() if len(members) > 1}


def _fastest_agree(members: list, profile) -> bool:
    measured = max(members, key=lambda m: m[0].samples_per_s)
    predicted = max(members, key=lambda m: predict(m[1], profile))
    return measured is predicted


def leave_one_group_out(planned: list, profile, names) -> tuple:
    """Each (model, devices) group predicted by a fit on the other groups' rows (those
    `fitting_runs` allows): (the relative error of every row, in `planned`'s order;
    {group: whether its predicted fastest layout is its measured fastest}, for groups of
    more than one row). A group whose rows are all the fit has is not predicted: None."""
    found, agree = {}, {}
    for key, members in groups(planned).items():
        held_out = {id(plan) for _, plan in members}
        rest = [(run, plan) for run, plan in fitting_runs(planned, profile)
                if id(plan) not in held_out]
        if not rest:
            found.update((id(plan), None) for _, plan in members)
            continue
        fitted = with_constants(profile, fit(rest, profile, names))
        found.update(zip((id(plan) for _, plan in members), errors(members, fitted)))
        if len(members) > 1:
            agree[key] = _fastest_agree(members, fitted)
    return [found[id(plan)] for _, plan in planned], agree
