"""Checkpoints across layouts: `model-zoo checkpoint split|transform|merge|inspect` and
`model-zoo plan --save-strategy`, through MindSpore's own transform_checkpoints.

The slices in each rank's file are MindSpore's; the slices the tests expect come from the
plan's rank-to-slice mapping (`replication.device_piece`), so the round trip also checks
that mapping against MindSpore's transform code."""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import run_cli, write_tiny_config

# 2 layers (two pipeline stages), 4 heads (model parallel 4), hidden 64: the largest weights
# pass MindSpore's 64 KB threshold for the parallel optimizer
MODEL = {"model.num_layers": 2, "model.num_heads": 4, "model.hidden_size": 64}
D2M2P2 = ["--set", "parallel.data_parallel=2", "--set", "parallel.model_parallel=2",
          "--set", "parallel.pipeline_stage=2", "--set", "parallel.micro_batch_num=2",
          "--set", "parallel.optimizer_shard=true"]
TO_D1M4P2 = ["--set", "parallel.data_parallel=1", "--set", "parallel.model_parallel=4",
             "--set", "parallel.optimizer_shard=false"]


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    """A 4-step run of the 2-layer model: checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("sliced")
    config = write_tiny_config(root / "tiny.yaml", tiny_dataset,
                               {**MODEL, "train.steps": 4, "train.save_steps": 2})
    run_dir = root / "run"
    result = run_cli("train", config, "--output-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return {"config": config, "run_dir": run_dir, "root": root,
            "ckpt": run_dir / "checkpoints" / "step_00000004.ckpt"}


def entries(path):
    import mindspore as ms
    return {name: value.asnumpy() for name, value in ms.load_checkpoint(str(path)).items()}


def assert_same_entries(got: dict, expected: dict, where=""):
    """The same entry names, dtypes and values, bit for bit."""
    assert got.keys() == expected.keys(), (where, got.keys() ^ expected.keys())
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, f"{where} {name}"
        np.testing.assert_array_equal(got[name], value, err_msg=f"{where} {name}")


def assert_slices_as_planned(directory, full):
    """Every rank's file holds, of every entry, the slice the plan gives that rank."""
    from model_zoo.checkpoint.layouts import layout_config, plan_layout, rank_file
    layout = plan_layout(layout_config(os.path.join(directory, "config.yaml")))
    held = set()
    for rank in range(layout.device_num):
        for name, value in entries(rank_file(str(directory), rank)).items():
            index = layout.slice_of(name, rank)
            assert index is not None, (rank, name)
            np.testing.assert_array_equal(value, full[name][index], err_msg=f"{rank} {name}")
            held.add(name)
    assert held == set(full)   # every entry is somewhere
    return layout


@pytest.mark.slow
def test_split_transform_merge_round_trip(trained, tmp_path):
    from model_zoo.checkpoint.files import saved_step
    full = entries(trained["ckpt"])
    assert any(name.startswith("adam_m.") for name in full)
    assert saved_step(str(trained["ckpt"])) == 4   # what a sharded --resume reads first
    split_dir, moved_dir, merged = tmp_path / "d2m2p2", tmp_path / "d1m4p2", tmp_path / "m.ckpt"

    result = run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                     "--output-dir", split_dir, *D2M2P2)
    assert result.returncode == 0, result.stderr
    assert "for dp2 x mp2 x pp2 with optimizer shard" in result.stdout
    assert sorted(os.listdir(split_dir)) == ["config.yaml"] + [f"rank_{r}" for r in range(8)] + [
        "slices.json", "strategy.ckpt"]
    layout = assert_slices_as_planned(split_dir, full)
    from model_zoo.parallel.replication import optimizer_shard_size
    assert any(optimizer_shard_size(p, layout.parallel) > 1 for p in layout.params.values())

    result = run_cli("checkpoint", "transform", split_dir, "--output-dir", moved_dir,
                     *TO_D1M4P2)
    assert result.returncode == 0, result.stderr
    assert "(dp1 x mp4 x pp2, 8 ranks)" in result.stdout
    assert_slices_as_planned(moved_dir, full)

    result = run_cli("checkpoint", "merge", moved_dir, "--output", merged)
    assert result.returncode == 0, result.stderr
    assert_same_entries(entries(merged), full)

    # one flipped bit in a slice (MindSpore writes and reads them without its CRC): refused
    damaged_dir = tmp_path / "damaged"
    shutil.copytree(moved_dir, damaged_dir)
    (slice_file,) = (damaged_dir / "rank_5").glob("*.ckpt")
    content = bytearray(slice_file.read_bytes())
    content[len(content) // 2] ^= 0x01
    slice_file.write_bytes(bytes(content))
    result = run_cli("checkpoint", "merge", damaged_dir, "--output", tmp_path / "bad.ckpt")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {slice_file}: its SHA-256 differs from the one "
                                     f"recorded in {damaged_dir / 'slices.json'} when it was "
                                     f"written: its bytes changed since (a flipped bit, a "
                                     f"damaged copy)")
    assert not (tmp_path / "bad.ckpt").exists()

    listing = run_cli("checkpoint", "inspect", split_dir)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.startswith(f"{split_dir}: dp2 x mp2 x pp2 with optimizer shard, 8 "
                                     f"ranks")
    # mp cuts the columns, the optimizer shard the rows over the two copies (ranks 4 and 6)
    assert ("lm.transformer.blocks.1.mlp.project.weight  (64, 256)  Float32  [0:32, 0:128] on "
            "ranks 4; [0:32, 128:256] on ranks 5; [32:64, 0:128] on ranks 6") in listing.stdout


