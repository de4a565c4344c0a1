"""The time model of `model-zoo plan` (`plan.timing`): placement of collectives on servers,
the JSON of the plan's prediction, and the a100 profile against the published measurements
it was fitted on (`plan.calibration`, `benchmarks/calibrate_profile.py`)."""

import dataclasses
import json
import statistics

import pytest

from conftest import run_cli
from model_zoo.plan import calibration
from model_zoo.plan.devices import load_profile
from model_zoo.plan.timing import spans_servers

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
    # a 1F1B pipeline of 16 micro batches over 4 stages idles 3 micro steps
    assert time["bubble_s"] == pytest.approx(3 / 19 * (time["step_s"]), rel=0.05)
    assert report["device"]["key"] == "a100" and report["device"]["memory"] == 40 * 2 ** 30


def test_servers_of_fewer_devices_slow_a_layout_whose_groups_they_cut(planned):
    """dp 8 on one server of 8 against two servers of 4: the gradient reduction crosses
    the slower link."""
    row, plan = next((row, plan) for row, plan in planned
                     if row["model"] == "GPT-2" and row["dp"] == "8")
    profile = load_profile("a100")
    one_server = calibration.predict(plan, profile)
    plan_of_fours = dataclasses.replace(plan, profile=load_profile("a100", 4))
    assert calibration.predict(plan_of_fours, profile) < 0.9 * one_server


def test_the_a100_profile_predicts_the_rows_it_was_fitted_on(planned):
    """The shipped a100 profile (4 constants fitted by benchmarks/calibrate_profile.py
    --fit): median error 4.6%, largest 15.7% on the 20 single-axis rows."""
    errors = [abs(e) for e in calibration.errors(planned, load_profile("a100"))]
    assert len(errors) == 20
    assert statistics.median(errors) < 0.05
    assert max(errors) < 0.16


def test_the_fit_recovers_the_speeds_behind_the_measurements(planned):
    """Rows 'measured' with known constants: fitting from other values predicts them again."""
    truth = calibration.with_constants(load_profile("a100"), {
        "inside_server.bandwidth_gbs": 150, "between_servers.bandwidth_gbs": 20,
        "matmul": 0.5, "memory_bound": 0.8})
    synthetic = [(dict(row, samples_per_s=str(calibration.predict(plan, truth))), plan)
                 for row, plan in planned]
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
    measured = [float(row["samples_per_s"]) for row, _ in planned]
    predicted = [calibration.predict(plan, profile) for _, plan in planned]
    assert calibration.spearman(measured, predicted) > 0.95
    agree = calibration.fastest_agree(planned, profile)
    assert len(agree) == 6 and all(agree.values()), agree   # BERT and GPT-2 on 1, 4 and 8


def test_spearman_against_a_hand_count():
    assert calibration.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert calibration.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    assert calibration.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
