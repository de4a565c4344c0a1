"""The `model-zoo` command as a user runs it (`python -m model_zoo` in a subprocess)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import TINY_VOCAB, run_cli, snapshot, write_tiny_config


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    """One tiny CLI training run: 4 steps, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("cli")
    config = write_tiny_config(root / "tiny.yaml", tiny_dataset,
                               {"train.steps": 4, "train.save_steps": 2})
    run_dir = root / "run"
    result = run_cli("train", config, "--output-dir", run_dir)
    assert result.returncode == 0, result.stderr
    return {"config": config, "run_dir": run_dir, "stdout": result.stdout,
            "ckpt": run_dir / "checkpoints" / "step_00000004.ckpt"}


def test_train_writes_a_run(trained):
    run_dir = trained["run_dir"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_00000002.ckpt",
                                                           "step_00000004.ckpt"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in metrics] == [1, 2, 3, 4]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "loss_curve.png").is_file()
    assert "step 4/4 | loss" in trained["stdout"]


def test_eval_prints_one_json_line(trained):
    result = run_cli("eval", trained["config"], "--ckpt", trained["ckpt"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    report = json.loads(lines[0])
    assert math.isfinite(report["loss"]) and report["samples"] > 0
    assert report["perplexity"] == pytest.approx(math.exp(report["loss"]), rel=1e-3)
    # the checkpoint holds the final weights: the same numbers the training run printed
    printed = re.search(r"held-out evaluation: (\{.*\})", trained["stdout"]).group(1)
    assert report == json.loads(printed)


def test_generate_from_ids(trained):
    """At MindSpore's default log level, as a user runs it: no warning about the decoding
    step's cache writes (the caches are written in place; the step returned them to a
    caller that dropped them, which MindSpore warned about on every run)."""
    result = subprocess.run(
        [sys.executable, "-m", "model_zoo", "generate", trained["config"], "--ckpt",
         trained["ckpt"], "--prompt-ids", "1 2 3", "--greedy", "--max-new-tokens", "5"],
        capture_output=True, text=True, timeout=300,
        env={key: value for key, value in os.environ.items() if key != "GLOG_v"})
    assert result.returncode == 0, result.stderr
    assert "side effect nodes were eliminated" not in result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("ids:")
    ids = [int(token) for token in first[len("ids:"):].split()]
    assert len(ids) == 5 and all(0 <= i < TINY_VOCAB for i in ids)


@pytest.mark.slow
def test_generate_a_file_of_prompts_in_batches(trained, tmp_path):
    """The interface of `model-zoo generate --prompt-ids-file`: one `ids:` line per prompt,
    in order, each what the prompt gives alone; `--input` takes text lines."""
    prompts = ["1 2 3", "7", "4 4 9 12 3"]
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("\n".join(prompts) + "\n")
    common = [trained["config"], "--ckpt", trained["ckpt"], "--max-new-tokens", "4", "--greedy"]
    result = run_cli("generate", *common, "--prompt-ids-file", ids_file, "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    batched = [line for line in result.stdout.splitlines() if line.startswith("ids:")]
    alone = []
    for prompt in prompts:
        single = run_cli("generate", *common, "--prompt-ids", prompt)
        alone.append(single.stdout.splitlines()[0])
    assert batched == alone
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("Return the\nIf the\n")
    result = run_cli("generate", *common, "--input", text_file, "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()   # each ids: line, then the text (newlines and all)
    starts = [number for number, line in enumerate(lines) if line.startswith("ids:")]
    assert len(starts) == 2 and starts[0] == 0
    assert lines[1].startswith("Return the") and lines[starts[1] + 1].startswith("If the")
    ids_file.write_text("1 2\n\n3\n")
    result = run_cli("generate", *common, "--prompt-ids-file", ids_file)
    assert result.returncode == 2 and f"{ids_file} line 2: the prompt is empty" in result.stderr


def test_generate_from_text(trained):
    result = run_cli("generate", trained["config"], "--ckpt", trained["ckpt"],
                     "--prompt", "Return the", "--max-new-tokens", "4", "--seed", "3")
    assert result.returncode == 0, result.stderr
    first, text = result.stdout.split("\n", 1)
    assert first.startswith("ids:") and len(first[len("ids:"):].split()) == 4
    assert text.startswith("Return the")


def _bad_inputs(case, run_dir, config, ckpt, tmp_path):
    """Arguments of each bad invocation and a fragment its error message must hold."""
    train = ["train", config, "--output-dir", run_dir]
    resume = train + ["--resume"]  # gets past the existing-run check to the one under test
    if case == "existing run without --resume":
        return train, "already holds a run"
    if case == "--resume into an empty dir":
        empty = tmp_path / "empty"
        empty.mkdir()
        return ["train", config, "--output-dir", empty, "--resume"], "no checkpoint"
    if case == "--resume with another model shape":
        return resume + ["--set", "model.hidden_size=64"], "model.hidden_size is 64"
    if case == "--resume from corrupt checkpoints":
        for each in ckpt.parent.glob("step_*.ckpt"):   # the older ones too: none to fall back on
            each.write_bytes(os.urandom(4096))
            os.utime(each, ns=(1, 1))
        return resume, "no readable checkpoint"
    if case == "eval of a corrupt checkpoint":
        corrupt = tmp_path / "corrupt.ckpt"
        corrupt.write_bytes(os.urandom(4096))
        return ["eval", config, "--ckpt", corrupt], "cannot be read"
    if case in DATASET_FAULTS:
        dataset, extra, fragment = _damaged_dataset(case, config, tmp_path)
        return resume + ["--set", f"data.dataset_dir={dataset}", *extra], fragment
    if case == "eval of a bigger model's checkpoint":
        return ["eval", config, "--ckpt", _with_a_second_block(ckpt, tmp_path)], "the model lacks"
    if case == "infinite train.lr":
        return resume + ["--set", "train.lr=.inf"], "train.lr must be a finite number"
    if case == "a directory as config":
        return ["train", tmp_path, "--output-dir", run_dir], "is a directory, not a file"
    if case == "a directory as checkpoint":
        return ["eval", config, "--ckpt", tmp_path], "is a directory, not a file"
    if case == "an empty checkpoint":
        empty = tmp_path / "empty.ckpt"
        empty.write_bytes(b"")
        return ["eval", config, "--ckpt", empty], "is empty (0 bytes)"
    if case == "eval of another model shape":
        return (["eval", config, "--ckpt", ckpt, "--set", "model.hidden_size=64"],
                "does not match the model")
    if case == "missing data source":
        return (resume + ["--set", f"data.dataset_dir={tmp_path / 'new_dataset'}",
                          "--set", f"data.sources=[{tmp_path / 'missing.txt'}]"],
                "missing.txt: file not found")
    if case == "model_parallel on CPU":
        return resume + ["--set", "parallel.model_parallel=2"], "parallel.model_parallel=2"
    if case == "flash attention on CPU":
        return resume + ["--set", "model.flash_attention=true"], "model.flash_attention=true"
    if case == "indivisible batch":
        return resume + ["--set", "parallel.data_parallel=3"], "not divisible by 3"
    if case == "unknown key":
        return resume + ["--set", "train.bogus=1"], "unknown key 'train.bogus'"
    if case == "a file where the checkpoints go":
        blocked = tmp_path / "blocked"
        blocked.mkdir()
        (blocked / "checkpoints").write_text("keep me")
        return (["train", config, "--output-dir", blocked],
                f"{blocked / 'checkpoints'} is a file where the run keeps its checkpoints")
    if case == "no dataset and no sources":
        return (resume + ["--set", f"data.dataset_dir={tmp_path / 'nowhere'}", "data.sources=[]"],
                "does not exist, and data.sources is empty: give data.sources")
    if case == "steps past 32 bits":
        return (resume + ["--set", "train.steps=99999999999999999999999999"],
                "train.steps=99999999999999999999999999 is out of range: at most 2147483647")
    if case == "a model bigger than memory":
        return (["train", config, "--output-dir", tmp_path / "big", "--set",
                 "model.hidden_size=1073741824", "model.num_heads=1"],
                "error: out of memory: Unable to allocate")
    raise AssertionError(case)


DATASET_FAULTS = ("truncated train file", "truncated held-out file", "corrupt tokenizer",
                  "changed train file, --verify-data", "dataset of other sources")


def _damaged_dataset(case, config, tmp_path):
    """A copy of the config's dataset with `case`'s damage; returns (its directory, extra
    arguments, the fragment the error must hold)."""
    import yaml
    with open(config, encoding="utf-8") as handle:
        source = yaml.safe_load(handle)["data"]["dataset_dir"]
    dataset = tmp_path / "dataset"
    shutil.copytree(source, dataset)
    if case.startswith("truncated"):
        damaged = dataset / ("train.mindrecord" if "train" in case else "heldout.mindrecord")
        damaged.write_bytes(damaged.read_bytes()[:damaged.stat().st_size // 2])
        return dataset, [], f"{damaged}: {damaged.stat().st_size} bytes, but "
    if case == "corrupt tokenizer":
        tokenizer = dataset / "tokenizer.model"
        tokenizer.write_bytes(os.urandom(tokenizer.stat().st_size))   # same size
        return dataset, [], "tokenizer.model: not a readable SentencePiece model"
    if case == "changed train file, --verify-data":
        train = dataset / "train.mindrecord"
        content = bytearray(train.read_bytes())
        content[len(content) // 2] ^= 0xFF                            # same size, one byte
        train.write_bytes(bytes(content))
        return dataset, ["--verify-data"], "train.mindrecord: its SHA-256 differs"
    manifest = json.loads((dataset / "dataset.json").read_text())
    manifest["sources"] = [str(tmp_path / "elsewhere.txt")]
    (dataset / "dataset.json").write_text(json.dumps(manifest))
    return dataset, [], "elsewhere.txt']; set data.sources to those"


def _with_a_second_block(ckpt, tmp_path):
    """A checkpoint like `ckpt` with a second transformer block (a 2-layer model's)."""
    import mindspore as ms
    values = ms.load_checkpoint(str(ckpt))
    block = "lm.transformer.blocks.0."
    extra = {name.replace(".0.", ".1.", 1): value for name, value in values.items()
             if name.startswith(block) or name.startswith("adam_m." + block)}
    assert extra
    bigger = tmp_path / "two_layers.ckpt"
    ms.save_checkpoint([{"name": name, "data": value} for name, value in
                        {**values, **extra}.items()], str(bigger))
    return bigger


@pytest.mark.parametrize("case", [
    "existing run without --resume", "--resume into an empty dir",
    "--resume with another model shape", "--resume from corrupt checkpoints",
    "eval of a corrupt checkpoint", "eval of another model shape", "missing data source",
    "eval of a bigger model's checkpoint", "infinite train.lr", "a directory as config",
    "a directory as checkpoint", "an empty checkpoint", *DATASET_FAULTS,
    "model_parallel on CPU", "flash attention on CPU", "indivisible batch", "unknown key",
    "steps past 32 bits", "a model bigger than memory", "a file where the checkpoints go",
    "no dataset and no sources"])
def test_bad_input_stops_with_one_error_line_and_touches_nothing(trained, tmp_path, case):
    run_dir = tmp_path / "run"
    shutil.copytree(trained["run_dir"], run_dir)  # copy2: bytes and mtimes are kept
    ckpt = run_dir / "checkpoints" / "step_00000004.ckpt"
    args, fragment = _bad_inputs(case, run_dir, trained["config"], ckpt, tmp_path)
    before = snapshot(run_dir)

    result = run_cli(*args)

    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0]
    assert snapshot(run_dir) == before, "the run's files changed"
    if (tmp_path / "empty").exists():
        assert os.listdir(tmp_path / "empty") == []
    assert not (tmp_path / "new_dataset" / "dataset.json").exists()


def _copy_run(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained["run_dir"], run_dir)
    return run_dir


def _timings(entry):
    """The metrics entry's timings, which differ from run to run."""
    return {key: entry[key] for key in ("samples_per_s", "tokens_per_s", "step_ms",
                                        "outside_step_ms")}


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_falls_back_past_an_unreadable_checkpoint(trained, tmp_path):
    run_dir = _copy_run(trained, tmp_path)
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step_00000004.ckpt").write_bytes(os.urandom(4096))
    (checkpoints / "step_00000006.tmp.tmp").write_bytes(b"partial")   # a killed save's file
    original = _metrics(run_dir)

    result = run_cli("train", trained["config"], "--output-dir", run_dir, "--resume")

    assert result.returncode == 0, result.stderr
    assert f"removed {checkpoints / 'step_00000006.tmp.tmp'}" in result.stdout
    assert "renamed it to step_00000004.ckpt.unreadable" in result.stdout
    assert f"resuming from {checkpoints / 'step_00000002.ckpt'} (step 2)" in result.stdout
    assert (checkpoints / "step_00000004.ckpt.unreadable").is_file()
    assert sorted(p.name for p in checkpoints.glob("step_*.ckpt")) == [
        "step_00000002.ckpt", "step_00000004.ckpt"]
    assert _metrics(run_dir) == [  # steps 3 and 4 again, exactly as the first time
        {**entry, **_timings(new)}
        for entry, new in zip(original, _metrics(run_dir))]


def test_a_checkpoint_whose_bytes_changed_fails_its_checksum(trained, tmp_path):
    """One flipped bit in a weight still parses, and would evaluate to a wrong loss (Inf for
    an exponent bit): MindSpore's CRC, written with every checkpoint, refuses it. `eval`
    is one error line; `--resume` renames it aside and resumes from the one before."""
    run_dir = _copy_run(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[int(len(data) * 0.6)] ^= 0x40
    newest.write_bytes(data)

    evaluated = run_cli("eval", trained["config"], "--ckpt", newest)
    assert evaluated.returncode == 2
    assert evaluated.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {str(newest)!r} fails the checksum it was saved with: its bytes "
        f"changed since (a flipped bit, a damaged copy)")

    result = run_cli("train", trained["config"], "--output-dir", run_dir, "--resume")
    assert result.returncode == 0, result.stderr
    assert "renamed it to step_00000004.ckpt.unreadable" in result.stdout
    assert "(step 2)" in result.stdout


@pytest.mark.slow
def test_resume_with_more_steps_keeps_the_schedule(trained, tmp_path):
    """The trained run decays lr 1e-2 -> 1e-3 over 4 steps; extending it keeps the floor
    unless train.lr_schedule_steps asks for a new length."""
    kept = _copy_run(trained, tmp_path / "kept")
    result = run_cli("train", trained["config"], "--output-dir", kept, "--resume",
                     "--set", "train.steps=6")
    assert result.returncode == 0, result.stderr
    assert "keeps its length of 4 steps (train.steps is now 6)" in result.stdout
    assert [entry["lr"] for entry in _metrics(kept)[4:]] == pytest.approx([1e-3, 1e-3])

    stretched = _copy_run(trained, tmp_path / "stretched")
    result = run_cli("train", trained["config"], "--output-dir", stretched, "--resume",
                     "--set", "train.steps=6", "--set", "train.lr_schedule_steps=6")
    assert result.returncode == 0, result.stderr
    assert "keeps its length" not in result.stdout
    assert _metrics(stretched)[4]["lr"] > 2e-3


@pytest.mark.slow
def test_safetensors_checkpoints_train_resume_and_evaluate(trained, tmp_path):
    """train.checkpoint_format=safetensors: the same run, saved as .safetensors, resumes and
    evaluates as the .ckpt run does."""
    run_dir = tmp_path / "run"
    fmt = ["--set", "train.checkpoint_format=safetensors"]
    result = run_cli("train", trained["config"], "--output-dir", run_dir, *fmt)
    assert result.returncode == 0, result.stderr
    checkpoints = run_dir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step_00000002.safetensors",
                                               "step_00000004.safetensors"]
    assert _metrics(run_dir) == [
        {**entry, **_timings(new)}
        for entry, new in zip(_metrics(trained["run_dir"]), _metrics(run_dir))]
    evaluated = [run_cli("eval", trained["config"], "--ckpt", ckpt).stdout
                 for ckpt in (checkpoints / "step_00000004.safetensors", trained["ckpt"])]
    assert evaluated[0] == evaluated[1] and evaluated[0].startswith("{")

    os.remove(checkpoints / "step_00000004.safetensors")
    result = run_cli("train", trained["config"], "--output-dir", run_dir, "--resume", *fmt)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {checkpoints / 'step_00000002.safetensors'} (step 2)" in result.stdout
    assert [entry["loss"] for entry in _metrics(run_dir)] == [
        entry["loss"] for entry in _metrics(trained["run_dir"])]


def test_one_set_takes_several_overrides():
    """`--set a.b=1 c.d=2` as the usage line reads, mixed with repeated --set."""
    result = run_cli("plan", "model_zoo/gpt2/configs/tiny.yaml", "--set",
                     "parallel.data_parallel=2", "parallel.model_parallel=2",
                     "--set", "train.global_batch_size=16", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["layout"]["data_parallel"], report["layout"]["model_parallel"],
            report["batch"]["global"]) == (2, 2, 16)
    result = run_cli("plan", "model_zoo/gpt2/configs/tiny.yaml", "--set",
                     "parallel.model_parallel=2", "model_zoo/gpt2/configs/tiny.yaml")
    assert result.returncode == 2
    assert "must look like section.key=value (give the CONFIG before --set)" in result.stderr


@pytest.mark.parametrize("argv", [
    ["plan", "model_zoo/models/gpt2/configs/tiny.yaml", "--device-num", "0"],
    ["plan", "model_zoo/models/gpt2/configs/tiny.yaml", "--devices-per-server", "0"],
    ["advise", "model_zoo/models/gpt2/configs/tiny.yaml", "--device-num", "-8"],
    ["launch", "--workers", "2", "--output-dir", "out", "--grace", "-1", "--", "true"],
    ["launch", "--workers", "0", "--output-dir", "out", "--", "true"],
    ["launch", "--workers", "2", "--output-dir", "out", "--stop-timeout", "nan", "--", "true"],
], ids=["plan-device-num", "plan-devices-per-server", "advise-device-num", "launch-grace",
        "launch-workers", "launch-stop-timeout"])
def test_counts_and_seconds_out_of_range_are_usage_errors(argv, capsys):
    from model_zoo.cli import main as model_zoo_main
    from model_zoo.launch.local import main as launch_main
    with pytest.raises(SystemExit) as stopped:
        launch_main(argv[1:]) if argv[0] == "launch" else model_zoo_main(argv)
    assert stopped.value.code == 2
    assert "must be >= " in capsys.readouterr().err


def test_outputs_that_cannot_be_made_are_refused_before_the_work(tmp_path):
    """A file where a directory of an output path must be, or a directory given as an
    output file: one error naming it, before `advise`, `plan` or `export` does its work
    (they called os.makedirs or wrote only at the end, and ended in a traceback); a run
    whose metrics.jsonl is a directory is refused before it trains."""
    from model_zoo.config import load_config
    from model_zoo.errors import UserInputError
    from model_zoo.files import check_output_file
    from model_zoo.train.trainer import check_output_dir
    a_file = tmp_path / "FILE"
    a_file.write_text("keep me")
    with pytest.raises(UserInputError, match=f"cannot create the directory {a_file}/deeper: "
                                             f"{a_file} is a file, not a directory"):
        check_output_file(a_file / "deeper" / "x.yaml", "--write")
    with pytest.raises(UserInputError, match="--save-strategy .* is a directory"):
        check_output_file(tmp_path, "--save-strategy")
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    config = load_config("model_zoo/models/gpt2/configs/tiny.yaml")
    with pytest.raises(UserInputError, match="metrics.jsonl is a directory where the run"):
        check_output_dir(str(run_dir), config, resume=True)
    assert a_file.read_text() == "keep me"