@pytest.mark.slow
def test_resume_from_a_transformed_checkpoint_trains_the_same(trained, tmp_path):
    """Step 2's checkpoint split for d2m2p2, moved to d1m4p2, merged and resumed on CPU
    gives the same losses at steps 3 and 4 as the run that never left one process."""
    step_2 = trained["run_dir"] / "checkpoints" / "step_00000002.ckpt"
    for args in (["split", trained["config"], "--ckpt", step_2, "--output-dir",
                  tmp_path / "a", *D2M2P2],
                 ["transform", tmp_path / "a", "--output-dir", tmp_path / "b", *TO_D1M4P2],
                 ["merge", tmp_path / "b", "--output", tmp_path / "merged.ckpt"]):
        result = run_cli("checkpoint", *args)
        assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "run"
    shutil.copytree(trained["run_dir"], run_dir)
    os.remove(run_dir / "checkpoints" / "step_00000004.ckpt")
    shutil.copy(tmp_path / "merged.ckpt", run_dir / "checkpoints" / "step_00000002.ckpt")

    result = run_cli("train", trained["config"], "--output-dir", run_dir, "--resume")

    assert result.returncode == 0, result.stderr
    def losses(directory):
        return [json.loads(line)["loss"] for line in
                (directory / "metrics.jsonl").read_text().splitlines()]
    assert losses(run_dir) == losses(trained["run_dir"])


def test_the_plan_writes_the_strategy_mindspore_reads(trained, tmp_path):
    import mindspore as ms
    split_dir, offline = tmp_path / "split", tmp_path / "offline.ckpt"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    result = run_cli("plan", trained["config"], *D2M2P2, "--save-strategy", offline)
    assert offline.is_file(), result.stdout + result.stderr
    planned = ms.build_searched_strategy(str(offline))
    written = ms.build_searched_strategy(str(split_dir / "strategy.ckpt"))
    # a pipeline run on a cluster also checkpoints its gradient accumulation buffers, which
    # the stand-alone checkpoint split here does not hold
    assert {name.split("-", 1)[1].split(".")[0] for name in planned.keys() - written.keys()} \
        == {"accu_grads"}
    for name, layout in written.items():
        assert layout.SerializeToString() == planned[name].SerializeToString(), name
    # one entry per stage for the embedding the last stage's head shares
    assert {"0-lm.transformer.wte.embedding_table",
            "1-lm.transformer.wte.embedding_table"} <= planned.keys()


