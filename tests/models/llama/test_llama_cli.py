"""LLaMA through the `model-zoo` command as a user runs it: the tiny config's model (4 query
heads over 2 key/value heads) trains on the decoder dataset GPT-2 builds, then `eval` and
`generate` take its config as they take GPT-2's, with the same flags and output lines."""

import json
import math
import re

import yaml

from conftest import TINY_VOCAB, run_cli, tiny_config_dict


def test_train_eval_and_generate(tiny_dataset, tmp_path):
    config = tiny_config_dict(tiny_dataset, {"train.steps": 4, "train.save_steps": 4,
                                             "train.log_steps": 2})
    config["model"] = {"name": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                       "num_kv_heads": 2, "ffn_hidden_size": 40,
                       "seq_length": config["model"]["seq_length"],
                       "vocab_size": config["model"]["vocab_size"]}
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    trained = run_cli("train", path, "--output-dir", tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "step 4/4 | loss" in trained.stdout and "sample: " in trained.stdout
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004.ckpt"

    evaluated = run_cli("eval", path, "--ckpt", ckpt)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert math.isfinite(report["loss"]) and report["samples"] > 0
    printed = re.search(r"held-out evaluation: (\{.*\})", trained.stdout).group(1)
    assert report == json.loads(printed)

    generated = run_cli("generate", path, "--ckpt", ckpt, "--prompt-ids", "1 2 3", "--greedy",
                        "--max-new-tokens", "5")
    assert generated.returncode == 0, generated.stderr
    first = generated.stdout.splitlines()[0]
    assert first.startswith("ids:")
    ids = [int(token) for token in first[len("ids:"):].split()]
    assert len(ids) == 5 and all(0 <= i < TINY_VOCAB for i in ids)
