"""`model-zoo plan`: every shipped layout passes, broken strategies are caught with messages
that name the cell, operator, input and dimension, the shape recording agrees with
MindSpore's kernels, the cost model with its closed forms and with a measured CPU run, and
docs/parallelism.md with the code.
"""

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor
from mindspore.nn.utils import no_init_parameters

from conftest import run_cli
from model_zoo.errors import ConfigError
from model_zoo.models.gpt2.model import GPT2Config, GPT2ForTraining
from model_zoo.cost import memory
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import check_flash_attention_device
from model_zoo.nn.backend import kernels_for
from model_zoo.plan.command import DOC_PATH
from model_zoo.plan.docs import (_layer_examples, generated_sections, plan_config_files,
                                 render_doc, sharded_layer_names)
from model_zoo.config import config_from_dict, load_config
from model_zoo.cost.build import build_plan
from model_zoo.plan.report import format_report
from model_zoo.layout.recording import PlanError
from model_zoo.layout.trace import record
from model_zoo.parallel.replication import (device_piece, norm_weights, optimizer_shard_size,
                                            stage_of_rank)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30

# --- the CPU memory measurement runs in a subprocess beside the other tests -----------------

# A stand-alone tiny GPT-2 large enough that its tensors dominate the framework's own
# memory: 2 layers, hidden 256, 16 sequences of 128 tokens, vocabulary 2048, fp32.
MEMORY_CONFIG = {
    "model": {"name": "gpt2", "num_layers": 2, "hidden_size": 256, "num_heads": 4,
              "seq_length": 128, "vocab_size": 2048, "dropout": 0.1, "attention_dropout": 0.1},
    "parallel": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1},
    "train": {"global_batch_size": 16, "precision": "fp32", "device_target": "CPU",
              "lr": 1.0e-3},
    "data": {"dataset_dir": "unused"},
}

MEASURE_SCRIPT = r'''
import json, sys
import numpy as np

def rss(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024

import mindspore as ms
from mindspore import Tensor
from model_zoo.config import config_from_dict
from model_zoo.models.gpt2.tasks import build_train_network
from model_zoo.nn.layers import dtype_of
from model_zoo.train.step import build_optimizer

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", runtime_num_threads=1)


def train(raw, steps):
    """A stand-alone training loop: the model folder's network, the trainer's AdamW."""
    config = config_from_dict(raw)
    ms.set_seed(1)
    network = build_train_network(config, dtype_of(config.train.precision))
    marks["built"] = rss("VmRSS:")
    optimizer = build_optimizer(network, config.train, config.train.lr)
    grad_fn = ms.value_and_grad(network, None, optimizer.parameters)
    rng = np.random.default_rng(0)
    shape = (config.train.global_batch_size, config.model.seq_length + 1)
    losses = []
    for _ in range(steps):
        ids = Tensor(rng.integers(0, config.model.vocab_size, shape), ms.int32)
        loss, grads = grad_fn(ids)
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses


marks = {}
raw = json.loads(sys.argv[1])
warm = json.loads(sys.argv[1])
warm["model"].update(hidden_size=8, num_heads=2, vocab_size=16)
warm["train"]["global_batch_size"] = 1
train(warm, 1)          # kernels, allocator and autograd set up before the baseline
baseline = rss("VmRSS:")
losses = train(raw, 3)
print(json.dumps({"built": marks["built"] - baseline, "peak": rss("VmHWM:") - baseline,
                  "losses": losses}))
'''


@pytest.fixture(scope="module", autouse=True)
def cpu_memory_run():
    """Start the measured CPU run at once, so that it overlaps the in-process tests."""
    process = subprocess.Popen([sys.executable, "-c", MEASURE_SCRIPT, json.dumps(MEMORY_CONFIG)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="1"),
                               cwd=ROOT)
    yield process
    if process.poll() is None:
        process.kill()
        process.communicate()


# --- helpers --------------------------------------------------------------------------------

def tiny(dp=1, mp=1, pp=1, micro=1, layers=2, batch=8, acc=1, hidden=64, **parallel):
    """A small GPT-2 config with the real structure (for the rule tests)."""
    raw = {"model": {"name": "gpt2", "num_layers": layers, "hidden_size": hidden, "num_heads": 8,
                     "seq_length": 16, "vocab_size": 256, "dropout": 0.1,
                     "attention_dropout": 0.1},
           "parallel": {"data_parallel": dp, "model_parallel": mp, "pipeline_stage": pp,
                        "micro_batch_num": micro, "vocab_emb_dp": mp == 1, **parallel},
           "train": {"global_batch_size": batch, "grad_accumulation": acc,
                     "precision": "fp16"},
           "data": {"dataset_dir": "unused"}}
    return config_from_dict(raw, layout_checked=False)


def reshard(path: str, strategy, out_strategy=None):
    """A `customize` hook for build_plan: give the primitive at `path` another strategy
    (and output strategy)."""
    def customize(network):
        cell_path, attr = path.rsplit(".", 1)
        cell = dict(network.cells_and_names())[cell_path]
        getattr(cell, attr).shard(strategy, out_strategy)
    return customize


def messages(plan):
    return [str(v) for v in plan.violations]


def only(plan, rule):
    found = [v for v in plan.violations if v.rule == rule]
    assert found, f"no {rule} violation in {messages(plan)}"
    return found


# --- every shipped layout ---------------------------------------------------------------------

CONFIGS = [os.path.relpath(path, ROOT) for path in plan_config_files()]
_PLANS = {}


def shipped(relative: str):
    if relative not in _PLANS:
        _PLANS[relative] = build_plan(load_config(os.path.join(ROOT, relative),
                                                  layout_checked=False), relative)
    return _PLANS[relative]


REQUIRED_GPT2 = ["1x1x1", "8x1x1", "1x4x1", "1x8x1", "1x1x4", "1x1x8", "2x2x1", "4x2x1",
                 "2x1x4", "2x2x4", "4x2x4", "2x4x4"]


def test_required_layouts_are_shipped():
    names = {os.path.basename(path) for path in CONFIGS}
    for layout in REQUIRED_GPT2:
        dp, mp, pp = layout.split("x")
        assert f"gpt2-1024-d{dp}m{mp}p{pp}.yaml" in names, layout
        assert f"bert-large-d{dp}m{mp}p{pp}.yaml" in names, layout
    for layout in ("dp8", "dp16", "dp32", "dp64", "dp2-mp4", "dp4-mp4", "dp4-mp8", "dp8-mp8"):
        assert f"transformer-base-{layout}.yaml" in names, layout
    for size in ("10b", "50b", "100b"):
        assert any(name.startswith(f"gpt-{size}-") for name in names), size


