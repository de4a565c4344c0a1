"""benchmarks/train_throughput.py: its batches and FLOPs count against the models, and one
short end-to-end run of both sides."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore.nn.utils import no_init_parameters

from model_zoo.config import import_model
from model_zoo.nn.layers import Linear, dtype_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "train_throughput.py")
_spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def benchmark_config(model, size="small", overrides=()):
    args = type("Args", (), {"model": model, "size": size, "config": None,
                             "set": list(overrides)})
    return bench.load_benchmark_config(args)


@pytest.mark.parametrize("model", bench.MODELS)
def test_synthetic_batch_has_the_networks_inputs(model):
    config = benchmark_config(model)
    batch = bench.synthetic_batch(config)
    expected = import_model(model).plan_inputs(config, config.train.global_batch_size)
    assert [(column.shape, column.dtype) for column in batch] == [
        (shape, ms.dtype_to_nptype(dtype)) for shape, dtype in expected]


@pytest.mark.parametrize("model", ["gpt2", "llama", "transformer"])
def test_flops_count_every_linear_layer(model):
    """The formula against the built network: 2 x tokens x (in x out) for each linear layer
    and the tied output projection, plus the attention products, times 3."""
    config = benchmark_config(model)
    m, samples = config.model, config.train.global_batch_size
    with no_init_parameters():
        network = import_model(model).build_train_network(config, dtype_of("fp32"))
    linear_params = sum(cell.in_features * cell.out_features
                        for _, cell in network.cells_and_names()
                        if isinstance(cell, Linear))
    seq = m.seq_length
    attention_layers = m.num_layers * (3 if model == "transformer" else 1)
    forward = (2 * seq * linear_params + 2 * seq * m.hidden_size * m.vocab_size
               + attention_layers * 4 * seq * seq * m.hidden_size)
    batch = bench.synthetic_batch(config)
    assert bench.train_flops(config, batch) == pytest.approx(3 * forward * samples)


def test_gemm_rounds_keep_each_figures_best_and_steal_is_the_eighth_counter():
    slow = {"size": 2048, "torch_gflops": 100.0, "mindspore_gflops": 90.0, "ours_gflops": 95.0,
            "peak_gflops": 100.0,
            "model_shapes": [{"name": "vocabulary", "m": 8, "torch": 50.0, "mindspore": 60.0}]}
    fast = dict(slow, torch_gflops=80.0, mindspore_gflops=120.0, peak_gflops=120.0,
                model_shapes=[dict(slow["model_shapes"][0], torch=70.0, mindspore=40.0)])
    best = bench.best_gemm([slow, fast])
    assert (best["torch_gflops"], best["mindspore_gflops"], best["ours_gflops"]) == (100, 120, 95)
    assert best["peak_gflops"] == 120 and best["round_peak_gflops"] == [100, 120]
    assert best["model_shapes"] == [{"name": "vocabulary", "m": 8, "torch": 70.0,
                                     "mindspore": 60.0}]
    # user nice system idle iowait irq softirq steal: 30 of 100 ticks went to other guests
    assert bench.steal_share([0] * 8, [40, 0, 10, 15, 0, 0, 5, 30]) == pytest.approx(0.3)
    assert bench.steal_share(None, [1] * 8) is None


@pytest.mark.slow
def test_both_sides_train_and_report(tmp_path):
    output = tmp_path / "result.json"
    command = [sys.executable, SCRIPT, "--model", "gpt2", "--size", "tiny", "--steps", "3",
               "--warmup", "0", "--rounds", "1", "--skip-data", "--output", str(output),
               "--set", "model.num_layers=1", "--set", "train.global_batch_size=4",
               "--set", "train.lr=5e-4", "--trainer", "--trainer-steps", "3",
               "--set", f"data.dataset_dir={tmp_path / 'data'}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ours / reference:" in result.stdout
    report = json.loads(output.read_text())
    assert report["shape"]["layers"] == 1 and report["shape"]["batch"] == 4
    for side in ("ours", "reference"):
        numbers = report[side]
        assert numbers["tokens_per_s"] > 0 and 0 < numbers["mfu"] < 1.5
        assert numbers["last_loss"] < numbers["first_loss"]  # four steps on one batch
    assert report["speedup"] == pytest.approx(
        report["ours"]["tokens_per_s"] / report["reference"]["tokens_per_s"])
    # model-zoo train itself, on the real dataset: the two steps after the first, timed
    assert [run["log_steps"] for run in report["trainer"]] == [1, 100]
    for run in report["trainer"]:
        assert run["steps"] == 2 and run["vs_benchmark"] > 0 and run["vs_benchmark_mean"] > 0
        assert 0 <= run["outside_step_share"] < 1 and run["outside_step_ms"] >= 0
        assert run["tokens_per_s"] == pytest.approx(
            run["steps_per_s"] * 4 * report["shape"]["seq_length"])
    assert report["gemm"]["peak_gflops"] >= max(report["gemm"]["torch_gflops"],
                                                 report["gemm"]["mindspore_gflops"]) > 0
    assert report["gemm"]["round_peak_gflops"] == [report["gemm"]["peak_gflops"]]
    for side in ("ours", "reference"):  # on Linux the share of the rounds' CPU time stolen
        assert 0 <= report[side]["steal_share"] < 1
    assert "(steal) in the rounds kept" in result.stdout
    # the model's own products: tokens of a batch (4 x seq) by hidden, ..., by vocabulary
    shapes = report["gemm"]["model_shapes"]
    assert [shape["name"] for shape in shapes][-1] == "vocabulary"
    assert shapes[-1]["m"] == 4 * report["shape"]["seq_length"]
    assert shapes[-1]["n"] == report["shape"]["vocab"]
    assert all(shape["torch"] > 0 and shape["mindspore"] > 0 for shape in shapes)
    assert "at the model's shapes" in result.stdout
    assert np.isfinite(report["ours"]["peak_rss_mb"])


def test_a_bad_override_fails_before_any_run(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--model", "gpt2", "--set", "model.nope=1",
                             "--output", str(tmp_path / "r.json")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "nope" in result.stderr and "[ours] running" not in result.stdout
    assert not (tmp_path / "r.json").exists()