def _bad(case, trained, tmp_path):
    """(arguments, fragment of the one error line) of each bad invocation."""
    if case == "a layout the model does not divide":
        return (["split", trained["config"], "--ckpt", trained["ckpt"], "--output-dir",
                 tmp_path / "out", "--set", "parallel.model_parallel=3"],
                "the layout cannot be used for this model")
    if case == "a checkpoint of another model":
        return (["split", trained["config"], "--ckpt", trained["ckpt"], "--output-dir",
                 tmp_path / "out", "--set", "model.hidden_size=32"],
                "does not match the config's model")
    split_dir = tmp_path / "split"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    if case == "a missing rank file":
        shutil.rmtree(split_dir / "rank_5")
        return (["merge", split_dir, "--output", tmp_path / "out"], "no checkpoint of rank 5")
    if case == "a truncated rank file":
        rank_3 = split_dir / "rank_3" / "checkpoint_3.ckpt"
        rank_3.write_bytes(rank_3.read_bytes()[:1000])
        return (["merge", split_dir, "--output", tmp_path / "out"],
                f"{rank_3}: its SHA-256 differs from the one recorded")
    if case == "the strategy of another layout":
        other = tmp_path / "other"
        assert run_cli("checkpoint", "transform", split_dir, "--output-dir", other,
                       *TO_D1M4P2).returncode == 0
        shutil.copy(other / "strategy.ckpt", split_dir / "strategy.ckpt")
        return (["transform", split_dir, "--output-dir", tmp_path / "out"],
                "a strategy of another model or layout")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a layout the model does not divide",
                                  "a checkpoint of another model", "a missing rank file",
                                  "a truncated rank file", "the strategy of another layout"])