@pytest.mark.parametrize("relative", CONFIGS)
def test_shipped_config_passes(relative):
    plan = shipped(relative)
    assert not plan.violations, messages(plan)
    assert plan.fits and plan.ok, format_report(plan)
    config = plan.config
    name = os.path.basename(relative)
    match = re.search(r"-d(\d+)m(\d+)p(\d+)(?:v(\d+))?(?:e(\d+))?(?:-910b)?\.yaml$", name)
    short = re.search(r"-dp(\d+)(?:-mp(\d+))?\.yaml$", name)  # dp x mp layouts, no pipeline
    assert match or short, (f"{name}: name a layout ...-d<dp>m<mp>p<pp>[v<chunks>][e<ep>].yaml "
                            f"or ...-dp<dp>-mp<mp>")
    dp, mp, pp = (map(int, match.groups()[:3]) if match
                  else (int(short.group(1)), int(short.group(2) or 1), 1))
    # v<chunks>: an interleaved pipeline; e<ep>: experts over ep devices
    assert config.parallel.pipeline_interleave == int(match and match.group(4) or 1)
    assert config.parallel.expert_parallel == int(match and match.group(5) or 1)
    # planned on the device the name says: the 910B for flash attention or bf16
    assert plan.profile.key == ("ascend910b" if name.endswith("-910b.yaml") else "ascend910")
    load_config(os.path.join(ROOT, relative))  # the trainer reads it as it is
    parallel = config.parallel
    assert (parallel.dp, parallel.mp, parallel.pipeline_stage) == (dp, mp, pp)
    assert plan.device_num == dp * mp * pp
    # every operator with a strategy was seen with real shapes, on every stage
    assert plan.checked_calls > 20 * config.model.num_layers
    assert {call.stage for call in plan.recording.calls} == set(range(pp))
    if name.startswith("gpt2-1024-"):
        model = config.model
        assert (model.hidden_size, model.num_heads) == (1024, 16)
        assert model.num_layers == (48 if pp == 8 else 24)


@pytest.mark.parametrize("name, billions, devices", [
    ("llama2-7b", 6.7, 8), ("llama3-8b", 8.0, 8), ("llama2-13b", 13.0, 16),
    ("llama2-70b", 69.0, 64), ("llama-10b", 10, 16), ("llama-50b", 50, 64),
    ("llama-100b", 100, 128)])
def test_llama_layouts_fit_ascend_910(name, billions, devices):
    """The shipped LLaMA layouts: the published sizes (LLaMA-2 7B is 6.74B parameters, 70B
    68.98B), each on its device count within an Ascend 910's 32 GiB by the plan."""
    (relative,) = [path for path in CONFIGS if os.path.basename(path).startswith(f"{name}-")
                   and not re.search(r"(-910b|v\d+)\.yaml$", path)]   # the 910's, plain
    plan = shipped(relative)
    assert abs(plan.parameter_count / 1e9 - billions) < 0.05 * billions
    assert plan.device_num == devices
    assert plan.device == "ascend910" and plan.worst_stage.total < 32 * GIB


@pytest.mark.parametrize("size, billions, devices", [("10b", 10, 16), ("50b", 50, 64),
                                                     ("100b", 100, 128)])
def test_large_gpt_fits_ascend_910(size, billions, devices):
    (relative,) = [path for path in CONFIGS if os.path.basename(path).startswith(f"gpt-{size}-")]
    plan = shipped(relative)
    assert abs(plan.parameter_count / 1e9 - billions) < 0.1 * billions
    assert plan.device_num == devices
    assert plan.device == "ascend910" and plan.worst_stage.total < 32 * GIB
    # weights, gradients and Adam moments alone (16 bytes a parameter) need several devices
    assert 16 * plan.parameter_count > 4 * 32 * GIB


# --- layout rules -----------------------------------------------------------------------------

def test_device_number_differs_from_layout():
    plan = build_plan(tiny(dp=2, mp=2), device_num=16)
    (violation,) = only(plan, "layout")
    assert ("data_parallel 2 x model_parallel 2 x pipeline_stage 1 = 4 differs from the device "
            "number 16") in str(violation)


def test_device_number_must_be_1_2_4_or_multiple_of_8():
    plan = build_plan(tiny(dp=2, mp=2), device_num=12)
    assert "device number 12 must be 1, 2, 4 or a multiple of 8" in str(only(plan, "G10")[0])
    assert not [v for v in build_plan(tiny(dp=4, mp=2), device_num=8).violations]


def test_too_few_micro_batches():
    plan = build_plan(tiny(pp=4, micro=2, layers=4))
    assert any("parallel.micro_batch_num=2 must be at least parallel.pipeline_stage=4" in m
               for m in messages(plan))


def test_layers_not_divisible_by_stages():
    plan = build_plan(tiny(pp=2, micro=2, layers=3))
    assert any("the model's 3 blocks do not divide into parallel.pipeline_stage=2" in m
               for m in messages(plan))


def test_micro_batches_must_divide_the_batch():
    plan = build_plan(tiny(dp=2, micro=1, batch=6, acc=2))
    (violation,) = only(plan, "batch")
    assert "train.global_batch_size=6 is not divisible by 4" in str(violation)
    # each micro batch of 3 sequences is then split by dp = 2 as well
    assert any(v.rule == "G2" and "split 2 does not divide size 3" in str(v)
               for v in plan.violations)


# --- operator rules (mutated strategies) ------------------------------------------------------

QUERY = "lm.transformer.blocks.0.attention.qkv.product.matmul"
OUTPUT = "lm.transformer.blocks.0.attention.output.product.matmul"


def test_split_that_does_not_divide():
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(QUERY, ((2, 1), (5, 1))))
    violation = only(plan, "G2")[0]
    assert (violation.path, violation.op, violation.input, violation.dim) == (QUERY, "MatMul", 1, 0)
    assert str(violation) == (f"{QUERY} (MatMul) input 1 dimension 0: split 5 does not divide "
                              f"size 192 of input shape (192, 64) (strategy (5, 1)) [G2]")


def test_split_not_power_of_two():
    # 3 divides the micro batch of 48 sequences, but the device number is a power of two
    norm = "lm.transformer.blocks.0.ln_1.normalize.norm"
    plan = build_plan(tiny(dp=2, mp=2, batch=48, layers=1),
                      customize=reshard(norm, ((3, 1, 1), (1,), (1,))))
    violation = only(plan, "G3")[0]
    assert (violation.path, violation.input, violation.dim) == (norm, 0, 0)
    assert "split 3 is not a power of 2 (device number 4)" in str(violation)


def test_mismatched_contraction_splits():
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(OUTPUT, ((2, 2), (1, 1))))
    (violation,) = only(plan, "MatMul")
    assert violation.path == OUTPUT and violation.input == 1 and violation.dim == 1
    assert ("the contracted dimension is split 2 in input 0 but 1 in input 1 (strategy "
            "((2, 2), (1, 1)), transpose_b=True)") in str(violation)


def test_split_softmax_axis():
    softmax = "lm.transformer.blocks.1.attention.core.softmax"
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(softmax, ((1, 2, 1, 2),)))
    (violation,) = only(plan, "Softmax")
    assert (violation.path, violation.input, violation.dim) == (softmax, 0, 3)
    assert "the softmax axis is split 2 (strategy (1, 2, 1, 2), shape (8, 8, 16, 16))" in \
        str(violation)


def test_device_matrix_must_divide_the_stage():
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(QUERY, ((4, 1), (4, 1))))
    (violation,) = only(plan, "G4")
    assert "device matrix (4, 1, 4) (product 16) does not divide the 4 devices" in str(violation)


def test_broadcast_operands_agree():
    add = "lm.transformer.blocks.0.residual_1.add.add"
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(add, ((2, 1, 1), (1, 1, 1))))
    (violation,) = only(plan, "broadcast")
    assert (violation.path, violation.input, violation.dim) == (add, 1, 0)
    assert "split 1 differs from input 0's split 2" in str(violation)


