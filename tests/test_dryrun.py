"""`model-zoo dryrun`: MindSpore's own semi-auto-parallel compiler on our layouts.

Every shipped layout is compiled for the first rank of its first and last pipeline stage
(of a 16-stage one the last only: `compiled_ranks`),
at one block per stage and one accumulation step (`reduced_overrides`), and MindSpore's
parameter layouts are held against the plan's. The compiles are MindSpore's (its dry run on
the wheel's GPU plugin); nothing here stands in for them.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import run_cli
from model_zoo.errors import UserInputError
from model_zoo.parallel.strategy_file import parameter_layout
from model_zoo.dryrun import cuda_stubs
from model_zoo.plan.docs import MODELS_DIR, cluster_config_files
from model_zoo.dryrun.numbers import one_device_steps
from model_zoo.parallel.context import eval_network_compiles
from model_zoo.dryrun.run import blocks_overrides, run_dryrun, select_ranks
from model_zoo.parallel.compiled_layouts import compare_layouts
from model_zoo.config import load_config
from model_zoo.cost.build import build_plan, default_device
from model_zoo.train.loop import sink_size_of

pytestmark = pytest.mark.slow   # the slow tier (tests/conftest.py)

TINY = "model_zoo/models/gpt2/configs/tiny.yaml"
DP2_MP2 = ["parallel.data_parallel=2", "parallel.model_parallel=2"]
def reduced_overrides(path: str) -> list:
    """One block per pipeline stage (uneven `stage_blocks`: one on the smallest stages, two
    on the others), one accumulation step and as few pipeline micro batches as
    stages (MindSpore unrolls each micro batch into the graph): the layout stays, the
    strategies do not depend on the counts (accumulation and micro batches have their own
    test below; benchmarks/compile_time.py compiles the full configurations)."""
    config = load_config(path, layout_checked=False)
    parallel = config.parallel
    counts = parallel.stage_blocks or [1] * parallel.pipeline_stage
    # an interleaved stage holds one block a chunk, each that much narrower (the strategies
    # do not depend on the width either)
    chunks = parallel.pipeline_interleave
    narrower = [f"model.ffn_hidden_size={config.model.ffn_hidden_size // chunks}"] \
        if chunks > 1 else []
    blocks = [chunks * (1 + (n > min(counts))) for n in counts]
    # two of a token's experts, not eight: each further top-k pass repeats the same
    # operators and strategies (ArgMaxWithValue, OneHot, the slot arithmetic)
    fewer_choices = ["model.num_experts_per_tok=2"] \
        if getattr(config.model, "num_experts_per_tok", 0) > 2 else []
    return blocks_overrides(parallel, blocks) + narrower + fewer_choices + [
        "train.grad_accumulation=1", f"parallel.micro_batch_num={parallel.pipeline_stage}"]


def first_and_last_stage(config) -> list:
    parallel = config.parallel
    return sorted({0, (parallel.pipeline_stage - 1) * parallel.devices_per_stage})


def compiled_ranks(config) -> list:
    """The ranks the shipped tier compiles: the first of the first and of the last stage; of
    a 16-stage layout the last stage's only (the suite's budget: these compile longest).
    Each of those (gpt-100b, llama-100b, mixtral-8x22b) has a sibling of 8 or 4 stages with
    the same parallel settings at another width (gpt-50b, llama-50b, mixtral-8x7b), whose
    first stage the tier compiles."""
    ranks = first_and_last_stage(config)
    return ranks[-1:] if config.parallel.pipeline_stage >= 16 else ranks


def evaluated_ranks(ranks) -> list:
    """The ranks whose evaluation network the shipped tier compiles (`shipped_dryruns`):
    the last stage's (the loss's)."""
    return ranks[-1:]


def ranks_of(result) -> list:
    return [rank.rank for rank in result.ranks]


@pytest.fixture(scope="module")
def shipped_dryruns(request):
    """{config path: Future of its DryRun}, the selected configs compiled two at a time, each
    as the chip it is planned for builds it (`default_device`: the 910's float-status
    overflow check, or the 910B's flash attention and bf16). The held-out evaluation
    network is compiled on the last stage (`evaluated_ranks`: the first stage's would take
    more compile time than the suite's budget holds; `model-zoo dryrun` compiles it on
    every rank it is asked for)."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if item.originalname == "test_every_shipped_layout_compiles"]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for path in selected:   # plans here, one at a time; the compiles two at a time
        overrides = reduced_overrides(path)
        config = load_config(path, overrides, layout_checked=False)
        ranks = compiled_ranks(config)
        futures[path] = pool.submit(run_dryrun, config, path, overrides, ranks, jobs=1,
                                    timeout=900, plan=build_plan(config, path),
                                    evaluation=evaluated_ranks(ranks),
                                    as_device=default_device(config))
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("path", cluster_config_files(),
                         ids=lambda path: os.path.relpath(path, MODELS_DIR))
def test_every_shipped_layout_compiles(path, shipped_dryruns):
    result = shipped_dryruns[path].result()
    for rank in result.ranks:
        assert rank.compiled, f"rank {rank.rank}: {rank.error}"
        assert not rank.layout_mismatches, rank.layout_mismatches[:3]
        # the held-out evaluation network too, which the trainer evaluates through (with
        # pipeline stages and sequence parallel too: no Reshape on a stage border), except
        # on an interleaved pipeline, which MindSpore's pipeline inference does not take
        assert rank.eval_error is None, rank.eval_error
        config = load_config(path, layout_checked=False)
        assert (rank.eval_compile_s is not None) == (eval_network_compiles(
            config.parallel) and rank.rank in evaluated_ranks(ranks_of(result)))
        # the 910's overflow check (NPUGetFloatStatusV2) is in the graph it compiles; the
        # 910B's default INFNAN mode needs none
        on_910 = default_device(load_config(path, layout_checked=False)) == "ascend910"
        assert (rank.float_status_ops > 0) == on_910, rank.float_status_ops
        # the step an Ascend run of this config trains: sunk when the trainer sinks it
        assert rank.sink_size == sink_size_of(load_config(path,
                                                          layout_checked=False).train, "Ascend", 0)
    assert result.ok
    if result.device_num > 1:   # a parallel layout: MindSpore inserted its communication
        assert any(rank.collectives for rank in result.ranks)


LLAMA_TINY = "model_zoo/models/llama/configs/tiny.yaml"
MIXTRAL_TINY = "model_zoo/models/mixtral/configs/tiny.yaml"


@pytest.mark.parametrize("overrides", [
    ["parallel.data_parallel=2", "parallel.model_parallel=2",
     "parallel.sequence_parallel=true", "parallel.optimizer_shard=true"],
    ["parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
     "parallel.vocab_emb_dp=false", "parallel.optimizer_shard=true", "model.num_layers=3",
     "parallel.stage_blocks=[2,1]", "parallel.recompute=selective",
     "parallel.recompute_blocks=[1,0]"],
], ids=["dp2-mp2-sp-shard", "mp2-pp2-shard-uneven-selective"])
def test_llama_grouped_heads_compile_on_every_stage(overrides):
    """LLaMA tiny (4 query heads over 2 key/value heads split by mp 2, rotary positions,
    SwiGLU, an untied head on the last stage; on the pipeline, uneven stages and selective
    recompute of the first block): MindSpore compiles every stage and its layouts are the
    plan's."""
    config = load_config(LLAMA_TINY, overrides, layout_checked=False)
    result = run_dryrun(config, LLAMA_TINY, overrides, select_ranks("stages", config.parallel))
    assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]
    assert all(rank.eval_error is None for rank in result.ranks)


