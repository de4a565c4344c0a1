"""Training: run outputs, exact resume, loss scaling, gradient accumulation and clipping."""

import math
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from model_zoo.config import TrainConfig, load_config
from model_zoo.models.gpt2.model import GPT2Config, GPT2ForTraining
from model_zoo.checkpoint.contents import saved_in_checkpoints
from model_zoo.checkpoint.files import list_checkpoints, read_checkpoint
from model_zoo.train.metrics import read_metrics
from model_zoo.train.schedule import WarmupCosineSchedule
from model_zoo.train.step import TrainStep, build_optimizer
from model_zoo.train.trainer import train


@pytest.fixture(scope="module", autouse=True)
def graph_mode():
    """The trainer runs in GRAPH mode; the hand-built train steps here do too. MindSpore's
    context is process-wide, so the previous mode is restored for the other test files."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=previous)


def run_train(config_path, output_dir, resume=False, overrides=None):
    return train(load_config(config_path, overrides), str(output_dir), resume=resume)


def all_files(directory):
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


# --- a whole run ---------------------------------------------------------------------------

def test_tiny_run_writes_outputs_and_learns(write_config, tmp_path):
    config_path = write_config({"train.steps": 40, "train.log_steps": 3, "train.save_steps": 8,
                                "train.keep_checkpoints": 2, "train.global_batch_size": 16,
                                "model.hidden_size": 64})
    out = tmp_path / "run"
    result = run_train(config_path, out)

    entries = read_metrics(out / "metrics.jsonl")
    assert [e["step"] for e in entries] == list(range(3, 40, 3)) + [40]
    for entry in entries:
        assert {"step", "loss", "tokens_per_s", "lr", "loss_scale", "grad_norm"} <= set(entry)
        assert math.isfinite(entry["loss"]) and entry["tokens_per_s"] > 0
        # wall time per step, of which the loop's own work (data, reads, this line) is a part
        assert entry["step_ms"] == pytest.approx(1e3 * 16 / entry["samples_per_s"])
        assert 0 <= entry["outside_step_ms"] < entry["step_ms"]
    first, last = entries[0]["loss"], entries[-1]["loss"]
    assert last < first - 0.3, f"loss did not fall: {first:.3f} -> {last:.3f}"

    # saved every 8 steps, only the newest 2 kept, each written atomically
    assert [step for step, _ in list_checkpoints(out)] == [32, 40]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000032.ckpt", "step_00000040.ckpt"]
    assert not [path for path in all_files(out) if ".tmp" in os.path.basename(path)]
    newest = read_checkpoint(str(out / "checkpoints" / "step_00000040.ckpt"))
    assert newest["train_step"].asnumpy().item() == 40
    assert newest["global_step"].asnumpy().item() == 40  # the optimizer's step (schedule)

    saved = load_config(str(out / "config.yaml"))
    assert saved == load_config(config_path)
    png = out / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert math.isfinite(result["loss"])
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-3)


@pytest.mark.slow
def test_periodic_heldout_evaluation(write_config, tmp_path):
    """train.eval_steps: held-out entries every 5 steps and at the end, each the metrics of
    that step's checkpoint, and the training losses those of a run without them."""
    from model_zoo.checkpoint.files import evaluate_checkpoint
    settings = {"train.steps": 12, "train.log_steps": 4, "train.save_steps": 5,
                "train.keep_checkpoints": 3}
    plain = run_train(write_config(settings), tmp_path / "plain")
    config_path = write_config({**settings, "train.eval_steps": 5})
    result = run_train(config_path, tmp_path / "evaluated")

    entries = read_metrics(tmp_path / "evaluated" / "metrics.jsonl")
    heldout = [e for e in entries if "heldout" in e]
    assert [e["step"] for e in heldout] == [5, 10, 12]
    assert heldout[-1]["heldout"] == result == plain
    config = load_config(config_path)
    for entry, (step, path) in zip(heldout, list_checkpoints(tmp_path / "evaluated")):
        assert entry["step"] == step
        assert entry["heldout"]["loss"] == pytest.approx(
            evaluate_checkpoint(config, path)["loss"], abs=1e-4)
    training = [e["loss"] for e in entries if "loss" in e]
    assert training == [e["loss"] for e in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    assert (tmp_path / "evaluated" / "loss_curve.png").stat().st_size > 1000


# --- resume -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("precision, accumulation", [("fp32", 1), ("fp16", 2)])
def test_resume_continues_exactly(write_config, tmp_path, precision, accumulation):
    # The lr is still warming up at step 8, so it depends only on the restored optimizer step,
    # not on train.steps (which differs between the two halves). With fp16 the loss scale
    # doubles every 3 good steps, so a wrong scale or good-step counter after resume shows.
    overrides = {"train.save_steps": 4, "train.log_steps": 1, "train.warmup_steps": 20,
                 "train.precision": precision, "train.grad_accumulation": accumulation,
                 "train.loss_scale_window": 3, "train.keep_checkpoints": 5}
    whole = write_config({**overrides, "train.steps": 8}, name="whole.yaml")
    half = write_config({**overrides, "train.steps": 4}, name="half.yaml")
    run_train(whole, tmp_path / "whole")
    run_train(half, tmp_path / "resumed")
    assert [step for step, _ in list_checkpoints(tmp_path / "resumed")] == [4]
    run_train(half, tmp_path / "resumed", resume=True, overrides=["train.steps=8"])

    expected = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [e["step"] for e in resumed] == [e["step"] for e in expected] == list(range(1, 9))
    for want, got in zip(expected[4:], resumed[4:]):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), got["step"]
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-6), got["step"]
        assert got["loss_scale"] == want["loss_scale"], got["step"]
    if precision == "fp16":
        assert len({e["loss_scale"] for e in expected}) > 1  # the scale did change

    final_whole = read_checkpoint(str(tmp_path / "whole" / "checkpoints" / "step_00000008.ckpt"))
    final_resumed = read_checkpoint(
        str(tmp_path / "resumed" / "checkpoints" / "step_00000008.ckpt"))
    assert sorted(final_whole) == sorted(final_resumed)
    for name, value in final_whole.items():
        np.testing.assert_array_equal(final_resumed[name].asnumpy(), value.asnumpy(),
                                      err_msg=name)


