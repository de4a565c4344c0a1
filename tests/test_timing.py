"""The time model of `model-zoo plan` (`cost.timing`): placement of collectives on servers,
the JSON of the plan's prediction, and the a100 profile against the published measurements
it was fitted on (`cost.calibration`, `benchmarks/calibrate_profile.py`)."""

import dataclasses
import json
import statistics

import pytest

from conftest import run_cli
from model_zoo.cost import calibration
from model_zoo.cost.devices import load_profile
from model_zoo.cost.timing import spans_servers

# the interface the checks use: GPT-2 medium's shape, d2 x m2 x p4 on 16 A100s
GPT2_D2M2P4 = ["model_zoo/gpt2/configs/gpt2-1024.yaml", "--device", "a100",
               "--devices-per-server", "8",
               "--set", "parallel.data_parallel=2", "--set", "parallel.model_parallel=2",
               "--set", "parallel.pipeline_stage=4", "--set", "parallel.micro_batch_num=16",
               "--set", "parallel.recompute=true", "--set", "train.global_batch_size=1024",
               "--set", "train.grad_accumulation=1", "--set", "train.precision=fp16", "--json"]


@pytest.fixture(scope="module")
def planned():
    return calibration.plan_rows(calibration.read_rows())


def test_the_optimizer_shards_weight_gathers_are_once_a_step():
    """As MindSpore compiles them (the dry-run tier holds it): 4 accumulation steps gather
    the weights as often as one, before the first micro step, not in every one."""
    from model_zoo.config import load_config
    from model_zoo.cost.build import build_plan
    def plan(accumulation):
        config = load_config("model_zoo/gpt2/configs/tiny.yaml", [
            "parallel.data_parallel=2", "parallel.optimizer_shard=true",
            "train.global_batch_size=16", f"train.grad_accumulation={accumulation}"],
            layout_checked=False)
        return build_plan(config, device="ascend910").to_dict()
    once, four = plan(1), plan(4)
    gathers = [[item for item in report["communication"]["stages"][0]["details"]
                if item["what"] == "weights (optimizer shard)"] for report in (once, four)]
    assert gathers[0] and gathers[0] == gathers[1]
    (stage_once,), (stage_four,) = once["time"]["stages"], four["time"]["stages"]
    assert stage_four["weight_gather_s"] == stage_once["weight_gather_s"] > 0
    assert four["time"]["step_s"] > once["time"]["step_s"]   # the micro steps still add


def test_groups_span_servers_by_their_extent():
    assert not spans_servers(8, 1, 8)          # a model-parallel group of 8 neighbours
    assert spans_servers(2, 8, 8)              # replicas a server apart
    assert spans_servers(4, 4, 8)              # ranks 0, 4, 8, 12
    assert not spans_servers(2, 4, 8)
    assert not spans_servers(1, 64, 8)         # no group at all


def test_the_plan_prints_its_predicted_time_as_json():
    result = run_cli("plan", *GPT2_D2M2P4)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    time = report["time"]
    for key in ("step_s", "samples_per_s", "tokens_per_s", "mfu", "compute_s",
                "communication_s", "bubble_s"):
        assert time[key] >= 0, key
    assert time["samples_per_s"] == pytest.approx(1024 / time["step_s"])
    assert time["tokens_per_s"] == pytest.approx(1024 * time["samples_per_s"])
    assert 0 < time["mfu"] < 1
    # a 1F1B pipeline of 16 micro batches over 4 stages as a flow shop: the first micro
    # batch passes every stage, the other 15 follow at the pace of the slowest stage (the
    # last, which also holds the vocabulary projection); the bubble is the rest of the first
    micro = [(s["compute_s"] + s["exposed_communication_s"]) / 16 for s in time["stages"]]
    assert len(micro) == 4 and max(micro) == micro[3] > 1.1 * micro[1]
    assert time["bubble_s"] == pytest.approx(sum(micro) - micro[3])
    tail = max(s["gradient_sync_s"] + s["optimizer_s"] + s["weight_gather_s"]
               for s in time["stages"])
    assert time["step_s"] == pytest.approx(sum(micro) + 15 * micro[3] + tail)
    assert time["bubble_s"] < 3 / 19 * time["step_s"]   # less than 3 of the slowest steps
    assert report["device"]["key"] == "a100" and report["device"]["memory"] == 40 * 2 ** 30