def test_experts_compile_in_bf16_on_a_pipeline_with_the_optimizer_shard():
    """Mixtral tiny as an Ascend 910B run builds it: bf16, flash attention, dropping
    capacity, shared experts, expert parallel 2 on a 2-stage pipeline with the optimizer
    shard (whose bf16 gathers inside the pipeline the dry run accepts as Ascend does:
    `rank.allow_ascend_collective_dtypes`): every stage compiles with its AllToAlls, and
    the layouts are the plan's."""
    overrides = ["parallel.data_parallel=2", "parallel.expert_parallel=2",
                 "parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
                 "parallel.optimizer_shard=true", "train.precision=bf16",
                 "model.flash_attention=true", "model.capacity_factor=1.1",
                 "model.num_shared_experts=1"]
    config = load_config(MIXTRAL_TINY, overrides, layout_checked=False)
    result = run_dryrun(config, MIXTRAL_TINY, overrides, select_ranks("stages", config.parallel),
                        as_device="ascend910b",
                        plan=build_plan(config, MIXTRAL_TINY, device="ascend910b"))
    assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]
    assert all(rank.collectives.get("AllToAll") for rank in result.ranks)


def test_experts_sit_where_the_all_to_all_puts_their_tokens():
    """dp16 x ep8 (the shipped Mixtral-8x7B's stage; two experts' copies over the outer
    groups, one layer of 8 experts at capacity 1.5): MindSpore compiles each MoE layer with
    the dispatch's and the combine's AllToAll over 8 neighbouring ranks, forward and
    backward, and no redistribution over the whole stage (before the outer groups came
    first: 14 AllToAll over 2, 4 and 8 ranks, an AllGather and a ReduceScatter); the
    experts' gradients are all-reduced over their 2 copies."""
    overrides = ["model.num_layers=1", "model.num_experts=8", "model.capacity_factor=1.5",
                 "parallel.expert_parallel=8", "parallel.data_parallel=16"]
    config = load_config(MIXTRAL_TINY, overrides, layout_checked=False)
    result = run_dryrun(config, MIXTRAL_TINY, overrides, [0])
    assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]
    groups = result.ranks[0].collective_groups
    assert groups["AllToAll"] == {"8": 4}
    assert "AllGather" not in groups and "ReduceScatter" not in groups
    assert groups["AllReduce"].get("2") == 3     # gate, up, down over the outer groups


