"""`model-zoo advise`: the layouts it enumerates, the shortcuts that make it fast held
against full plans (costs affine in the micro batch, recompute cleared on the same graph),
and the command's ranking, JSON and written config."""

import dataclasses
import json

import pytest

from conftest import run_cli
from model_zoo.cost import advisor, communication, memory
from model_zoo.config import load_config
from model_zoo.cost.build import build_plan

TINY = "model_zoo/gpt2/configs/tiny.yaml"


@pytest.fixture(scope="module")
def config():
    # 4 layers, 4 heads, hidden 64: mp and pp up to 4
    return load_config(TINY, ["model.num_layers=4", "model.num_heads=4",
                              "model.hidden_size=64", "train.global_batch_size=32"],
                       layout_checked=False)


def test_layouts_cover_the_products_the_model_divides(config):
    found = advisor.layouts(config, 8)
    assert {(layout.dp, layout.mp, layout.pp) for layout in found} == {
        (dp, mp, pp) for mp in (1, 2, 4) for pp in (1, 2, 4) for dp in (8 // (mp * pp),)
        if dp * mp * pp == 8}
    assert all(layout.micro_steps >= layout.pp for layout in found)
    assert not any(layout.optimizer_shard for layout in found if layout.dp == 1)
    assert not any(layout.sequence_parallel for layout in found if layout.mp == 1)
    assert len(set(found)) == len(found)
    assert {layout.recompute for layout in found} == {False, "selective", True}


@pytest.fixture(scope="module")
def bert_config():
    return load_config("model_zoo/bert/configs/tiny.yaml", [
        "model.num_layers=4", "model.num_heads=4", "model.hidden_size=64",
        "train.global_batch_size=32"], layout_checked=False)


@pytest.fixture(scope="module")
def mixtral_config():
    # 4 experts, 2 a token, capacity slots: ep up to 4
    return load_config("model_zoo/mixtral/configs/tiny.yaml", [
        "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.hidden_size=64", "model.ffn_hidden_size=96", "model.capacity_factor=1.5",
        "train.global_batch_size=32"], layout_checked=False)


def test_layouts_of_a_model_with_experts_search_expert_parallel(mixtral_config):
    found = advisor.layouts(mixtral_config, 8)
    assert {(layout.dp, layout.ep) for layout in found} == {
        (8, 1), (8, 2), (8, 4), (4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)}
    layout = next(layout for layout in found if layout.ep == 4)
    assert "parallel.expert_parallel=4" in layout.overrides()
    assert " x ep4" in layout.describe()
    assert all(layout.ep is None for layout in advisor.layouts(
        load_config(TINY, layout_checked=False), 8))


@pytest.mark.parametrize("model, layout", [
    ("gpt2", advisor.Candidate(4, 2, 1, 2, False, True, False)),
    ("gpt2", advisor.Candidate(2, 2, 2, 4, True, False, True)),
    ("gpt2", advisor.Candidate(1, 4, 2, 2, True, False, False)),
    ("gpt2", advisor.Candidate(2, 1, 4, 4, False, True, False)),
    ("bert", advisor.Candidate(2, 4, 1, 1, True, False, True)),
    ("bert", advisor.Candidate(2, 2, 2, 8, False, True, False)),
    ("gpt2", advisor.Candidate(2, 2, 2, 4, "selective", False, False)),
    ("bert", advisor.Candidate(4, 2, 1, 2, "selective", True, True)),
    ("mixtral", advisor.Candidate(4, 2, 1, 2, True, True, False, ep=4)),
    ("mixtral", advisor.Candidate(2, 2, 2, 4, False, False, True, ep=2)),
], ids=lambda value: value if isinstance(value, str) else value.describe())
def test_the_advisor_scores_a_layout_as_its_full_plan_does(config, bert_config, mixtral_config,
                                                           model, layout):
    """Its recordings of 1 and 2 sequences per device through 1 and 2 blocks per stage,
    interpolated, give the full plan's memory and time (the plan records the layout's own
    micro batch and all 4 layers)."""
    config = {"gpt2": config, "bert": bert_config, "mixtral": mixtral_config}[model]
    scored = advisor.Advisor(config, "a100").score(layout)
    plan = build_plan(layout.apply(config), device="a100")
    assert not plan.violations
    assert scored.memory == pytest.approx(plan.worst_stage.total, rel=1e-7)
    full = plan.time.to_dict()
    for key, value in scored.time.to_dict().items():
        if key != "stages":
            assert value == pytest.approx(full[key], rel=1e-7), key


def test_a_layout_without_recompute_is_the_same_graph_without_checkpoints(config):
    with_it = advisor.Candidate(2, 2, 2, 2, True, False, False)
    plan = build_plan(with_it.apply(config), device="a100")
    cleared = advisor.without_recompute(plan.recording)
    direct = build_plan(advisor.Candidate(2, 2, 2, 2, False, False, False).apply(config),
                        device="a100")
    parallel = direct.config.parallel
    for ours, theirs in zip(memory.estimate_memory(cleared, parallel), direct.memory):
        assert ours.total == pytest.approx(theirs.total, rel=1e-12)
    for ours, theirs in zip(communication.estimate_communication(cleared, parallel),
                            direct.communication):
        assert ours.total == pytest.approx(theirs.total, rel=1e-12)


@pytest.mark.slow
def test_advise_ranks_layouts_and_writes_the_best(tmp_path):
    written = tmp_path / "best.yaml"
    result = run_cli("advise", TINY, "--device-num", "8", "--device", "a100", "--top", "3",
                     "--json", "--write", written)
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    top = advice["top"]
    assert len(top) == 3 and all(entry["confirmed"] for entry in top)
    speeds = [entry["time"]["samples_per_s"] for entry in top]
    assert speeds == sorted(speeds, reverse=True)
    assert advice["layouts"] == advice["breaking_rules"] + advice["not_fitting"] + \
        advice["fitting"]
    replan = run_cli("plan", written, "--device", "a100", "--json")
    assert replan.returncode == 0, replan.stderr
    planned = json.loads(replan.stdout)
    assert planned["time"]["samples_per_s"] == pytest.approx(speeds[0])
    layout = top[0]["layout"]
    assert (planned["layout"]["data_parallel"], planned["layout"]["model_parallel"],
            planned["layout"]["pipeline_stage"]) == (layout["dp"], layout["mp"], layout["pp"])

    text = run_cli("advise", TINY, "--device-num", "8", "--device", "a100", "--top", "2")
    assert text.returncode == 0 and "why the best wins: against #2" in text.stdout

    # the best layout compiles with MindSpore's own parallel pass, as the plan saw it
    compiled = run_cli("dryrun", written, "--json", timeout=900)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert json.loads(compiled.stdout)["ok"]


def test_advise_says_when_nothing_fits():
    result = run_cli("advise", "model_zoo/gpt2/configs/plan/gpt-10b-d1m8p2.yaml",
                     "--device-num", "1")   # 10B parameters' weights alone fill 40 GB
    assert result.returncode == 1
    assert "no layout fits" in result.stdout


def test_on_an_ascend_910b_flash_attention_is_a_layout_option():
    config = load_config(TINY, ["model.num_layers=4", "model.num_heads=4",
                                "model.hidden_size=64", "train.global_batch_size=32",
                                "model.attention_dropout=0", "train.precision=fp16"],
                         layout_checked=False)
    found = advisor.layouts(config, 8, flash_attention=True)
    assert {layout.flash_attention for layout in found} == {False, True}
    assert not any(layout.flash_attention for layout in advisor.layouts(config, 8))
    layout = advisor.Candidate(2, 2, 2, 4, True, False, False, flash_attention=True)
    scored = advisor.Advisor(config, "ascend910b").score(layout)
    plan = build_plan(layout.apply(config), device="ascend910b")
    assert not plan.violations
    assert any(call.name == "FlashAttentionScore" for call in plan.recording.calls)
    assert scored.time.step == pytest.approx(plan.time.step, rel=1e-7)
    assert scored.memory == pytest.approx(plan.worst_stage.total, rel=1e-7)
    # with attention dropout the layer refuses it: the layout is rejected, not an error
    dropout = advisor.Advisor(load_config(TINY, ["train.precision=fp16",
                                                 "model.attention_dropout=0.1"],
                                          layout_checked=False),
                              "ascend910b")
    assert dropout.score(advisor.Candidate(8, 1, 1, 1, False, False, False, True)) is None


def test_the_advisor_scores_an_interleaved_pipeline_near_its_full_plan(config):
    """2 chunks a device: recorded with one chunk a stage, its memory (micro batches in
    flight) and bubble are the full plan's, its sends (every stage border crossed twice)
    close to the plan's, which records the chunks (the last stage's sends back to the
    first are not in the recordings)."""
    layout = advisor.Candidate(2, 1, 2, 4, False, False, False, False, 2)
    assert "parallel.pipeline_interleave=2" in layout.overrides()
    assert layout in advisor.layouts(config, 4)
    scored = advisor.Advisor(config, "a100").score(layout)
    plan = build_plan(layout.apply(config), device="a100")
    assert not plan.violations and plan.config.parallel.pipeline_interleave == 2
    assert scored.memory == pytest.approx(plan.worst_stage.total, rel=1e-7)
    assert scored.time.step == pytest.approx(plan.time.step, rel=0.02)
    plain = advisor.Advisor(config, "a100").score(dataclasses.replace(layout, interleave=1))
    assert scored.time.bubble < plain.time.bubble and scored.memory > plain.memory


@pytest.mark.parametrize("layout", [
    advisor.Candidate(2, 1, 2, 4, True, False, False, stage_blocks=(1, 3),
                   recompute_blocks=(1, 2)),
    advisor.Candidate(2, 2, 2, 4, True, False, True, recompute_blocks=(1, 0)),
    advisor.Candidate(8, 1, 1, 4, True, True, False, recompute_blocks=(2,)),
], ids=lambda layout: layout.describe())
def test_per_stage_blocks_and_recompute_score_as_the_full_plan(config, layout):
    """Stage k through its own blocks, its first r_k recomputed: each stage interpolated
    between its estimates without and with every block recomputed gives the full plan's
    memory and step (the plan records those stages and checkpoints)."""
    assert "parallel.recompute_blocks=[" in " ".join(layout.overrides())
    scored = advisor.Advisor(config, "a100").score(layout)
    plan = build_plan(layout.apply(config), device="a100")
    assert not plan.violations
    assert scored.memory == pytest.approx(plan.worst_stage.total, rel=1e-7)
    assert scored.time.step == pytest.approx(plan.time.step, rel=1e-5)


def test_tailoring_recomputes_only_what_a_stage_needs():
    """On a device that holds a 4-stage pipeline with every block recomputed but not with
    none, the tailored layout recomputes more blocks on the early stages (more micro
    batches in flight on a 1F1B pipeline) than on the last, fits, and the full plan
    agrees; a layout that fits without recompute is left as it is."""
    config = load_config(TINY, ["model.num_layers=8", "model.num_heads=4",   # activations
                                "model.hidden_size=64", "model.seq_length=256",   # lead
                                "train.global_batch_size=64"], layout_checked=False)
    full = advisor.Candidate(1, 1, 4, 8, True, False, False)
    probe = advisor.Advisor(config, "a100")
    with_all = probe.score(full).memory
    without = probe.score(dataclasses.replace(full, recompute=False)).memory
    assert with_all < without
    tight = advisor.Advisor(config, "a100")
    tight.profile = dataclasses.replace(tight.profile,
                                        usable_memory=int((with_all + without) / 2))
    tailored = tight.tailor(full)
    assert tailored is not None and tailored.recompute is True
    blocks = tailored.recompute_blocks
    assert blocks[0] >= blocks[-1] and 0 < sum(blocks) < config.model.num_layers, blocks
    scored = tight.score(tailored)
    assert scored.memory <= tight.profile.usable_memory
    plan = build_plan(tailored.apply(config), device="a100")
    assert plan.worst_stage.total == pytest.approx(scored.memory, rel=1e-7)
    assert scored.time.step < tight.score(full).time.step   # less recomputed
    loose = probe.tailor(full)   # room for every activation: nothing recomputed
    assert loose is None or (loose.recompute is False and loose.recompute_blocks is None)