def test_servers_of_fewer_devices_slow_a_layout_whose_groups_they_cut(planned):
    """dp 8 on one server of 8 against two servers of 4: the gradient reduction crosses
    the slower link."""
    run, plan = next((run, plan) for run, plan in planned
                     if run.model == "GPT-2" and run.layout == "8x1x1")
    profile = load_profile("a100")
    one_server = calibration.predict(plan, profile)
    plan_of_fours = dataclasses.replace(plan, profile=load_profile("a100", 4))
    assert calibration.predict(plan_of_fours, profile) < 0.9 * one_server


def test_the_a100_profile_predicts_the_rows_it_was_fitted_on(planned):
    """The shipped a100 profile (4 constants fitted by benchmarks/calibrate_profile.py
    --fit): median error 4.3%, largest 11.6% on LiBai's 42 rows (one, two and three axes;
    the pipelines with the stages LiBai lays out itself)."""
    errors = [abs(e) for e in calibration.errors(planned, load_profile("a100"))]
    assert len(errors) == 42
    assert statistics.median(errors) < 0.05
    assert max(errors) < 0.15


def test_each_group_is_predicted_by_a_fit_without_it(planned):
    """Leave one group out: every (model, devices) group predicted by the constants fitted
    on the other nine (median 4.4%, largest 15.5%), its fastest layout still found, and
    its fastest layout of two or three axes too (6 groups)."""
    profile = load_profile("a100")
    errors, agree, multi = calibration.leave_one_group_out(planned, profile, profile.fitted)
    errors = [abs(e) for e in errors]
    assert statistics.median(errors) < 0.05
    assert max(errors) < 0.17
    assert len(agree) == 10 and all(agree.values()), agree
    assert len(multi) == 6 and all(multi.values()), multi


def test_libai_lays_out_fewer_blocks_on_the_last_stage():
    """LiBai's automatic stage ids (libai/utils/distributed.py) that its pipelined rows ran
    with: later stages a slot more, cut at the real layers."""
    assert calibration.libai_stage_blocks(24, 4) == [6, 7, 7, 4]
    assert calibration.libai_stage_blocks(48, 8) == [6, 6, 7, 7, 7, 7, 7, 1]
    assert calibration.libai_stage_blocks(24, 2) == [12, 12]   # fewer than 4 stages: even


def test_a_group_on_a_full_mesh_sends_over_its_links_to_the_others():
    mesh = load_profile("a100").inside_server
    assert mesh.peers == 7
    assert mesh.bandwidth_for(2) == pytest.approx(mesh.bandwidth / 7)
    assert mesh.bandwidth_for(4) == pytest.approx(3 * mesh.bandwidth / 7)
    assert mesh.bandwidth_for(8) == mesh.bandwidth
    switch = dataclasses.replace(mesh, peers=0)
    assert switch.bandwidth_for(2) == switch.bandwidth_for(8) == switch.bandwidth


def test_the_fit_recovers_the_speeds_behind_the_measurements(planned):
    """Rows 'measured' with known constants: fitting from other values predicts them again."""
    truth = calibration.with_constants(load_profile("a100"), {
        "inside_server.bandwidth_gbs": 150, "between_servers.bandwidth_gbs": 20,
        "matmul": 0.5, "memory_bound": 0.8})
    synthetic = [(dataclasses.replace(run, samples_per_s=calibration.predict(plan, truth)),
                  plan) for run, plan in planned]
    start = load_profile("a100")
    assert max(abs(e) for e in calibration.errors(synthetic, start)) > 0.1
    fitted = calibration.fit(synthetic, start, start.fitted)
    errors = calibration.errors(synthetic, calibration.with_constants(start, fitted))
    assert max(abs(e) for e in errors) < 0.01