def test_llama_flash_attention_takes_the_grouped_heads_as_they_are():
    """FlashAttentionScore with 4 query heads over 2 key/value heads, not repeated (mp 2: one
    key/value head and two query heads a device): MindSpore's compiler accepts the grouped
    shapes and the layouts are the plan's for Ascend 910B."""
    overrides = ["parallel.data_parallel=2", "parallel.model_parallel=2",
                 "model.flash_attention=true", "train.precision=fp16"]
    config = load_config(LLAMA_TINY, overrides, layout_checked=False)
    result = run_dryrun(config, LLAMA_TINY, overrides, [0],
                        plan=build_plan(config, LLAMA_TINY, device="ascend910b"))
    assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]


def test_the_sunk_step_holds_the_fed_steps_collectives():
    """Dataset sink mode (Ascend's default): the step compiled behind MindSpore's data
    queue, as Model.build compiles it, inserts the collectives of the step fed from the
    host, on both pipeline stages with the optimizer shard."""
    base = ["parallel.data_parallel=2", "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=2", "parallel.optimizer_shard=true",
            "train.log_steps=5", "train.save_steps=10"]
    found = {}
    for sink in ("true", "false"):
        overrides = base + [f"train.dataset_sink={sink}"]
        config = load_config(TINY, overrides, layout_checked=False)
        result = run_dryrun(config, TINY, overrides, [0, 2])
        assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]
        assert [rank.sink_size for rank in result.ranks] == [5 if sink == "true" else 0] * 2
        found[sink] = [rank.collective_groups for rank in result.ranks]
    assert found["true"] == found["false"] and found["true"][0]["Send"]