# --- the train step on its own ------------------------------------------------------------

class MeanOfLinear(nn.Cell):
    """loss = mean(x @ w), the matmul in `dtype`. d loss / d w = x^T 1 / (batch * out),
    whatever w is, so the expected gradient is known exactly."""

    def __init__(self, n_in=4, n_out=4, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(Tensor(np.full((n_in, n_out), 0.1, np.float32)), name="weight")
        self.dtype = dtype

    def construct(self, x):
        y = ops.matmul(ops.cast(x, self.dtype), ops.cast(self.weight, self.dtype))
        return ops.reduce_mean(ops.cast(y, ms.float32))


def params_of(cell):
    """Every parameter's value by its name (as checkpoints store it)."""
    return {param.name: param.asnumpy().copy() for param in cell.get_parameters()}


def run_step(step, *batch):
    loss, finite, scale, grad_norm, lr, _, _ = step(*batch)
    return (loss.asnumpy().item(), bool(finite.asnumpy()), scale.asnumpy().item(),
            grad_norm.asnumpy().item(), lr.asnumpy().item())


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    # batch 2 x 4 of ones, fp16 matmul: the fp16 weight gradient is loss_scale / 4, which is
    # 65536 = inf in fp16 for a scale of 2**18, and 32768 (finite) for 2**17.
    network = MeanOfLinear(dtype=ms.float16)
    schedule = WarmupCosineSchedule(1e-2, 1e-3, 0, 100)
    optimizer = build_optimizer(network, TrainConfig(), schedule)
    step = TrainStep(network, optimizer, schedule, dynamic_loss_scale=True,
                     loss_scale=2.0 ** 18, scale_window=2, grad_clip=1.0)
    x = Tensor(np.ones((2, 4), np.float32))
    before = params_of(step)

    _, finite, scale, _, _ = run_step(step, x)
    after = params_of(step)
    assert finite is False
    assert scale == 2.0 ** 18  # the scale this step used
    assert after.pop("loss_scale") == 2.0 ** 17
    assert after.pop("train_step") == 1
    before.pop("loss_scale"), before.pop("train_step")
    for name, value in before.items():  # weights, Adam moments, optimizer step: untouched
        np.testing.assert_array_equal(after[name], value, err_msg=name)
        assert np.all(np.isfinite(after[name])), name

    loss, finite, scale, grad_norm, _ = run_step(step, x)
    assert finite is True and scale == 2.0 ** 17
    assert grad_norm == pytest.approx(1.0, rel=1e-3)  # 16 entries of 1/4, unscaled
    assert loss == pytest.approx(0.4, rel=1e-3)
    weight = step.network.weight.asnumpy()
    assert np.all(np.isfinite(weight)) and not np.array_equal(weight, before["weight"])
    assert float(step.loss_scale.asnumpy()) == 2.0 ** 17  # one good step: window is 2

    _, finite, scale, _, _ = run_step(step, x)
    assert finite is True and scale == 2.0 ** 17
    assert float(step.loss_scale.asnumpy()) == 2.0 ** 18  # two good steps: doubled
    assert int(step.good_steps.asnumpy()) == 0


class RootOfZero(nn.Cell):
    """loss = mean(sqrt(w)) at w = 0: a finite loss (0) whose gradient, 1 / (2 sqrt(w)),
    overflows whatever the loss scale is."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((2, 2), np.float32)), name="weight")

    def construct(self, x):
        return ops.reduce_mean(ops.sqrt(self.weight)) + ops.reduce_mean(x) * 0.0


def test_an_overflow_at_the_loss_scales_floor_is_a_bad_step():
    """Above its floor the scale absorbs an overflow (halved, no bad step); at the floor
    (1) nothing is left to absorb it, so it counts as a bad step, and a run that overflows
    there on every step meets `train.max_bad_steps` instead of skipping for ever."""
    network = RootOfZero()
    schedule = WarmupCosineSchedule(1e-2, 1e-3, 0, 100)
    step = TrainStep(network, build_optimizer(network, TrainConfig(), schedule), schedule,
                     dynamic_loss_scale=True, loss_scale=2.0, scale_window=2)
    x = Tensor(np.ones((2, 2), np.float32))
    loss, finite, scale, _, _ = run_step(step, x)
    assert (loss, finite, scale) == (0.0, False, 2.0)
    assert step.step_tally.read()["bad"] == 0          # absorbed: the scale halves to 1
    for count in (1, 2):
        _, finite, scale, _, _ = run_step(step, x)
        assert finite is False and scale == 1.0        # at the floor, and it stays there
        tally = step.step_tally.read()
        assert tally["bad_in_row"] == count and tally["last_bad"] == 4


def sgd_step(network, lr, **kwargs):
    schedule = WarmupCosineSchedule(lr, lr, 0, 100)  # constant lr
    optimizer = nn.SGD(network.trainable_params(), learning_rate=schedule)
    return TrainStep(network, optimizer, schedule, **kwargs)


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3, 100.0])
def test_gradient_clipping_bounds_the_update(grad_clip):
    # plain SGD: the update is exactly lr x (clipped) gradient
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    expected_grad = np.repeat(x.sum(axis=0, keepdims=True).T, 4, axis=1) / (3 * 4)
    norm = float(np.linalg.norm(expected_grad))
    assert 1e-2 < norm < 100.0
    network = MeanOfLinear()
    step = sgd_step(network, lr=1.0, grad_clip=grad_clip)
    start = network.weight.asnumpy().copy()

    _, finite, _, grad_norm, _ = run_step(step, Tensor(x))
    assert finite is True
    assert grad_norm == pytest.approx(norm, rel=1e-5)  # reported before clipping
    factor = grad_clip / norm if 0 < grad_clip < norm else 1.0
    update = start - network.weight.asnumpy()
    np.testing.assert_allclose(update, expected_grad * factor, rtol=1e-4, atol=1e-7)
    if grad_clip == 1e-3:
        assert np.linalg.norm(update) == pytest.approx(grad_clip, rel=1e-3)


def tiny_gpt2():
    config = GPT2Config(num_layers=1, hidden_size=32, num_heads=2, seq_length=8, vocab_size=50)
    return GPT2ForTraining(config)


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_matches_one_big_batch(accumulation):
    ids = Tensor(np.random.default_rng(1).integers(0, 50, size=(4, 9)).astype(np.int32))
    whole_net, accumulated_net = tiny_gpt2(), tiny_gpt2()
    ms.load_param_into_net(accumulated_net, {name: Parameter(Tensor(value), name=name)
                                             for name, value in params_of(whole_net).items()})
    start = params_of(whole_net)
    whole = sgd_step(whole_net, lr=0.5, grad_clip=0.0, accumulation=1)
    accumulated = sgd_step(accumulated_net, lr=0.5, grad_clip=0.0, accumulation=accumulation)

    loss_1, _, _, norm_1, _ = run_step(whole, ids)
    loss_n, _, _, norm_n, _ = run_step(accumulated, ids)
    assert loss_n == pytest.approx(loss_1, rel=1e-5)
    assert norm_n == pytest.approx(norm_1, rel=1e-4)
    after_1, after_n = params_of(whole_net), params_of(accumulated_net)
    moved = 0
    for name, value in after_1.items():
        np.testing.assert_allclose(after_n[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
        moved += not np.array_equal(value, start[name])
    assert moved > 0


class TwoLayers(nn.Cell):
    """mean((tanh(x W1 + b1) W2 + b2)^2): 2-D parameters (weight decay) and 1-D (none)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.first = nn.Dense(6, 5, weight_init=Tensor(rng.normal(size=(5, 6)), ms.float32),
                              bias_init="zeros")
        self.second = nn.Dense(5, 2, weight_init=Tensor(rng.normal(size=(2, 5)), ms.float32),
                               bias_init="zeros")

    def construct(self, x):
        return ops.reduce_mean(ops.square(self.second(ops.tanh(self.first(x)))))


def test_adamw_variants_match_mindspores_adam_weight_decay():
    """The one-kernel AdamW of CPU runs and the branch-free one of cluster runs, both with
    the step's unscaling and clipping folded in, give the parameters and moments of
    MindSpore's nn.AdamWeightDecay (applied after the step's own scaling), under the same
    names."""
    from model_zoo.nn import cpu_kernels
    from model_zoo.nn.backend import kernels_for
    from model_zoo.train.step import FusedAdamWeightDecay, SkippingAdamWeightDecay
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the fused kernels")
    config = TrainConfig(weight_decay=0.1)
    batches = [Tensor(np.random.default_rng(seed).normal(size=(4, 6)), ms.float32)
               for seed in range(4)]
    results = {}
    for variant in ("CPU", "Ascend", "mindspore"):   # Ascend: MindSpore's operators
        with kernels_for("CPU" if variant == "CPU" else "Ascend"):
            network = TwoLayers()
            schedule = WarmupCosineSchedule(1e-2, 1e-3, 2, 10)
            optimizer = build_optimizer(network, config, schedule)
            expected = {"CPU": FusedAdamWeightDecay}.get(variant, SkippingAdamWeightDecay)
            assert type(optimizer) is expected
            if variant == "mindspore":
                params = network.trainable_params()
                groups = [{"params": [p for p in params if p.ndim >= 2],
                           "weight_decay": config.weight_decay},
                          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
                          {"order_params": params}]
                optimizer = nn.AdamWeightDecay(groups, learning_rate=schedule,
                                               beta1=config.adam_beta1,
                                               beta2=config.adam_beta2, eps=config.adam_eps)
            step = TrainStep(network, optimizer, schedule, grad_clip=0.05)
            norms = [run_step(step, x)[3] for x in batches]
        results[variant] = (params_of(step), norms)
    reference, reference_norms = results.pop("mindspore")
    assert min(reference_norms) > 0.05   # every step clipped: the factor matters
    assert any("adam_m" in name for name in reference)
    assert not np.allclose(reference["first.weight"], TwoLayers().first.weight.asnumpy())
    for variant, (found, norms) in results.items():
        assert norms == pytest.approx(reference_norms, rel=1e-5), variant
        assert found.keys() == reference.keys(), variant
        for name, value in reference.items():
            np.testing.assert_allclose(found[name], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{variant}: {name}")


def test_skipping_adamw_leaves_everything_on_a_non_finite_step():
    """A non-finite step changes no parameter, moment or step count; the next finite one
    is MindSpore's AdamWeightDecay update."""
    from model_zoo.train.step import SkippingAdamWeightDecay
    values = np.random.default_rng(3).normal(size=(3, 4)).astype(np.float32)
    grad = Tensor(np.full((3, 4), 0.5, np.float32))
    updated = []
    for kind in (SkippingAdamWeightDecay, nn.AdamWeightDecay):
        param = Parameter(Tensor(values), name="w")
        optimizer = kind([param], learning_rate=0.1, weight_decay=0.01)
        if kind is SkippingAdamWeightDecay:
            bad = Tensor(np.full((3, 4), np.inf, np.float32))
            optimizer((bad,), Tensor(1.0, ms.float32), Tensor(False))
            assert np.array_equal(param.asnumpy(), values)
            assert not optimizer.moments1[0].asnumpy().any()
            assert not optimizer.moments2[0].asnumpy().any()
            assert optimizer.global_step.asnumpy().item() == 0
            optimizer((grad * 2,), Tensor(0.5, ms.float32), Tensor(True))
        else:
            optimizer((grad,))
        updated.append((param.asnumpy(), optimizer.moments2[0].asnumpy(),
                        optimizer.global_step.asnumpy().item()))
    (found, found_v, found_step), (reference, reference_v, reference_step) = updated
    np.testing.assert_allclose(found, reference, rtol=1e-6)
    np.testing.assert_allclose(found_v, reference_v, rtol=1e-6)
    assert found_step == reference_step == 1 and not np.allclose(found, values)


class Update(nn.Cell):
    """One optimizer update of fixed gradients (the fused one with a factor of 0.5)."""

    def __init__(self, optimizer, fused):
        super().__init__()
        self.optimizer, self.fused = optimizer, fused
        self.half = Tensor(0.5, ms.float32)

    def construct(self, grads):
        if self.fused:
            return self.optimizer(grads, self.half)
        return self.optimizer(tuple(grad * self.half for grad in grads))


def test_fused_adamw_split_over_threads_matches_across_tensor_boundaries():
    """Enough elements (3 x 200,001) for the kernel to split them over the cores, the
    split points inside tensors."""
    from model_zoo.nn import cpu_kernels
    from model_zoo.train.step import FusedAdamWeightDecay
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler for the fused kernels")
    rng = np.random.default_rng(5)
    values = [rng.normal(size=size).astype(np.float32) for size in ((401, 499), (200_001,),
                                                                  (999, 201))]
    grads = tuple(Tensor(rng.normal(size=v.shape).astype(np.float32)) for v in values)
    found = []
    for fused in (True, False):
        params = [Parameter(Tensor(v), name=f"p{i}") for i, v in enumerate(values)]
        groups = [{"params": [params[0], params[2]], "weight_decay": 0.1},
                  {"params": [params[1]], "weight_decay": 0.0}, {"order_params": params}]
        kind = FusedAdamWeightDecay if fused else nn.AdamWeightDecay
        update = Update(kind(groups, learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8),
                        fused)
        for _ in range(3):
            update(grads)
        found.append([p.asnumpy() for p in params])
    for fused, reference, before in zip(*found, values):
        np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-6)
        assert not np.allclose(fused, before)


def test_checkpoints_leave_out_the_gradient_buffers_and_still_resume(tmp_path):
    """A cluster step's gradient buffers (`accu_grads.*`, summed over the micro batches and
    cleared after each step) are zeros at every save: checkpoints leave them out, and a
    step loads its checkpoint back (weights, moments, step) with the buffers at zero."""
    from model_zoo.checkpoint.files import load_weights, save_checkpoint
    network = MeanOfLinear()
    schedule = WarmupCosineSchedule(1e-2, 1e-3, 0, 100)
    step = TrainStep(network, build_optimizer(network, TrainConfig(), schedule), schedule,
                     accumulated_by_compiler=True)
    run_step(step, Tensor(np.ones((2, 4), np.float32)))
    path = save_checkpoint(step, str(tmp_path), step=1, keep=1)
    saved = read_checkpoint(path)
    assert not [name for name in saved if name.startswith("accu_grads")]
    assert {"weight", "adam_m.weight", "adam_v.weight", "train_step"} <= set(saved)
    assert len(step.accu_grads) == len(step.weights)

    fresh_network = MeanOfLinear()
    fresh = TrainStep(fresh_network, build_optimizer(fresh_network, TrainConfig(), schedule),
                      schedule, accumulated_by_compiler=True)
    assert load_weights(fresh, path) == []
    for name, value in params_of(step).items():
        if saved_in_checkpoints(name):
            np.testing.assert_array_equal(params_of(fresh)[name], value, err_msg=name)
    assert all(not buffer.asnumpy().any() for buffer in fresh.accu_grads)


def test_a_loss_spike_is_skipped_and_the_average_follows_the_applied_steps():
    """train.loss_spike_factor: a step whose loss is above 3 x the running average of the
    applied steps' losses changes nothing (weights, moments, optimizer step, the average);
    the average starts at the first step's loss and moves by 0.1 of each applied one."""
    network = MeanOfLinear()
    schedule = WarmupCosineSchedule(1e-2, 1e-3, 0, 100)
    step = TrainStep(network, build_optimizer(network, TrainConfig(), schedule), schedule,
                     loss_spike_factor=3.0)
    ones = Tensor(np.ones((2, 4), np.float32))
    first, applied, *_ = run_step(step, ones)
    assert applied and float(step.loss_average.asnumpy()) == pytest.approx(first)
    before = params_of(step)
    spike, applied, *_ = run_step(step, ones * 10)
    assert not applied and spike > 3 * first
    after = params_of(step)
    assert after.pop("train_step") == before.pop("train_step") + 1
    assert after.pop("step_tally")[2] == before.pop("step_tally")[2] + 1   # one bad step
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    third, applied, *_ = run_step(step, ones)
    assert applied and third < first
    assert float(step.loss_average.asnumpy()) == pytest.approx(0.9 * first + 0.1 * third)
    # what the loop reads: the last step's loss (a log interval of 1 step, the default),
    # one bad step (a spike) now ended
    assert step.step_tally.read() == {
        "loss_sum": pytest.approx(third), "applied": 1, "bad": 1, "bad_in_row": 0,
        "most_bad_in_row": 1, "last_bad": 3}


def test_the_step_tally_counts_every_step_between_two_reads():
    """StepTally, which the loop reads once per log interval or sink of steps: the applied
    steps' losses summed over a log interval (restarted by the step counter), a run of
    non-finite steps in a row and the longest run, and an fp16 overflow that the loss
    scale absorbs, which is no bad step unless the scale is at its floor."""
    from model_zoo.train.step import BAD_STEP_REASONS, StepTally
    ONE = Tensor(1.0, ms.float32)   # the loss scale of a run without one
    tally = StepTally(log_steps=4)
    true, false = Tensor(True), Tensor(False)
    steps = ((2.0, true, true), (np.nan, false, false), (3.0, false, false),
             (1.0, true, true), (np.inf, false, false), (5.0, false, false))
    for before, (loss, applied, finite) in enumerate(steps):
        tally(Tensor(loss, ms.float32), applied, finite, Tensor(before, ms.int32), ONE)
        if before == 3:   # the end of the first log interval
            assert tally.read() == {"loss_sum": 3.0, "applied": 2, "bad": 2, "bad_in_row": 0,
                                    "most_bad_in_row": 2, "last_bad": 2}
    assert tally.read() == {"loss_sum": 0.0, "applied": 0, "bad": 4, "bad_in_row": 2,
                            "most_bad_in_row": 2, "last_bad": 2}
    assert BAD_STEP_REASONS[2] == "the gradients are not finite"
    tally(Tensor(np.nan, ms.float32), false, false, Tensor(6, ms.int32), ONE)
    assert tally.read()["most_bad_in_row"] == 3
    fp16 = StepTally(overflow_expected=True)
    fp16(Tensor(4.0, ms.float32), false, false, Tensor(0, ms.int32), Tensor(2.0, ms.float32))
    assert fp16.read() == {"loss_sum": 0, "applied": 0, "bad": 0, "bad_in_row": 0,
                           "most_bad_in_row": 0, "last_bad": 0}
    # at the scale's floor an overflow is absorbed no more: a bad step of its own reason
    fp16(Tensor(4.0, ms.float32), false, false, Tensor(1, ms.int32), ONE)
    assert fp16.read()["bad_in_row"] == 1 and fp16.read()["last_bad"] == 4
    assert "floor" in BAD_STEP_REASONS[4]


@pytest.mark.slow
def test_reading_the_outputs_once_per_log_interval_trains_the_same(write_config, tmp_path,
                                                                   monkeypatch):
    """On Ascend the loop reads the steps' outputs once per log interval
    (`outputs_read_every`), the host queueing the steps between. Forced on CPU (reads
    every 4 steps, logs every 4, a save at 6), a run logs the same losses and norms and
    saves the same checkpoints as one that reads every step."""
    from model_zoo.train import trainer
    config_path = write_config({"train.steps": 8, "train.log_steps": 4,
                                "train.save_steps": 6, "train.keep_checkpoints": 3})
    run_train(config_path, tmp_path / "every")
    monkeypatch.setattr(trainer, "outputs_read_every",
                        lambda config, device_target: config.train.log_steps)
    run_train(config_path, tmp_path / "interval")
    timing = {"samples_per_s", "tokens_per_s", "step_ms", "outside_step_ms"}
    logged = [[{key: value for key, value in entry.items() if key not in timing}
               for entry in read_metrics(tmp_path / run / "metrics.jsonl")]
              for run in ("every", "interval")]
    assert logged[0] == logged[1] and [e["step"] for e in logged[0] if "loss" in e] == [4, 8]
    for step in (6, 8):
        name = f"step_{step:08d}.ckpt"
        saved = [read_checkpoint(str(tmp_path / run / "checkpoints" / name))
                 for run in ("every", "interval")]
        for key, value in saved[0].items():
            np.testing.assert_array_equal(saved[1][key].asnumpy(), value.asnumpy(),
                                          err_msg=key)


def test_a_sink_ends_at_every_step_the_loop_acts_after():
    """train.dataset_sink: sinks on Ascend by default, not on CPU; a sink is the greatest
    common divisor of the log, evaluation and save intervals, the resumed step and the run's
    length; a sink of one step on Ascend is fed from the host instead."""
    from model_zoo.train.loop import sink_size_of
    train = TrainConfig(steps=1000, log_steps=10, save_steps=100)
    assert sink_size_of(train, "Ascend", 0) == 10
    assert sink_size_of(train, "CPU", 0) == 0
    assert sink_size_of(TrainConfig(steps=1000, log_steps=10, save_steps=100,
                                    dataset_sink=False), "Ascend", 0) == 0
    assert sink_size_of(TrainConfig(steps=1000, log_steps=10, save_steps=100,
                                    dataset_sink=True), "CPU", 0) == 10
    assert sink_size_of(TrainConfig(steps=1000, log_steps=10, save_steps=100,
                                    eval_steps=25), "Ascend", 0) == 5
    assert sink_size_of(train, "Ascend", 104) == 2       # resumed after a signal at 104
    assert sink_size_of(TrainConfig(steps=1001, log_steps=10, save_steps=100),
                        "Ascend", 0) == 0                # a sink of one: fed from the host



def test_a_metrics_line_that_is_not_json_before_the_last_is_refused(tmp_path):
    """Only the last line of metrics.jsonl may be torn (appends end there); garbage before it
    is an error naming the file and line, not a traceback."""
    from model_zoo.errors import DataError
    from model_zoo.train.metrics import read_metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(DataError, match="line 2 is not a JSON entry"):
        read_metrics(str(path))
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert read_metrics(str(path)) == [{"step": 1}, {"step": 2}]