def test_layer_norm_axis_and_rank():
    norm = "lm.transformer.blocks.0.ln_2.normalize.norm"
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(norm, ((2, 1, 2), (2,), (2,))))
    violation = only(plan, "LayerNorm")[0]
    assert (violation.input, violation.dim) == (0, 2)
    assert "normalised axis split 2" in str(violation)
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(norm, ((2, 1), (1,), (1,))))
    (violation,) = only(plan, "G1")
    assert "strategy (2, 1) has 2 values but the input (8, 16, 64) has rank 3" in str(violation)


def test_vocabulary_split_gather_splits_ids_by_batch_only():
    """A vocabulary-split table takes whole ids, or ids split on the batch axis with
    table split x id split = the stage (MindSpore's batch-and-axis Gather)."""
    gather = "lm.transformer.wte.gather"
    assert not build_plan(tiny(dp=2, mp=2)).violations  # ((2, 1), (2, 1)) on 4 devices
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(gather, ((2, 1), (1, 2))))
    (violation,) = only(plan, "Gather")
    assert violation.path == gather and violation.input == 1
    assert "but their strategy is (1, 2)" in str(violation)
    plan = build_plan(tiny(dp=4, mp=2), customize=reshard(gather, ((2, 1), (2, 1))))
    assert "the stage's 8 devices" in str(only(plan, "Gather")[0])


def test_loss_class_dimension_whole_and_operands_alike():
    loss = "loss.softmax_cross_entropy"  # the whole-class loss of a whole-vocabulary head
    config = tiny(dp=2, mp=2, vocab_emb_dp=True)
    plan = build_plan(config, customize=reshard(loss, ((2, 2), (2, 2))))
    (violation,) = only(plan, "loss")
    assert violation.dim == 1 and "the class dimension is split 2" in str(violation)
    plan = build_plan(config, customize=reshard(loss, ((2, 1), (1, 1))))
    assert "logits strategy (2, 1) and labels strategy (1, 1) must be identical" in \
        str(only(plan, "loss")[0])


def test_parameter_split_alike_by_its_users():
    plan = build_plan(tiny(dp=2, mp=2),
                      customize=reshard("lm.head.product.matmul", ((2, 1), (1, 1))))
    (violation,) = only(plan, "parameter")
    assert ("parameter lm.transformer.wte.embedding_table is split (2, 1) by "
            "lm.transformer.wte.gather but (1, 1) here") in str(violation)


def test_strategy_tuples_match_inputs():
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(QUERY, ((2, 1),)))
    (violation,) = only(plan, "G1")
    assert "1 strategy tuples for 2 tensor inputs" in str(violation)


# --- the recording ----------------------------------------------------------------------------

def _signature(rec):
    return [(c.path, c.name, tuple(t.shape for t in c.tensors),
             tuple((o.shape, o.dtype) for o in c.outputs), c.stage, c.recompute_root)
            for c in rec.calls]


@pytest.mark.parametrize("dtype, recompute", [(ms.float16, False), (ms.float32, True)])
def test_shape_rules_agree_with_the_kernels(dtype, recompute):
    """The shape-only recording sees the same operators, shapes and dtypes as a real run."""
    config = GPT2Config(num_layers=2, hidden_size=32, num_heads=4, seq_length=16,
                        vocab_size=64, dropout=0.1, attention_dropout=0.1)
    parallel = ParallelConfig(data_parallel=2, model_parallel=2, vocab_emb_dp=False,
                              recompute=recompute)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (4, 17)), ms.int32)
    real = record(GPT2ForTraining(config, parallel, dtype), [ids], compute=True)
    with no_init_parameters():
        network = GPT2ForTraining(config, parallel, dtype)
    shapes = record(network, [((4, 17), ms.int32)])
    assert _signature(shapes) == _signature(real)
    # float32 on CPU takes the fused kernels (one call for a layer's attention), fp16
    # MindSpore's operators
    assert len(real.calls) > (60 if dtype == ms.float32 else 100)
    # nothing was allocated: every parameter is still waiting for its initialiser
    assert all(param.has_init for param in network.get_parameters())
    if recompute:
        assert sorted(shapes.checkpoints) == ["lm.transformer.blocks.0",
                                              "lm.transformer.blocks.1"]


def test_expert_shape_rules_agree_with_the_kernels():
    """Mixtral's experts (router top k, slots, dispatch, the expert-parallel transposes):
    the shape-only recording sees what the kernels compute."""
    from model_zoo.models.mixtral.model import MixtralConfig, MixtralForTraining
    config = MixtralConfig(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                           ffn_hidden_size=48, num_experts=4, num_experts_per_tok=2,
                           capacity_factor=1.5, seq_length=8, vocab_size=64)
    parallel = ParallelConfig(data_parallel=2, model_parallel=2, expert_parallel=2)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (4, 9)), ms.int32)
    real = record(MixtralForTraining(config, parallel), [ids], compute=True)
    with no_init_parameters():
        network = MixtralForTraining(config, parallel)
    shapes = record(network, [((4, 9), ms.int32)])
    assert _signature(shapes) == _signature(real)
    names = {call.name for call in real.calls}
    assert {"ArgMaxWithValue", "CumSum", "OneHot", "Transpose", "BatchMatMul"} <= names


def test_model_without_plan_inputs_hook():
    from model_zoo.layout.network import network_inputs

    class TwoInputs(ms.nn.Cell):
        def construct(self, a, b):
            return a

    with pytest.raises(PlanError, match="plan_inputs"):
        network_inputs(object(), tiny(), TwoInputs(), 4)


# --- the cost model ---------------------------------------------------------------------------

@pytest.mark.parametrize("compute_bytes, dropout, dp, mp, sp",
                         [(2, True, 1, 1, False), (2, True, 2, 4, False), (2, False, 1, 8, False),
                          (4, True, 2, 2, False), (4, False, 1, 2, False), (2, True, 2, 4, True),
                          (2, True, 1, 8, True), (4, False, 1, 2, True)])
def test_activations_follow_the_closed_form(compute_bytes, dropout, dp, mp, sp):
    """Korthikanti et al.'s per-layer activation memory, adapted to our operators, equals
    what the recording counts for one more GPT-2 block, with and without sequence parallel
    (which splits the layer norms' inputs and statistics and the dropout masks over mp)."""
    def per_micro_batch(layers):
        rate = 0.1 if dropout else 0.0
        raw = {"model": {"name": "gpt2", "num_layers": layers, "hidden_size": 128,
                         "num_heads": 8, "seq_length": 32, "vocab_size": 256, "dropout": rate,
                         "attention_dropout": rate},
               "parallel": {"data_parallel": dp, "model_parallel": mp, "vocab_emb_dp": False,
                            "sequence_parallel": sp},
               "train": {"global_batch_size": 8,
                         "precision": "fp16" if compute_bytes == 2 else "fp32"},
               "data": {"dataset_dir": "unused"}}
        plan = build_plan(config_from_dict(raw, layout_checked=False))
        assert plan.violations == []
        return plan.memory[0].activations_per_micro_batch

    layer = per_micro_batch(2) - per_micro_batch(1)
    expected = memory.gpt2_layer_activation_bytes(8, 32, 128, 8, dp, mp, compute_bytes, dropout,
                                                sequence_parallel=sp)
    assert layer == expected
    if compute_bytes == 2 and dropout:  # the fp16 forms stated in the docstring
        tokens = 8 * 32 / dp
        per_query = 6.125 * 8 * 32 * 32 * (8 / dp) / mp
        if sp:
            assert expected == pytest.approx(
                tokens * 128 * (4 + 32.25 / mp) + 16 * tokens / mp + per_query)
        else:
            assert expected == tokens * 128 * (12.25 + 24 / mp) + 16 * tokens + per_query