def test_tiny_dp2_mp2_json_interface(tmp_path):
    """The interface: one JSON object, per rank its compile, collectives with their group
    sizes, layouts against the plan; the strategy file and log kept with --output-dir."""
    result = run_cli("dryrun", TINY, *[f"--set={o}" for o in DP2_MP2], "--ranks", "0,3",
                     "--json", "--output-dir", tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["device_num"] == 4
    assert [rank["rank"] for rank in report["ranks"]] == [0, 3]
    for rank in report["ranks"]:
        assert set(rank) >= {"rank", "stage", "compiled", "compile_s", "peak_rss_mb",
                             "collectives", "layout_mismatches", "error"}
        assert rank["compiled"] and rank["error"] is None and rank["stage"] == 0
        assert rank["compile_s"] > 0 and rank["peak_rss_mb"] > 100
        assert rank["layout_mismatches"] == []
        # mp all-reduces of the row-split projections (2 devices), the replicated
        # parameters' mirror all-reduces and the gradient norm over all 4
        assert set(rank["collective_groups"]["AllReduce"]) == {"2", "4"}
        assert rank["collectives"]["AllReduce"] == sum(
            rank["collective_groups"]["AllReduce"].values())
        assert os.path.getsize(rank["strategy_file"]) > 0
        assert os.path.isfile(tmp_path / f"rank_{rank['rank']}" / "dryrun.log")


def test_micro_steps_share_one_graph():
    """gpt2-1024-d2m2p1 as shipped accumulates 32 micro batches: the model is one subgraph
    that every micro step calls, so the compiled step holds as many collectives as with 2
    (unrolled, each micro step would bring its own)."""
    path = "model_zoo/models/gpt2/configs/plan/gpt2-1024-d2m2p1.yaml"
    found = {}
    for accumulation in (2, 32):
        overrides = ["model.num_layers=2", f"train.grad_accumulation={accumulation}"]
        result = run_dryrun(load_config(path, overrides,
                                        layout_checked=False), path, overrides, [0])
        assert result.ok, result.ranks[0].error
        found[accumulation] = result.ranks[0].collectives
    assert found[32] == found[2] and found[2]["AllReduce"] > 0


def test_pipeline_with_optimizer_shard_compiles_on_every_stage():
    """The combination MindSpore refused on stage 0 while the tied vocabulary table was
    sharded by the parallel optimizer; the plan now leaves that table whole, as MindSpore
    does on both stages."""
    overrides = DP2_MP2 + ["parallel.pipeline_stage=2", "parallel.micro_batch_num=2",
                           "parallel.optimizer_shard=true", "parallel.vocab_emb_dp=false"]
    config = load_config(TINY, overrides, layout_checked=False)
    result = run_dryrun(config, TINY, overrides, select_ranks("stages", config.parallel))
    assert [rank.rank for rank in result.ranks] == [0, 4]
    assert result.ok, [(rank.error, rank.layout_mismatches[:2]) for rank in result.ranks]
    for rank in result.ranks:
        assert rank.collectives["Send"] and rank.collectives["Receive"]
        assert rank.collectives["ReduceScatter"]   # the parallel optimizer's gradients
        # no weight-sized constants of ours: clearing the accumulated gradients with
        # assign(zeros_like) or selecting them against zeros_like folded one per weight
        # (1.7 MB in all here). What is left is MindSpore's own: one of the shared vocabulary
        # table's slice (1024 x 128 float32) on a Depend of the pipeline's tied parameter
        assert rank.constant_mb <= 0.5, rank.constant_mb


def test_layout_differences_are_found():
    """compare_layouts against the plan's own layouts finds nothing, and one changed
    split, optimizer shard or missing entry each once."""
    overrides = DP2_MP2 + ["parallel.optimizer_shard=true"]
    config = load_config(TINY, overrides, layout_checked=False)
    plan = build_plan(config, TINY)
    params = plan.recording.params
    layouts = {}
    for name, param in params.items():   # as MindSpore would write the plan's layout
        dev_matrix, tensor_map, _, shard = parameter_layout(param, config.parallel)
        layouts[name] = {"dev_matrix": dev_matrix, "tensor_map": tensor_map,
                         "full_shape": list(param.shape), "optimizer_shard": max(shard, 1)}
    assert compare_layouts(layouts, params, config.parallel, 0) == []
    qkv = next(name for name, p in params.items() if p.split and p.split[0] == 2
               and name.endswith("weight"))
    changed = dict(layouts, **{qkv: dict(layouts[qkv], tensor_map=[-1, -1])})
    (found,) = compare_layouts(changed, params, config.parallel, 0)
    assert found["parameter"] == qkv and found["problem"] == "split"
    assert found["norm_weight"] != found["norm_weight_mindspore"]
    sharded = next(name for name, layout in layouts.items() if layout["optimizer_shard"] > 1)
    changed = dict(layouts, **{sharded: dict(layouts[sharded], optimizer_shard=1)})
    (found,) = compare_layouts(changed, params, config.parallel, 0)
    assert found["problem"] == "optimizer shard"
    missing = {name: layout for name, layout in layouts.items() if name != qkv}
    (found,) = compare_layouts(missing, params, config.parallel, 0)
    assert found["problem"] == "not laid out by MindSpore"


def test_ranks_argument():
    parallel = load_config(TINY, DP2_MP2 + ["parallel.pipeline_stage=2",
                                            "parallel.micro_batch_num=2"],
                           layout_checked=False).parallel
    assert select_ranks("stages", parallel) == [0, 4]
    assert select_ranks("all", parallel) == list(range(8))
    assert select_ranks("5,1,5", parallel) == [1, 5]
    for bad in ("8", "x", "-1", ""):
        with pytest.raises(UserInputError, match="--ranks"):
            select_ranks(bad, parallel)


def test_bad_input_is_one_error_line_before_any_compile(tmp_path):
    out = tmp_path / "out"
    for args, message in (((TINY, "--ranks", "9"), "--ranks '9'"),
                          ((TINY, "--set", "model.nope=1"), "model.nope"),
                          ((tmp_path / "missing.yaml",), "missing.yaml"),
                          ((TINY, "--jobs", "0"), "--jobs")):
        result = run_cli("dryrun", *args, "--output-dir", out)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
        assert not out.exists() or not os.listdir(out)   # no rank was started


def test_the_short_form_of_a_shipped_config_reaches_every_rank():
    """`model_zoo/gpt2/configs/...` (the docs' form) names the shipped config in the
    compile processes too, which run in folders of their own."""
    short = "model_zoo/gpt2/configs/tiny.yaml"
    config = load_config(short, DP2_MP2, layout_checked=False)
    result = run_dryrun(config, short, DP2_MP2, [0])
    assert result.ok, result.ranks[0].error


def test_a_compile_past_its_timeout_is_reported():
    config = load_config(TINY, DP2_MP2, layout_checked=False)
    result = run_dryrun(config, TINY, DP2_MP2, [0], timeout=0.5)
    (rank,) = result.ranks
    assert not rank.compiled and "did not finish within 0.5 s" in rank.error
    assert not result.ok


def test_a_wheel_without_the_gpu_plugin_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_stubs, "plugin_dir", lambda: tmp_path)
    with pytest.raises(cuda_stubs.DryRunUnavailable, match="no GPU plugin"):
        cuda_stubs.fake_cuda_home()