def test_bad_input_is_one_error_line_and_writes_nothing(trained, tmp_path, case):
    args, fragment = _bad(case, trained, tmp_path)
    result = run_cli("checkpoint", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []   # no staging left


def test_one_rank_gets_its_slices_from_any_layout(trained, tmp_path):
    """What a semi-auto run does after compiling: MindSpore's per-rank transform, from the
    full checkpoint or from another layout's slices, gives each rank what split gives it."""
    from model_zoo.checkpoint.layouts import rank_file, rank_slices
    split_dir, moved_dir = tmp_path / "d2m2p2", tmp_path / "d1m4p2"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    assert run_cli("checkpoint", "transform", split_dir, "--output-dir", moved_dir,
                   *TO_D1M4P2).returncode == 0
    for rank in (0, 3, 6):
        for source, target in ((str(trained["ckpt"]), split_dir), (str(split_dir), moved_dir)):
            got = entries(rank_slices(source, rank, str(target / "strategy.ckpt"),
                                      str(tmp_path / f"rank_{rank}.ckpt")))
            assert_same_entries(got, entries(rank_file(str(target), rank)), rank)


def _as_cluster_run(split_dir, run_dir, step):
    """The folders a sharded training run leaves, made from a split directory: each rank's
    checkpoint under rank_<i>/checkpoints/, the config, and per stage the strategy file
    MindSpore saves there (unmerged: the stage's entries without the "<stage>-" prefix)."""
    from mindspore.train import node_strategy_pb2
    merged = node_strategy_pb2.ParallelStrategyMap()
    merged.ParseFromString((split_dir / "strategy.ckpt").read_bytes())
    ranks = sorted(p.name for p in split_dir.iterdir() if p.name.startswith("rank_"))
    per_stage = len(ranks) // len(merged.parallel_strategy_item)
    for name in ranks:
        rank = int(name.split("_")[1])
        folder = run_dir / name
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(split_dir / name / f"checkpoint_{rank}.ckpt",
                    folder / "checkpoints" / f"step_{step:08d}.ckpt")
        shutil.copy(split_dir / "config.yaml", folder / "config.yaml")
        (folder / "strategy").mkdir()
        if per_stage == len(ranks):   # one stage: the file as MindSpore saves it
            shutil.copy(split_dir / "strategy.ckpt", folder / "strategy" / "param_strategy.ckpt")
            continue
        stage = rank // per_stage
        own = node_strategy_pb2.ParallelStrategyMap()
        own.current_stage = stage
        own.parallel_strategy_item.add().CopyFrom(merged.parallel_strategy_item[stage])
        for item in merged.parallel_layout_item:
            prefix, _, param = item.param_name.partition("-")
            if int(prefix) == stage:
                copy = own.parallel_layout_item.add()
                copy.CopyFrom(item)
                copy.param_name = param
        (folder / "strategy" / "param_strategy.ckpt").write_bytes(own.SerializeToString())


@pytest.mark.slow
def test_collect_a_cluster_run_and_merge_it(trained, tmp_path):
    """Cluster -> laptop: the rank folders of a d2m2p2 run collected (MindSpore's per-stage
    strategies merged by MindSpore) and merged give the full checkpoint back bit for bit."""
    split_dir, run_dir = tmp_path / "split", tmp_path / "run"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    _as_cluster_run(split_dir, run_dir, step=4)

    result = run_cli("checkpoint", "collect", run_dir, "--output-dir", tmp_path / "collected")
    assert result.returncode == 0, result.stderr
    assert "collected the 8 ranks" in result.stdout
    result = run_cli("checkpoint", "merge", tmp_path / "collected", "--output",
                     tmp_path / "full.ckpt")
    assert result.returncode == 0, result.stderr
    assert_same_entries(entries(tmp_path / "full.ckpt"), entries(trained["ckpt"]))

    os.remove(run_dir / "rank_6" / "checkpoints" / "step_00000004.ckpt")
    result = run_cli("checkpoint", "collect", run_dir, "--output-dir", tmp_path / "again")
    assert result.returncode == 2 and "share no checkpoint step" in result.stderr
    assert not (tmp_path / "again").exists()


def test_a_sliced_init_checkpoint_needs_a_sharded_run(trained, tmp_path):
    split_dir = tmp_path / "split"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    result = run_cli("train", trained["config"], "--output-dir", tmp_path / "run",
                     "--set", f"train.init_checkpoint={split_dir}")
    assert result.returncode == 2
    assert f"merge it for this one: model-zoo checkpoint merge {split_dir}" in result.stderr
    result = run_cli("train", trained["config"], "--output-dir", tmp_path / "run",
                     "--set", f"train.init_checkpoint={tmp_path}")
    assert result.returncode == 2 and "not a sliced checkpoint" in result.stderr


def test_a_pipeline_rank_cuts_its_slices_with_its_own_strategy_file(trained, tmp_path):
    """On a cluster a rank of stage 1 has only its stage's strategy file (entries without
    the stage): merged by MindSpore first (`stage_strategy`), the per-rank transform from
    the full checkpoint gives it what split gives it."""
    from model_zoo.checkpoint.layouts import layout_config, rank_file, rank_slices, \
        stage_strategy, strategy_names
    split_dir, run_dir = tmp_path / "split", tmp_path / "run"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                   "--output-dir", split_dir, *D2M2P2).returncode == 0
    _as_cluster_run(split_dir, run_dir, step=4)
    parallel = layout_config(str(split_dir / "config.yaml")).parallel
    for rank in (1, 5):
        own = run_dir / f"rank_{rank}" / "strategy" / "param_strategy.ckpt"
        merged = stage_strategy(str(own), parallel, str(tmp_path / f"merged_{rank}.ckpt"))
        held = strategy_names(str(own))       # what the trainer loads of the result
        got = {name: value for name, value in entries(rank_slices(
            str(trained["ckpt"]), rank, merged, str(tmp_path / f"rank_{rank}.ckpt"))).items()
            if name in held}
        expected = {name: value for name, value in entries(rank_file(str(split_dir),
                                                                     rank)).items()
                    if name in held}
        blocks = {name.split(".blocks.")[1].split(".")[0] for name in held if ".blocks." in name}
        assert blocks == {str(rank // 4)}          # this stage's block only
        assert_same_entries(got, expected, rank)


D2M2 = ["--set", "parallel.data_parallel=2", "--set", "parallel.model_parallel=2",
        "--set", "parallel.optimizer_shard=true"]


def test_resume_on_another_layout_cuts_each_rank_from_a_snapshot(trained, tmp_path):
    """`--resume` of a sharded run on a bigger layout (4 ranks d2m2 -> 8 ranks d2m2p2), as
    every rank runs it before and after compiling (`checkpoint.resume`, then the per-rank
    transform of `restore_sliced`): ranks in rank order, each writing its new config as the
    trainer does; ranks 4-7 have no folder yet. Each rank gets the slices split gives it,
    training state and step included; the old files are renamed, not lost."""
    from model_zoo.checkpoint.layouts import layout_config, rank_file, rank_slices
    from model_zoo.checkpoint.resume import resume_point
    from model_zoo.config import save_config
    old_dir, new_dir, run_dir = tmp_path / "d2m2", tmp_path / "d2m2p2", tmp_path / "run"
    for target, layout in ((old_dir, D2M2), (new_dir, D2M2P2)):
        assert run_cli("checkpoint", "split", trained["config"], "--ckpt", trained["ckpt"],
                       "--output-dir", target, *layout).returncode == 0
    _as_cluster_run(old_dir, run_dir, step=4)
    old_files = {rank: entries(run_dir / f"rank_{rank}" / "checkpoints" / "step_00000004.ckpt")
                 for rank in range(4)}
    config = layout_config(str(new_dir / "config.yaml"))
    said = []
    same = resume_point(str(run_dir / "rank_0"), layout_config(str(old_dir / "config.yaml")),
                        said.append)                  # the same layout resumes as it is
    assert (same.step, same.cut) == (4, False)
    assert same.path.endswith("rank_0/checkpoints/step_00000004.ckpt")
    for rank in range(8):
        folder = run_dir / f"rank_{rank}"
        point = resume_point(str(folder), config, said.append)
        assert point.cut and point.step == 4
        assert point.path == str(run_dir / "earlier_layouts" / "step_00000004")
        folder.mkdir(exist_ok=True)
        save_config(config, str(folder / "config.yaml"))
        got = entries(rank_slices(point.path, rank, str(new_dir / "strategy.ckpt"),
                                  str(tmp_path / f"cut_{rank}.ckpt")))
        assert_same_entries(got, entries(rank_file(str(new_dir), rank)), rank)
    assert "the layout changed from dp2 x mp2 x pp1 with optimizer shard (4 ranks) to dp2 x " \
           "mp2 x pp2 with optimizer shard (8 ranks)" in "\n".join(said)
    for rank, values in old_files.items():
        checkpoints = run_dir / f"rank_{rank}" / "checkpoints"
        assert [p.name for p in checkpoints.iterdir()] == \
            ["step_00000004.dp2-mp2-pp1-os-4ranks.ckpt"]
        assert_same_entries(entries(checkpoints / "step_00000004.dp2-mp2-pp1-os-4ranks.ckpt"),
                            values, rank)
    # stopped before its first save: a second --resume starts from the snapshot again,
    # also on yet another layout
    again = resume_point(str(run_dir / "rank_3"), layout_config(
        str(new_dir / "config.yaml"), TO_D1M4P2[1::2]), said.append)
    assert again.path == str(run_dir / "earlier_layouts" / "step_00000004")
    assert len(list((run_dir / "earlier_layouts").iterdir())) == 1
    # back on the 4 ranks of the first layout: ranks 4-7 keep nothing that could mislead
    # (their folders are newer than nothing), and the first four resume from the snapshot
    first = layout_config(str(old_dir / "config.yaml"))
    for rank in range(4):
        assert resume_point(str(run_dir / f"rank_{rank}"), first, said.append).cut



def test_safetensors_checkpoints_split_collect_and_merge(trained, tmp_path):
    """train.checkpoint_format: safetensors files go through the same commands (rewritten
    as .ckpt, the format MindSpore's per-rank transform reads) and come back bit for bit."""
    import mindspore as ms
    full = tmp_path / "full.safetensors"
    ms.save_checkpoint(ms.load_checkpoint(str(trained["ckpt"])), str(full),
                       format="safetensors")
    split_dir, run_dir = tmp_path / "split", tmp_path / "run"
    assert run_cli("checkpoint", "split", trained["config"], "--ckpt", full,
                   "--output-dir", split_dir, *D2M2).returncode == 0
    _as_cluster_run(split_dir, run_dir, step=4)
    for rank in range(4):
        ckpt = run_dir / f"rank_{rank}" / "checkpoints" / "step_00000004.ckpt"
        ms.save_checkpoint(ms.load_checkpoint(str(ckpt)), str(ckpt.with_suffix(".safetensors")),
                           format="safetensors")
        ckpt.unlink()
    assert run_cli("checkpoint", "collect", run_dir, "--output-dir",
                   tmp_path / "collected").returncode == 0
    result = run_cli("checkpoint", "merge", tmp_path / "collected", "--output",
                     tmp_path / "merged.ckpt")
    assert result.returncode == 0, result.stderr
    assert_same_entries(entries(tmp_path / "merged.ckpt"), entries(trained["ckpt"]))


def test_a_checkpoint_damaged_in_its_header_says_so(tmp_path):
    """A byte flipped near the start leaves MindSpore unable to parse the file, which it
    reports as "May not have permission to read it": the error says the content is the
    cause."""
    import mindspore as ms
    from model_zoo.checkpoint.files import read_checkpoint
    from model_zoo.errors import CheckpointError
    path = tmp_path / "damaged.ckpt"
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones((4, 4), np.float32))}],
                       str(path))
    damaged = bytearray(path.read_bytes())
    damaged[4] ^= 0xFF   # the first field's length: no longer parsable
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="its content is not a checkpoint MindSpore can "
                                              "parse"):
        read_checkpoint(str(path))