def test_matmul_flops_per_step():
    """2 m n k per MatMul, the backward pass twice the forward, recomputed blocks once more,
    for each of the step's micro batches; a dp x mp layout divides it by dp x mp."""
    (plain,) = build_plan(tiny(layers=2, batch=8, acc=2)).compute
    tokens, hidden, vocab, heads, seq = 4 * 16, 64, 256, 8, 16  # micro batch of 4 sequences
    per_layer = (2 * tokens * hidden * hidden * (3 + 1 + 4 + 4)       # q, k, v, out, mlp
                 + 2 * 2 * 4 * heads * seq * seq * (hidden // heads))  # scores and context
    head = 2 * tokens * hidden * vocab
    assert plain.forward == 2 * (2 * per_layer + head)                # 2 micro steps
    assert plain.backward == 2 * plain.forward and plain.recompute == 0
    (split,) = build_plan(tiny(dp=2, mp=2, layers=2, batch=8, acc=2)).compute
    assert split.forward == plain.forward / 4
    (recomputed,) = build_plan(tiny(layers=2, batch=8, acc=2, recompute=True)).compute
    assert recomputed.recompute == 2 * 2 * per_layer
    report = format_report(build_plan(tiny()))
    assert "compute per device per step, MatMul TFLOP" in report


def flash_config(flash, name="gpt2", **parallel):
    raw = {"model": {"name": name, "num_layers": 2, "hidden_size": 128, "num_heads": 4,
                     "seq_length": 32, "vocab_size": 256, "dropout": 0.1,
                     "attention_dropout": 0.0, "flash_attention": flash},
           "parallel": {"data_parallel": 2, "model_parallel": 2, "vocab_emb_dp": False,
                        **parallel},
           "train": {"global_batch_size": 8, "precision": "fp16"},
           "data": {"dataset_dir": "unused"}}
    return config_from_dict(raw, layout_checked=False)


@pytest.mark.parametrize("name, padded, causal", [("gpt2", 0, 2), ("bert", 2, 0),
                                                  ("transformer", 4, 2)])
def test_flash_attention_keeps_no_seq_squared_tensor(name, padded, causal):
    """FlashAttentionScore (910B) passes the rules for all three models and saves, per
    attention layer and micro batch, (4 + c) a s^2 (b/d)/t - 64 a s (b/d)/t - c T h/t bytes
    of activations against the plain attention, less s^2 b/d for a padding mask (cost/memory.py
    docstring). Padded layers: BERT's, the Transformer's encoder and cross attention; causal:
    GPT-2's and the Transformer's decoder self attention (the kernel skips the blocks
    above the diagonal)."""
    flash = build_plan(flash_config(True, name), device="ascend910b")
    plain = build_plan(flash_config(False, name), device="ascend910b")
    assert flash.violations == [] and plain.violations == []
    assert any(call.name == "FlashAttentionScore" for call in flash.recording.calls)
    a, s, b, c, h, t = 4, 32, 8 / 2, 2, 128, 2       # b: sequences per dp slice
    unmasked = (4 + c) * a * s * s * b / t - 64 * a * s * b / t - c * b * s * h / t
    saved = (plain.memory[0].activations_per_micro_batch
             - flash.memory[0].activations_per_micro_batch)
    assert saved == causal * unmasked + padded * (unmasked - s * s * b)
    # the same attention products but the blocks a causal mask skips ((s + 1) / 2s of
    # them computed, sparse_mode 2), and the scores recomputed in the backward pass
    (flash_compute,), (plain_compute,) = flash.compute, plain.compute
    products = 4 * b * a * s * s * (h // a) / t          # one attention layer, forward
    skipped = causal * products * (1 - (s + 1) / (2 * s))
    assert flash_compute.forward == pytest.approx(plain_compute.forward - skipped)
    assert flash_compute.backward == pytest.approx(plain_compute.backward - 2 * skipped)
    assert flash_compute.recompute == pytest.approx(
        (causal * (s + 1) / (2 * s) + padded) * products / 2)


def test_flash_attention_rules():
    """Only on 910B; BNSD inputs split on batch and heads only."""
    plan = build_plan(flash_config(True), device="ascend910")
    assert "runs on Ascend 910B (Atlas A2) only" in str(only(plan, "flash_attention")[0])
    flash = "lm.transformer.blocks.0.attention.core.score"
    plan = build_plan(flash_config(True), device="ascend910b",
                      customize=reshard(flash, ((2, 1, 2, 1),) * 3 + ((1, 1),)))
    violation = only(plan, "FlashAttentionScore")[0]
    assert violation.path == flash and "sequence and head-size axes" in str(violation)


def test_llama_layers_pass_the_plan_and_the_concat_axis_is_read_from_the_primitive():
    """LLaMA tiny at dp2 x mp2 with sequence parallel passes the plan (MindSpore compiles the
    layout too: tests/test_dryrun.py); the rotary Concat takes its axis as an attribute
    (`ops.Concat(axis=-1)`): a split of that axis is refused, a split of the others not."""
    path = os.path.join(ROOT, "model_zoo/models/llama/configs/tiny.yaml")
    overrides = ["parallel.data_parallel=2", "parallel.model_parallel=2",
                 "parallel.sequence_parallel=true"]
    assert not build_plan(load_config(path, overrides, layout_checked=False)).violations
    concat = "lm.model.blocks.0.attention.core.rotary.concat"
    plan = build_plan(load_config(path, overrides, layout_checked=False),
                      customize=reshard(concat, ((2, 1, 1, 2),) * 2))
    violation = only(plan, "Concat")[0]
    assert violation.path == concat and "concatenated axis" in str(violation)


def test_flash_attention_is_refused_where_it_cannot_run():
    parallel = ParallelConfig()
    config = GPT2Config(num_layers=1, hidden_size=64, num_heads=4, seq_length=16,
                        vocab_size=64, flash_attention=True)
    with kernels_for("CPU"), pytest.raises(ConfigError, match="runs only on Ascend 910B"):
        GPT2ForTraining(config, parallel, ms.float16)
    with pytest.raises(ConfigError, match="false on Ascend 910$"):  # the trainer's check
        check_flash_attention_device("Ascend", is_910b=False)
    from model_zoo.models.llama.model import LlamaConfig, LlamaForTraining
    llama = LlamaConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                        seq_length=16, vocab_size=64, flash_attention=True)
    with kernels_for("CPU"), pytest.raises(ConfigError, match="runs only on Ascend 910B"):
        LlamaForTraining(llama, parallel, ms.float16)
    with no_init_parameters(), kernels_for("Ascend"):
        with pytest.raises(ConfigError, match="train.precision=fp16"):
            LlamaForTraining(llama, parallel, ms.float32)
        with pytest.raises(ConfigError, match="attention_dropout=0"):
            GPT2ForTraining(dataclasses.replace(config, attention_dropout=0.1), parallel,
                            ms.float16)
        with pytest.raises(ConfigError, match="train.precision=fp16"):
            GPT2ForTraining(config, parallel, ms.float32)
        with pytest.raises(ConfigError, match="multiple of 16"):
            GPT2ForTraining(dataclasses.replace(config, num_heads=8), parallel, ms.float16)


def test_memory_of_a_standalone_run():
    plan = build_plan(tiny())
    (memory,) = plan.memory
    count = plan.parameter_count
    assert memory.weights == 4 * count and memory.gradients == 4 * count
    assert memory.optimizer == 8 * count
    # fp16 copies of what the linear layers and the head cast: weights, biases, the table;
    # layer norms run in float32 and the position table is added in float32
    cast = sum(p.numel for p in plan.recording.params.values()
               if ".ln_" not in p.name and "ln_f" not in p.name and "wpe" not in p.name)
    assert memory.working_copy == 2 * cast
    # accumulating gradients over micro steps keeps a second set
    assert build_plan(tiny(acc=2, batch=8)).memory[0].gradients == 8 * count


def test_memory_divides_by_model_parallel_and_optimizer_shard():
    single = build_plan(tiny(layers=1)).memory[0]
    split = build_plan(tiny(mp=2, layers=1)).memory[0]
    assert split.weights < 0.6 * single.weights
    sharded = build_plan(tiny(dp=2, layers=1, optimizer_shard=True, batch=8)).memory[0]
    plain = build_plan(tiny(dp=2, layers=1, batch=8)).memory[0]
    assert sharded.optimizer < plain.optimizer and sharded.weights < plain.weights


def test_recompute_keeps_only_block_inputs():
    plain = build_plan(tiny(layers=4)).memory[0]
    recomputed = build_plan(tiny(layers=4, recompute=True)).memory[0]
    assert recomputed.activations < plain.activations
    block_input = 8 * 16 * 64 * 4  # (batch, seq, hidden) float32
    with_blocks = recomputed.activations_per_micro_batch
    assert with_blocks >= 4 * block_input
    assert recomputed.recompute_peak > 0


def test_recomputed_blocks_keep_a_shared_input_once():
    """A LLaMA's recomputed blocks read the micro batch's one rotary (cos, sin) besides
    their own input: each block keeps its input, the stage keeps (cos, sin) once."""
    from model_zoo.models.llama.model import LlamaConfig, LlamaForTraining
    llama = LlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                        seq_length=16, vocab_size=64)
    with no_init_parameters():
        network = LlamaForTraining(llama, ParallelConfig(recompute=True), ms.float16)
    checkpoints = record(network, [((4, 17), ms.int32)]).checkpoints
    first, second = (checkpoints[f"lm.model.blocks.{i}"] for i in range(2))
    assert [info.shape for info in first] == [(4, 16, 64), (16, 16), (16, 16)]
    assert first[0].key != second[0].key and \
        [info.key for info in first[1:]] == [info.key for info in second[1:]]
    path = os.path.join(ROOT, "model_zoo/models/llama/configs/tiny.yaml")
    kept = {layers: build_plan(load_config(path, ["parallel.recompute=true",
                                                  f"model.num_layers={layers}"],
                                           layout_checked=False)).memory[0]
            for layers in (2, 3)}
    config = load_config(path, layout_checked=False)
    block_input = config.train.global_batch_size * config.model.seq_length * \
        config.model.hidden_size * 4   # float32 (batch, seq, hidden)
    assert kept[3].activations_per_micro_batch - kept[2].activations_per_micro_batch == \
        block_input


def test_pipeline_stages_and_communication():
    plan = build_plan(tiny(pp=4, micro=4, layers=4, batch=8))
    first, last = plan.memory[0], plan.memory[-1]
    assert [m.micro_batches_in_flight for m in plan.memory] == [4, 3, 2, 1]
    assert first.activations_per_micro_batch > 0 and last.activations > 0
    assert plan.bubble == pytest.approx(3 / 7)
    # a middle stage sends its output forward and the gradient of its input back, for
    # every micro batch: (micro batch 2 sequences x 16 tokens x 64 hidden) float32
    middle = plan.communication[1]
    assert middle.bytes["send_receive"] == 4 * 2 * (2 * 16 * 64 * 4)
    # no model or data parallelism: only the step's norm and overflow flag, over 4 devices
    assert middle.details[("all_reduce", NORM_REASON)] == [2 * 3 / 4 * 8, 1]
    assert middle.bytes["all_reduce"] == 2 * 3 / 4 * 8


def test_pipeline_accumulation_is_more_micro_batches():
    """On a pipeline, grad_accumulation runs as micro_batch_num x accumulation micro batches
    (one gradient reduction per step), so the bubble shrinks."""
    plan = build_plan(tiny(pp=4, micro=4, layers=4, batch=16, acc=2))
    assert plan.bubble == pytest.approx(3 / 11)


NORM_REASON = "gradient norm and overflow flag (all devices)"


@pytest.mark.parametrize("accumulation", [1, 8])
def test_data_parallel_gradient_reduction_once_per_step(accumulation):
    """gpt2-1024-d8m1p1: one gradient's worth of data-parallel all-reduce per step, however
    many accumulation micro steps make it (MindSpore's GradAccumulation on Ascend)."""
    relative = os.path.join("model_zoo", "models", "gpt2", "configs", "plan",
                            "gpt2-1024-d8m1p1.yaml")
    config = load_config(os.path.join(ROOT, relative),
                         [f"train.grad_accumulation={accumulation}"], layout_checked=False)
    plan = build_plan(config, relative)
    (comm,) = plan.communication
    amount, _ = comm.details[("all_reduce", "parameter gradients (data parallel)")]
    assert amount == pytest.approx(2 * 7 / 8 * 4 * plan.parameter_count)
    assert comm.details[("all_reduce", NORM_REASON)] == [2 * 7 / 8 * 8, 1]


@pytest.mark.parametrize("relative", CONFIGS)
def test_norm_weights_count_every_gradient_element_once(relative):
    """For every shipped layout: over all devices, the pieces each device holds, weighted
    as the train step weights them, cover every element of every parameter exactly once."""
    plan = shipped(relative)
    parallel = plan.config.parallel
    params = list(plan.recording.params.values())
    cover = {param.name: {} for param in params}
    for rank in range(parallel.device_num):
        weights = norm_weights(params, parallel, stage_of_rank(rank, parallel))
        for param, weight in zip(params, weights):
            piece = device_piece(param, parallel, rank)
            assert (piece is None) == (weight == 0), (param.name, rank)
            if piece is not None:
                key = tuple((part.start, part.stop) for part in piece)
                cover[param.name][key] = cover[param.name].get(key, 0.0) + weight
    for param in params:
        pieces = cover[param.name]
        assert all(total == pytest.approx(1.0) for total in pieces.values()), param.name
        elements = sum(math.prod(stop - start for start, stop in key) for key in pieces)
        assert elements == param.numel, param.name


def test_sequence_parallel_splits_the_stream_at_the_same_volume():
    """gpt2-1024-d1m8p1 with parallel.sequence_parallel: the rules pass; each block's
    tensor-parallel all-reduces become all-gathers and reduce-scatters of the same total
    volume (an all-reduce is a reduce-scatter then an all-gather); the checkpointed float32
    inputs of the 24 recomputed blocks (4 T h bytes each), the final layer norm's input and
    statistics (4 T h + 8 T) and the embedding dropout's bit mask (T h / 8) are split over
    mp = 8, and one recomputed block's own activations fall by what the closed form says."""
    path = os.path.join(ROOT, "model_zoo", "models", "gpt2", "configs", "plan",
                        "gpt2-1024-d1m8p1.yaml")
    plain = shipped(os.path.relpath(path, ROOT))
    split = build_plan(load_config(path, ["parallel.sequence_parallel=true"], layout_checked=False))
    assert split.violations == []

    def block_collectives(plan, kinds):
        (comm,) = plan.communication
        return sum(amount for (kind, what), (amount, _) in comm.details.items()
                   if kind in kinds and "blocks" in what)

    assert block_collectives(split, ("all_reduce",)) == 0
    assert block_collectives(split, ("all_gather",)) == block_collectives(
        split, ("reduce_scatter",)) > 0
    assert block_collectives(split, ("all_gather", "reduce_scatter")) == pytest.approx(
        block_collectives(plain, ("all_reduce",)))
    assert split.communication[0].total == pytest.approx(plain.communication[0].total)
    tokens, hidden, mp = 8 * 1024, 1024, 8
    (before,), (after,) = plain.memory, split.memory
    kept = (24 * 4 * tokens * hidden + 4 * tokens * hidden + 8 * tokens
            + tokens * hidden * memory.MASK_BYTES)
    assert (before.activations_per_micro_batch - after.activations_per_micro_batch
            == kept * (1 - 1 / mp))
    block = functools.partial(memory.gpt2_layer_activation_bytes, 8, 1024, 1024, 16, 1, 8)
    assert before.recompute_peak - after.recompute_peak == \
        block() - block(sequence_parallel=True)


def test_sequence_parallel_rules():
    """Rule G6: a row-split MatMul's output strategy splits its rows by dp (all-reduce) or
    dp x mp (reduce-scatter) and its columns like the weight; no other operator takes one."""
    config = tiny(dp=2, mp=2, sequence_parallel=True)
    assert build_plan(config).violations == []
    row = "lm.transformer.blocks.0.attention.output.product.matmul"
    plan = build_plan(config, customize=reshard(row, ((2, 2), (1, 2)), ((4, 2),)))
    (violation,) = only(plan, "G6")
    assert violation.path == row and "columns must be split 1" in str(violation)
    plan = build_plan(config, customize=reshard(row, ((2, 2), (1, 2)), ((8, 1),)))
    assert "rows must be split 2 (all-reduce) or 4 (reduce-scatter)" in str(only(plan, "G6")[0])
    norm = "lm.transformer.blocks.0.ln_1.normalize.norm"
    plan = build_plan(config, customize=reshard(norm, ((4, 1), (1,), (1,)), ((4, 1),)))
    assert only(plan, "G6")[0].path == norm
    plan = build_plan(tiny(sequence_parallel=True))
    assert "sequence_parallel=true needs parallel.model_parallel > 1" in str(
        only(plan, "layout")[0])
    # 3 sequences of 16 tokens do not cut into 4 whole sequences or equal parts of one
    plan = build_plan(tiny(dp=2, mp=2, batch=3, sequence_parallel=True, full_batch=True))
    assert "does not cut into data_parallel x model_parallel = 4" in str(only(plan, "layout")[0])
    for batch in (2, 8):  # parts of sequences, whole sequences
        assert build_plan(tiny(dp=2, mp=2, batch=batch, sequence_parallel=True,
                               full_batch=True)).violations == []


@pytest.mark.parametrize("name", ["gpt2", "bert", "transformer"])
def test_sequence_parallel_moves_the_same_block_volume(name):
    """dp 2 x mp 2, all three models: the rules pass with sequence parallel, and the
    blocks' all-gathers and reduce-scatters add up to the all-reduces they replace (where
    the stream only becomes more split, e.g. after the embedding, nothing moves)."""
    def plan(sequence_parallel):
        raw = {"model": {"name": name, "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                         "seq_length": 16, "vocab_size": 256, "dropout": 0.1,
                         "attention_dropout": 0.1},
               "parallel": {"data_parallel": 2, "model_parallel": 2, "vocab_emb_dp": False,
                            "sequence_parallel": sequence_parallel},
               "train": {"global_batch_size": 8, "precision": "fp16"},
               "data": {"dataset_dir": "unused"}}
        built = build_plan(config_from_dict(raw, layout_checked=False))
        assert built.violations == []
        return built.communication[0]

    plain, split = plan(False), plan(True)

    def blocks(comm, kinds):
        return sum(amount for (kind, what), (amount, _) in comm.details.items()
                   if kind in kinds and (".layer." in what or ".blocks." in what
                                         or "layers." in what))

    assert blocks(split, ("all_reduce",)) == 0
    assert blocks(split, ("all_gather", "reduce_scatter")) == pytest.approx(
        blocks(plain, ("all_reduce",)))
    assert not [what for kind, what in split.details
                if kind == "all_gather" and "(2, 1) -> (4, 1)" in what]
    if name == "gpt2":  # nothing outside the blocks takes whole sequences
        assert split.total == pytest.approx(plain.total)


@pytest.mark.parametrize("layout", [dict(dp=2, mp=2), dict(mp=2, pp=2, micro=2),
                                    dict(dp=4, mp=2, optimizer_shard=True),
                                    dict(dp=2, mp=2, pp=2, micro=2, optimizer_shard=True)])
def test_weighted_local_norms_sum_to_the_full_norm(layout):
    """Real numbers: slicing a random gradient set as the layout says and summing weight x
    local squared norm over every device gives numpy's squared norm of the whole set
    (hidden 256: large enough for the optimizer shard to cut the weights)."""
    plan = build_plan(tiny(layers=2, batch=16, hidden=256, **layout))
    parallel = plan.config.parallel
    params = list(plan.recording.params.values())
    random = np.random.default_rng(0)
    grads = [random.standard_normal(param.shape) for param in params]
    assert any(optimizer_shard_size(p, parallel) > 1 for p in params) == parallel.optimizer_shard
    total = 0.0
    for rank in range(parallel.device_num):
        weights = norm_weights(params, parallel, stage_of_rank(rank, parallel))
        for param, grad, weight in zip(params, grads, weights):
            piece = device_piece(param, parallel, rank)
            if piece is not None:
                total += weight * float(np.sum(grad[piece] ** 2))
    assert total == pytest.approx(sum(float(np.sum(g ** 2)) for g in grads), rel=1e-12)


def test_vocabulary_parallel_loss_gathers_no_logits():
    """gpt2-1024-d1m8p1 (vocabulary split 8 ways): the logits are never all-gathered (they
    were 86 GiB of all-gather and as much reduce-scatter per device per step)."""
    plan = shipped(os.path.join("model_zoo", "models", "gpt2", "configs", "plan",
                                "gpt2-1024-d1m8p1.yaml"))
    (comm,) = plan.communication
    gathers = [what for kind, what in comm.details if kind == "all_gather"]
    assert gathers == ["slice: input 0 redistributed (8, 1) -> (1, 1)"]  # the token ids
    assert comm.bytes["all_gather"] < 4e6 and comm.bytes["reduce_scatter"] == 0
    tokens = 8 * 1024  # a micro batch: 512 sequences / 64 accumulation steps, of 1024
    loss = [amount for (kind, what), (amount, _) in comm.details.items()
            if what.startswith("loss.") and not what.startswith("loss.sum:")]
    # four all-reduces of one float32 per token, for each of the 64 micro steps
    assert sum(loss) == pytest.approx(4 * 64 * 2 * 7 / 8 * tokens * 4)


def test_data_parallel_gradient_all_reduce():
    plan = build_plan(tiny(dp=8, batch=8, layers=1))
    (comm,) = plan.communication
    count = plan.parameter_count
    amount, _ = comm.details[("all_reduce", "parameter gradients (data parallel)")]
    assert amount == pytest.approx(2 * 7 / 8 * 4 * count)
    # the rest is the loss's sum over the batch split
    assert comm.bytes["all_reduce"] - amount < 100
    assert comm.bytes["all_gather"] == comm.bytes["send_receive"] == 0


def test_model_parallel_communication():
    """Per block and micro batch: two forward all-reduces (row-split outputs) and two
    backward ones (inputs of the fused column-split QKV and of the expansion; three separate
    Q, K, V projections needed four), each of a (tokens / dp, hidden) fp16 slice,
    2 (mp - 1) / mp of it sent. The vocabulary-split
    head's loss never gathers the logits: per token it all-reduces the maximum, the sum of
    exponentials and the target's log-probability forward, and one value backward."""
    dp, mp = 2, 4
    plan = build_plan(tiny(dp=dp, mp=mp, layers=1, batch=8))
    (comm,) = plan.communication
    slice_bytes = 8 * 16 * 64 * 2 / dp
    block = [amount for (kind, what), (amount, _) in comm.details.items()
             if kind == "all_reduce" and "blocks" in what]
    assert sum(block) == pytest.approx(4 * 2 * (mp - 1) / mp * slice_bytes)
    # the only gather left is the token ids' (dataset strategy: each of the 8 ranks reads
    # its own slice; the graph regathers them over mp)
    gathers = [what for kind, what in comm.details if kind == "all_gather"]
    assert gathers == ["slice: input 0 redistributed (8, 1) -> (2, 1)"]
    assert comm.bytes["reduce_scatter"] == 0
    loss = {what: amount for (kind, what), (amount, _) in comm.details.items()
            if what.startswith("loss.") and not what.startswith("loss.sum:")}  # not the mean
    per_token = 2 * (mp - 1) / mp * 8 * 16 * 4 / dp  # one float32 per token of a dp slice
    assert sorted(loss) == ["loss.max: reduction over a split dimension",
                            "loss.normalise: gradient of broadcast input 1",
                            "loss.sum_classes: reduction over a split dimension",
                            "loss.sum_exp: reduction over a split dimension"]
    assert all(amount == pytest.approx(per_token) for amount in loss.values())


# --- the command ------------------------------------------------------------------------------

D2M2P4 = "model_zoo/models/gpt2/configs/plan/gpt2-1024-d2m2p4.yaml"


def test_cli_table(tmp_path):
    result = run_cli("plan", D2M2P4, "--device-num", "16", "--device", "ascend910b")
    assert result.returncode == 0, result.stdout + result.stderr
    for text in ("16 devices; data_parallel 2 x model_parallel 2 x pipeline_stage 4",
                 "memory per device, GiB (Ascend 910B: 64.00)", "worst stage",
                 "communication per device per step", "pipeline bubble: 8.6%", "OK"):
        assert text in result.stdout, text


def test_cli_json_and_exit_status(tmp_path, capsys):
    from model_zoo.cli import main
    path = tmp_path / "tiny.yaml"
    config = tiny(dp=2, mp=2, pp=4, micro=4, layers=4, batch=16)
    import yaml
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    status = main(["plan", str(path), "--json", "--set", "parallel.micro_batch_num=2",
                   "--device-num", "32"])
    assert status == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["layout"]["device_num"] == 32
    texts = [v["text"] for v in report["violations"]]
    assert any("= 16 differs from the device number 32" in t for t in texts)
    assert any("parallel.micro_batch_num=2 must be at least parallel.pipeline_stage=4" in t
               for t in texts)
    assert report["memory"]["fits"] is True and len(report["memory"]["stages"]) == 4
    assert {"all_reduce", "all_gather", "reduce_scatter", "send_receive"} <= set(
        report["communication"])
    assert main(["plan", str(path), "--set", "parallel.no_such_key=1"]) == 2
    assert "parallel.no_such_key" in capsys.readouterr().err


def test_report_names_violations_and_memory_overflow():
    plan = build_plan(tiny(dp=2, mp=2), customize=reshard(
        "lm.transformer.blocks.1.attention.core.softmax", ((1, 2, 1, 2),)))
    text = format_report(plan)
    assert "lm.transformer.blocks.1.attention.core.softmax (Softmax) input 0 dimension 3" in text
    assert text.rstrip().endswith("FAILED: 1 violation(s)")
    big = build_plan(load_config(
        os.path.join(ROOT, "model_zoo/models/gpt2/configs/plan/gpt2-1024-d1m1p1.yaml"),
        ["train.grad_accumulation=1"], layout_checked=False))  # 512 sequences at once on one device
    assert not big.fits and "DOES NOT FIT" in format_report(big)


# --- docs/parallelism.md ----------------------------------------------------------------------

def test_every_sharded_layer_is_documented():
    documented = {layer for layer, _, _ in _layer_examples()}
    missing = set(sharded_layer_names()) - documented
    assert not missing, (f"add {sorted(missing)} to _layer_examples in "
                         f"model_zoo/plan/docs.py, then run "
                         f"`model-zoo plan --update-docs`")


def test_doc_is_generated_from_the_code():
    with open(os.path.join(ROOT, DOC_PATH), encoding="utf-8") as handle:
        text = handle.read()
    plans = {relative: shipped(relative) for relative in CONFIGS}
    assert render_doc(text, generated_sections(plans), DOC_PATH) == text, (
        "docs/parallelism.md is out of date: run `model-zoo plan --update-docs`")
    assert ("| `Linear` | split=\"row\" | MatMul (`product.matmul`) | `((dp, mp), (1, mp))` |"
            in text)


# --- the estimate against a measured CPU run --------------------------------------------------

def test_memory_estimate_against_a_measured_cpu_run(cpu_memory_run):
    """The estimate for the stand-alone MEMORY_CONFIG against a real stand-alone training
    run of it on CPU (3 steps of the model folder's network and the trainer's AdamW), whose
    resident memory is measured above the baseline taken just before it builds the model.

    Tolerances, and why:
    - weights: the resident memory the built network adds is the fp32 weights the estimate
      counts, within 15% or 2 MiB (malloc reuses some memory freed by the warm-up run);
    - peak: the estimate describes a device runtime that frees every forward tensor as soon
      as the backward pass no longer needs it, so a real run uses at least the estimate.
      PyNative on CPU keeps most forward outputs alive until the backward pass reaches
      them, so it uses at most what a run that kept every forward output would use: the
      estimate with its saved activations replaced by all the forward outputs the recording
      saw ("keep-everything"). The run must lie in [estimate, 1.25 x keep-everything]; the
      25% covers what neither counts: the allocator's block caching and rounding and the
      optimizer's per-parameter temporaries (measured here: about 8%).
    A wrong shape, dtype size or slice in the estimate moves it out of this band: the
    activations alone are half of the estimate for this config.
    """
    out, err = cpu_memory_run.communicate(timeout=600)
    assert cpu_memory_run.returncode == 0, err[-3000:]
    measured = json.loads(out.strip().splitlines()[-1])
    assert all(np.isfinite(measured["losses"]))
    plan = build_plan(config_from_dict(json.loads(json.dumps(MEMORY_CONFIG)), layout_checked=False))
    (memory,) = plan.memory
    estimate = memory.total
    seen, forward_outputs = set(), 0
    for call in plan.recording.calls:
        for out_info in call.outputs:
            if out_info.key not in seen and out_info.param is None:
                seen.add(out_info.key)
                forward_outputs += out_info.nbytes
    keep_everything = estimate - memory.activations_per_micro_batch + forward_outputs
    peak, built = measured["peak"], measured["built"]
    print(f"weights: estimate {memory.weights / 2**20:.1f} MiB, measured {built / 2**20:.1f} MiB; "
          f"peak: estimate {estimate / 2**20:.1f} MiB, keep-everything "
          f"{keep_everything / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB")
    assert abs(built - memory.weights) <= max(2 * 2**20, 0.15 * memory.weights)
    assert memory.activations_per_micro_batch > 0.5 * (estimate - memory.backward_working) / 2
    assert estimate <= peak <= 1.25 * keep_everything


# --- recompute modes and uneven stages ----------------------------------------------------------

KNOBS_BASE = ["model.num_layers=6", "parallel.model_parallel=2", "parallel.pipeline_stage=2",
              "parallel.micro_batch_num=4", "train.global_batch_size=8", "train.precision=fp16"]


def knob_plan(*overrides):
    path = "model_zoo/gpt2/configs/tiny.yaml"
    return build_plan(load_config(path, KNOBS_BASE + list(overrides), layout_checked=False), path)


def test_selective_recompute_recomputes_the_attention_core_only():
    """Selective recompute keeps less than none and more than full recompute, and what it
    recomputes is the attention core (MindFormers' select_recompute set): no projection."""
    plans = {mode: knob_plan(f"parallel.recompute={mode}")
             for mode in ("false", "selective", "true")}
    kept = {mode: plan.memory[0].activations_per_micro_batch for mode, plan in plans.items()}
    assert kept["false"] > kept["selective"] > kept["true"]
    recomputed = [call for call in plans["selective"].recording.calls if call.recompute_root]
    assert recomputed and all(call.recompute_root.endswith("attention.core/recomputed")
                              for call in recomputed)
    assert {call.name for call in recomputed} <= {"Mul", "BatchMatMul", "Cast", "Add",
                                                   "Softmax", "StridedSlice"}   # causal bias
    assert sum(call.name == "BatchMatMul" for call in recomputed) == 2 * 6   # scores, context
    assert 0 < plans["selective"].compute[0].recompute < plans["true"].compute[0].recompute
    assert plans["selective"].compute[0].recompute == plans["selective"].compute[0].attention / 4


def test_stage_blocks_and_recompute_blocks_place_and_recompute_what_they_say():
    plan = knob_plan("parallel.stage_blocks=[4,2]", "parallel.recompute=true",
                     "parallel.recompute_blocks=[1,0]")
    blocks = {stage: {name.split(".")[3] for name, param in plan.recording.params.items()
                      if ".blocks." in name and param.stage == stage} for stage in (0, 1)}
    assert blocks == {0: {"0", "1", "2", "3"}, 1: {"4", "5"}}
    roots = {call.recompute_root for call in plan.recording.calls if call.recompute_root}
    assert roots == {"lm.transformer.blocks.0"}
    assert plan.compute[1].recompute == 0 < plan.compute[0].recompute
    # the flow shop: each of the 4 micro steps at the slower stage's pace, the rest once
    micro = [(s.compute + s.exposed_communication) / 4 for s in plan.time.stages]
    assert plan.time.bubble == pytest.approx(sum(micro) - max(micro))
    assert plan.time.to_dict()["bubble_s"] < max(micro)


def test_interleaved_chunks_go_round_the_stages_and_shorten_the_bubble():
    """pipeline_interleave 2 on 2 stages: blocks 0-1 on stage 0, 2-3 on 1, 4-5 on 0 again,
    6-7 on 1 (MindFormers' LayerSetting order); the bubble (pp - 1) / (v m + pp - 1) and
    the flow shop's fill in half steps; more micro batches in flight (Megatron's
    interleaved warm-up: ceil(5 / 2) = 3 on stage 0, ceil(3 / 2) = 2 on stage 1); the
    sends cross every chunk border."""
    plain, interleaved = (knob_plan("model.num_layers=8", f"parallel.pipeline_interleave={v}")
                          for v in (1, 2))
    assert not interleaved.violations
    stage_of = {int(name.split(".")[3]): param.stage
                for name, param in interleaved.recording.params.items() if ".blocks." in name}
    assert [stage_of[block] for block in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert plain.bubble == pytest.approx(1 / 5) and interleaved.bubble == pytest.approx(1 / 9)
    micro = [(s.compute + s.exposed_communication) / 4 for s in interleaved.time.stages]
    assert interleaved.time.bubble == pytest.approx((sum(micro) - max(micro)) / 2)
    assert [m.micro_batches_in_flight for m in plain.memory] == [2, 1]
    assert [m.micro_batches_in_flight for m in interleaved.memory] == [3, 2]
    sends = [sum(comm.details[key][0] for key in comm.details if key[0] == "send_receive"
                 and key[1].startswith("stage ")) for comm in (plain.communication[1],
                                                               interleaved.communication[1])]
    assert sends[1] > sends[0]   # the last stage now also sends to the first


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pipeline_interleave=2"], "needs parallel.pipeline_stage > 1"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.pipeline_interleave=2", "parallel.stage_blocks=[1,1]"], "stage_blocks"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.pipeline_scheduler=seqpipe"], "set parallel.pipeline_interleave > 1"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.pipeline_interleave=2", "parallel.pipeline_scheduler=zero_bubble_v"],
     "must be one of 1f1b, seqpipe"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.pipeline_interleave=0"], "must be >= 1"),
    (["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
      "parallel.pipeline_interleave=3"], "pipeline_stage x parallel.pipeline_interleave = 6")])