# --- the partitioned step's numbers ------------------------------------------------------------

PARITY_BASE = ["model.num_layers=2", "train.global_batch_size=8", "train.grad_clip=0.5"]
# Layouts whose compiled steps run on CPU ranks (sub-group all-gathers and reduce-scatters
# as all-reduces: cpu_collectives.as_all_reduces; Send/Receive through the mailbox; the reused
# micro-step subgraphs inlined: cpu_ranks.inline_calls): (config, overrides)
PARITY_LAYOUTS = {   # dp2 x mp2: the Mixtral layout (and dp2, mp2 in the others)
    "mp2-sequence-parallel-optimizer-shard": (TINY, [
        "parallel.model_parallel=2", "parallel.sequence_parallel=true",
        "parallel.optimizer_shard=true"]),
    # accumulation across devices: MindSpore's GradAccumulation cell
    "mp2-accumulation4": (TINY, ["parallel.model_parallel=2", "train.grad_accumulation=4"]),
    # pipeline stages: GPT-2's tied embedding on the first and last stage, 4 micro batches;
    # the first interleaved (8 blocks in chunks of one: stages 0, 1, 2, 3, 0, 1, 2, 3), its
    # middle stages receiving and sending both ways
    "pp4-interleave2": (TINY, ["parallel.pipeline_stage=4", "parallel.micro_batch_num=4",
                               "parallel.pipeline_interleave=2", "model.num_layers=8"]),
    # and sequence parallel at one sequence a micro batch (each device half of one: the
    # residual additions split (1, 2, 1), the shipped 10B-100B layouts' case)
    "llama-mp2-pp2-sequence-parallel": (LLAMA_TINY, [
        "parallel.model_parallel=2", "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=4", "parallel.sequence_parallel=true",
        "parallel.full_batch=true", "train.global_batch_size=4"]),
    # expert parallel: the experts split over 2 of 4 data-parallel devices (two outer
    # groups, each with its copy of the experts), tokens moved by AllToAll (run as
    # all-reduces on CPU), slots short enough to drop tokens
    "mixtral-dp4-ep2-capacity": (MIXTRAL_TINY, [
        "parallel.data_parallel=4", "parallel.expert_parallel=2",
        "model.capacity_factor=1.5", "model.num_layers=1"]),
    # experts on a pipeline with data parallel and the parallel optimizer on each stage,
    # dropless, the load-balancing loss (not a mean over rows) on the last stage, over the
    # same micro batches as one device's
    "mixtral-dp2-ep2-pp2-optimizer-shard": (MIXTRAL_TINY, [
        "parallel.data_parallel=2", "parallel.expert_parallel=2",
        "parallel.pipeline_stage=2", "parallel.micro_batch_num=4",
        "parallel.optimizer_shard=true"]),
    # the fp16 graph: loss scale, overflow decision, the first step planted to overflow
    "fp16-dp2-mp2-overflow": (TINY, [
        "parallel.data_parallel=2", "parallel.model_parallel=2", "train.precision=fp16",
        "train.loss_scale=131072"])}