def test_an_unknown_device_is_one_error_line():
    result = run_cli("plan", "model_zoo/gpt2/configs/tiny.yaml", "--device", "h100")
    assert result.returncode == 2
    assert "invalid choice: 'h100'" in result.stderr


def test_the_a100_profile_ranks_the_rows_as_measured(planned):
    profile = load_profile("a100")
    measured = [run.samples_per_s for run, _ in planned]
    predicted = [calibration.predict(plan, profile) for _, plan in planned]
    assert calibration.spearman(measured, predicted) > 0.95
    agree = calibration.fastest_agree(planned, profile)
    # BERT and GPT-2 on 1, 4, 8, 16 and 32 devices
    assert len(agree) == 10 and all(agree.values()), agree


def test_spearman_against_a_hand_count():
    assert calibration.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert calibration.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    assert calibration.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_the_ascend_rows_read_as_their_model_cards_state():
    """ms/step rows: samples/s = global batch / step; tokens/s/p rows: figure x devices /
    seq (model_zoo/cost/measurements/README.md)."""
    runs = {run.name: run for run in calibration.read_rows(
        calibration.DEVICE_MEASUREMENTS["ascend910"][0])}
    bert = runs["BERT-base pretrain (Ascend 910)"]
    assert bert.samples_per_s == pytest.approx(2048 / 0.284)
    assert (bert.device, bert.layout, bert.devices) == ("ascend910", "8x1x1", 8)
    gpt = runs["GPT2-13B finetune (Atlas 800T A2)"]
    assert gpt.samples_per_s == pytest.approx(1376 * 32 / 2048)
    assert (gpt.device, gpt.layout) == ("ascend910b", "4x8x1")
    assert "model.vocab_size=50304" in gpt.overrides   # 50257 padded to a multiple of 128
    assert not runs["Transformer-large WMT en-de (Ascend 910)"].exact   # bucketed lengths


def test_the_910_profile_predicts_the_runs_it_was_fitted_on():
    """The MatMul efficiency fitted on the 910's data-parallel runs (fitted_on:
    data_parallel) reproduces them within 3%; the tensor-parallel runs are checks, kept out."""
    profile = load_profile("ascend910")
    planned = calibration.plan_rows(calibration.device_runs("ascend910"))
    fitting = calibration.fitting_runs(planned, profile)
    assert fitting and all(run.layout.endswith("x1x1") for run, _ in fitting)
    assert len(fitting) < len(planned)
    assert max(abs(e) for e in calibration.errors(fitting, profile)) < 0.03
    refitted = calibration.fit(fitting, profile, profile.fitted)
    assert refitted["matmul"] == pytest.approx(profile.matmul_efficiency, rel=0.01)


def test_the_910b_profile_predicts_mindformers_llama_tables_it_never_saw():
    """MindFormers' own LLaMA-2 / LLaMA-3 / LLaMA-3.1 runs (7B-70B, 8-64 devices, data,
    tensor and pipeline parallel), never fitted on: median error 6.7%, largest 14.7%,
    Spearman 0.95 (the goals: 10%, 25%, 0.9)."""
    profile = load_profile("ascend910b")
    runs = [run for path in calibration.DEVICE_CHECKS["ascend910b"]
            for run in calibration.read_rows(path, check=True)]
    assert len(runs) == 19 and all(run.check and run.device == "ascend910b" for run in runs)
    planned = calibration.plan_rows(runs)
    assert not calibration.fitting_runs(planned, profile)
    errors = [abs(e) for e in calibration.errors(planned, profile)]
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.25
    predicted = [calibration.predict(plan, profile) for _, plan in planned]
    assert calibration.spearman([run.samples_per_s for run in runs], predicted) >= 0.9