def test_interleave_settings_that_are_not_one_are_refused(overrides, message):
    path = "model_zoo/gpt2/configs/tiny.yaml"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, ["model.num_layers=4", "train.global_batch_size=8"] + overrides)


def test_bf16_is_planned_on_devices_that_have_it():
    plan = knob_plan("train.precision=bf16")
    assert plan.profile.key == "ascend910b" and not plan.violations
    path = "model_zoo/gpt2/configs/tiny.yaml"
    on_910 = build_plan(load_config(path, KNOBS_BASE + ["train.precision=bf16"],
                                    layout_checked=False), path,
                        device="ascend910")
    assert any(v.rule == "precision" for v in on_910.violations)


def test_a_layout_fits_only_within_what_a_run_may_fill():
    """The runtime keeps part of the device (MindFormers' max_device_memory: 30 of a 910's
    32 GiB): a worst stage between the two does not fit."""
    plan = knob_plan()
    assert plan.profile.usable_memory == 30 * 2 ** 30 < plan.profile.memory
    worst = plan.worst_stage.total
    squeezed = dataclasses.replace(plan, profile=dataclasses.replace(
        plan.profile, usable_memory=int(worst) - 1, memory=int(worst) + 2 ** 30))
    assert plan.fits and not squeezed.fits
    assert "DOES NOT FIT" in format_report(squeezed)