SAME_ON_CPU = ("mp2-accumulation4",)   # collectives the CPU runs as compiled


@pytest.mark.parametrize("layout", PARITY_LAYOUTS)
def test_the_partitioned_step_gives_one_devices_numbers(layout, tmp_path):
    """`model-zoo dryrun --check-numbers`: each rank's step as MindSpore compiled it
    (exported with its weight slices) run on CPU ranks with real collectives gives, over
    two steps, one device's losses, gradient norms, overflow decisions and
    loss scales, and every parameter and AdamW moment slice after them is one device's,
    within 1e-5 (fp32; 1e-3 in fp16; no dropout, clipping on). Every Send the CPU ranks
    had to run ahead of a blocking operator is listed: GPT-2's tied embedding gradient,
    which the last stage's exported graph sends after its gradient-norm all-reduce."""
    import numpy as np
    config, overrides = PARITY_LAYOUTS[layout]
    steps = 2
    result = run_cli("dryrun", config, "--set", *PARITY_BASE, *overrides,
                     "--check-numbers", "--json", "--output-dir", tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    numbers = report["numbers"]
    assert numbers["ok"] and numbers["steps"] == steps and len(numbers["loss"]) == steps
    fp16 = "fp16" in layout
    assert max(numbers["max_abs_diff"].values()) < (1e-3 if fp16 else 1e-4)
    assert numbers["loss"] == pytest.approx(numbers["one_device_loss"],
                                            rel=1e-3 if fp16 else 1e-5)
    if fp16:   # the planted step overflows on every rank: skipped, the scale halved
        assert numbers["skipped"] == [True, False]
        assert numbers["loss_scale"] == [131072, 65536]
    sends = numbers["reordered_sends"]
    if layout == "pp4-interleave2":   # the tied embedding's gradient, last stage to first
        assert any(send["rank"] == 3 and send["send"].startswith("Send 3 -> 0 ")
                   and send["ahead_of"].startswith("AllReduce") and send["possible_hang"]
                   for send in sends), sends
    elif "pp" not in layout:
        assert sends == []
    device_num = report["device_num"]
    assert [rank["rank"] for rank in report["ranks"]] == list(range(device_num))
    for rank in range(device_num):
        found = np.load(tmp_path / f"rank_{rank}" / "cpu_step.npz")
        assert float(found["grad_norm_0"]) > 0.5   # clipped: the norm's value matters
        # dp2 x mp2 all-gathers within sub-groups; the optimizer shard and sequence
        # parallel reduce-scatter: both run as all-reduces on CPU; pipeline stages' Send
        # and Receive run through the mailbox; mp2's all-reduces over the whole group run
        # as compiled
        assert (int(found["collectives_as_all_reduces"]) > 0) == (layout not in SAME_ON_CPU)
    if "ep2" in layout:
        assert all(rank["collectives"].get("AllToAll") for rank in report["ranks"])
    if layout == "mp2-sequence-parallel-optimizer-shard":
        a_difference_is_found(config, overrides, tmp_path)
    if "optimizer-shard" in layout and "pp2" in layout:
        # the time model's once-a-step weight gathers: MindSpore puts every AllGather of
        # the optimizer shard in the step's graph, none in the micro step it calls m times
        in_step, in_micro_step, called = all_gathers(tmp_path / "rank_0" / "step.mindir")
        assert called and in_step > 0 and in_micro_step == 0, (in_step, in_micro_step)


def all_gathers(path) -> tuple:
    """(AllGather nodes in a MindIR's top graph, in the graphs it calls, how many graphs it
    calls: the micro step's forward and backward, not unrolled)."""
    from mindspore.train import mind_ir_pb2
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(path.read_bytes())
    def count(graph):   # node types read "REF::AllGather:<n>"
        return sum(1 for node in graph.node
                   if node.op_type.split("::")[-1].split(":")[0] == "AllGather")
    return (count(model.graph), sum(count(graph) for graph in model.functions),
            len(model.functions))


def a_difference_is_found(config_path, overrides, work):
    """The comparison fails when a rank's numbers are not one device's: the outputs of the
    check just run in `work`, with one moment slice and one loss changed by 1e-3."""
    import numpy as np
    from model_zoo.dryrun import numbers
    overrides = PARITY_BASE + overrides
    config = load_config(config_path, overrides + numbers.numbers_overrides(
        load_config(config_path, overrides, layout_checked=False)), layout_checked=False)
    params = build_plan(config, config_path).recording.params
    batches = [[np.load(work / f"batch_{step}.npz")["arr_0"]] for step in range(2)]
    expected, after = numbers.one_device_steps(config, batches, str(work / "again.ckpt"))
    assert numbers.compare(config, params, expected, after, work, 2)["ok"]
    rank_file = work / "rank_1" / "cpu_step.npz"
    values = dict(np.load(rank_file))
    moment = next(name for name in values if name.startswith("adam_v."))
    values[moment] = values[moment] + 1e-3
    values["loss_0"] = values["loss_0"] + 1e-3
    np.savez(rank_file, **values)
    broken = numbers.compare(config, params, expected, after, work, 2)
    assert not broken["ok"]
    assert broken["max_abs_diff"]["moments"] == pytest.approx(1e-3, rel=1e-3)
    assert any(moment in problem for problem in broken["problems"])
    assert any("rank 1, step 1: loss" in problem for problem in broken["problems"])
    values["grad_norm_1"] = values["grad_norm_1"] * float("nan")   # a NaN never agrees
    np.savez(rank_file, **values)
    assert any("rank 1, step 2: loss" in problem for problem in numbers.compare(
        config, params, expected, after, work, 2)["problems"])


def test_as_device_refuses_what_the_chip_cannot_run():
    """`--as-device ascend910` on a config asking for bf16 or flash attention is bad input,
    named before any compile; so is --as-device with --check-numbers."""
    for extra, message in ((["--set", "train.precision=bf16"], "train.precision=bf16"),
                           (["--set", "model.flash_attention=true", "train.precision=fp16",
                             "model.attention_dropout=0.0"], "model.flash_attention"),
                           (["--check-numbers"], "give one of them")):
        result = run_cli("dryrun", TINY, "--as-device", "ascend910", *extra)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
        assert "Traceback" not in result.stderr


def test_check_numbers_refuses_what_cpu_ranks_cannot_run():
    """Bad input is exit 2 and one line, before any compile: too many ranks, a layout too
    big for this machine, --ranks or --steps misused."""
    for extra, message in (
            (["--set", "parallel.data_parallel=32", "train.global_batch_size=32"],
             "too many for CPU ranks"),
            (["--set", "model.hidden_size=16384", "model.num_heads=128"], "too big for CPU"),
            (["--ranks", "0"], "leave out --ranks"),
            (["--steps", "0"], "--steps must be >= 1")):
        result = run_cli("dryrun", TINY, "--check-numbers", *extra)
        assert result.returncode == 2, (extra, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, extra
    result = run_cli("dryrun", TINY, "--steps", "3")
    assert result.returncode == 2 and "--steps goes with --check-numbers" in result.stderr


def test_mindspores_strategy_file_carries_the_optimizer_state_to_another_layout(tmp_path):
    """A resume on another layout cuts each rank's slices with the strategy file MindSpore
    wrote when it compiled the step (`restore_sliced`). That file lists the AdamW moments
    with their weights' layouts, so every rank's slice of a checkpoint saved under mp4
    (random values in every entry) is the plan's slice for dp2 x mp2 with the optimizer
    shard, moments included."""
    import mindspore as ms
    import numpy as np
    from model_zoo.checkpoint.layouts import rank_slices, split, strategy_names
    from model_zoo.parallel.replication import device_piece
    from model_zoo.parallel.strategy_file import laid_out_names
    source = load_config(TINY, PARITY_BASE + ["parallel.model_parallel=4"], layout_checked=False)
    target_overrides = PARITY_BASE + DP2_MP2 + ["parallel.optimizer_shard=true"]
    target = load_config(TINY, target_overrides, layout_checked=False)
    _, _ = one_device_steps(source, [], str(tmp_path / "init.ckpt"))
    rng = np.random.default_rng(3)
    full = {name: rng.standard_normal(value.shape).astype(np.float32)
            if value.dtype == ms.float32 else value.asnumpy()
            for name, value in ms.load_checkpoint(str(tmp_path / "init.ckpt")).items()}
    ms.save_checkpoint([{"name": name, "data": ms.Tensor(value)}
                        for name, value in full.items()], str(tmp_path / "full.ckpt"))
    split(source, str(tmp_path / "full.ckpt"), str(tmp_path / "mp4"))

    ranks = [0, 3]
    compiled = run_dryrun(target, TINY, target_overrides, ranks,
                          output_dir=str(tmp_path / "dry"))
    assert compiled.ok, [rank.error for rank in compiled.ranks]
    params = build_plan(target, TINY).recording.params
    moments = {f"adam_{kind}.{name}" for name, param in params.items()
               if param.requires_grad for kind in "mv"}
    for rank in compiled.ranks:
        assert moments <= strategy_names(rank.strategy_file)
        got = ms.load_checkpoint(rank_slices(str(tmp_path / "mp4"), rank.rank,
                                             rank.strategy_file,
                                             str(tmp_path / f"cut_{rank.rank}.ckpt")))
        sliced = laid_out_names(params, got)
        assert moments <= set(sliced)
        for name, base in sliced.items():
            piece = device_piece(params[base], target.parallel, rank.rank)
            np.testing.assert_array_equal(got[name].asnumpy(), full[name][piece],
                                          err_msg=f"rank {rank.rank}: {name}")
