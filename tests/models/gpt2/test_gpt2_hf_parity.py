"""A converted Hugging Face GPT-2 gives the same logits and greedy ids as the original."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mindspore as ms  # noqa: E402

from conftest import run_cli  # noqa: E402
from model_zoo.config import load_config  # noqa: E402
from model_zoo.errors import CheckpointError, DataError  # noqa: E402
from model_zoo.models.gpt2.convert import convert_hf_gpt2  # noqa: E402
from model_zoo.causal_lm.generate import CachedGenerator, generate  # noqa: E402
from model_zoo.models.gpt2.model import GPT2ForTraining  # noqa: E402
from model_zoo.checkpoint.files import load_weights, read_checkpoint  # noqa: E402

SEQ, VOCAB = 32, 101


def _hf_config():
    return transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_hf_config()).eval()
    # Hugging Face initialises biases to 0 and layer norms to (1, 0): perturb every
    # parameter so the test also checks how biases and norms are mapped.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    path, model = hf_dir
    out = tmp_path_factory.mktemp("converted")
    config_path, ckpt_path = convert_hf_gpt2(str(path), str(out))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = load_config(config_path)
    network = GPT2ForTraining(config.model)
    load_weights(network, ckpt_path)
    network.set_train(False)
    return config, network.lm, model, ckpt_path


def test_config_matches(converted):
    config = converted[0]
    assert (config.model.name, config.model.num_layers, config.model.hidden_size,
            config.model.num_heads, config.model.seq_length, config.model.vocab_size) == \
        ("gpt2", 2, 64, 4, SEQ, VOCAB)
    assert config.model.ffn_hidden_size == 0
    assert config.model.dropout == 0.0 and config.model.attention_dropout == 0.0
    assert config.model.layer_norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("length", [SEQ, 13])
def test_logits_match(converted, length):
    _, lm, model, _ = converted
    ids = np.random.default_rng(length).integers(0, VOCAB, size=(2, length)).astype(np.int32)
    ours = lm(ms.Tensor(ids)).asnumpy().reshape(2, length, VOCAB)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    diff = np.abs(ours - theirs).max()
    print(f"max |logit difference| at length {length}: {diff:.3e}")
    assert diff < 1e-4


def test_greedy_generation_matches(converted):
    _, lm, model, _ = converted
    prompt = [5, 17, 42, 3, 99]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             do_sample=False, max_new_tokens=8, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    ours = generate(lm, prompt, 8, seq_length=SEQ)
    assert len(theirs) == 8
    assert ours == theirs


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_cached_batch_generation_matches_hugging_face(converted, penalty):
    """Prompts of different lengths: Hugging Face left-pads them with an attention mask
    (positions from the mask), ours feeds each row from its first token."""
    _, lm, model, _ = converted
    prompts = [[5, 17, 42, 3, 99], [8], [61, 2, 77]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                             pad_token_id=0, repetition_penalty=penalty)
    theirs = out[:, width:].tolist()
    assert CachedGenerator(lm).generate(prompts, 10, repetition_penalty=penalty) == theirs


def test_bin_weights_without_prefix_convert_identically(hf_dir, converted, tmp_path):
    path, model = hf_dir
    source = tmp_path / "bin"
    source.mkdir()
    (source / "config.json").write_text((path / "config.json").read_text())
    state = {key[len("transformer."):]: value for key, value in model.state_dict().items()
             if key.startswith("transformer.")}
    torch.save(state, str(source / "pytorch_model.bin"))
    _, ckpt = convert_hf_gpt2(str(source), str(tmp_path / "out"))
    expected, got = read_checkpoint(converted[3]), read_checkpoint(ckpt)
    assert sorted(expected) == sorted(got)
    for name in expected:
        np.testing.assert_array_equal(expected[name].asnumpy(), got[name].asnumpy())


def test_refuses_to_overwrite(hf_dir, tmp_path):
    path, _ = hf_dir
    convert_hf_gpt2(str(path), str(tmp_path))
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf_gpt2(str(path), str(tmp_path))
    convert_hf_gpt2(str(path), str(tmp_path), overwrite=True)


def test_not_a_gpt2_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(DataError, match="config.json.*not a GPT-2 config"):
        convert_hf_gpt2(str(tmp_path), str(tmp_path / "out"))


def test_unsupported_option(tmp_path):
    _hf_config().save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["scale_attn_by_inverse_layer_idx"] = True
    raw["activation_function"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="scale_attn_by_inverse_layer_idx"):
        convert_hf_gpt2(str(tmp_path), str(tmp_path / "out"))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        convert_hf_gpt2(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    with pytest.raises(DataError, match="config.json"):
        convert_hf_gpt2(str(tmp_path), str(tmp_path / "out"))


def test_missing_weight_file(tmp_path):
    _hf_config().save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="no weight file"):
        convert_hf_gpt2(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_tensor(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    path, _ = hf_dir
    tensors = load_file(str(path / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.bias"))
    del tensors[key]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"h\.1\.mlp\.c_fc\.bias"):
        convert_hf_gpt2(str(tmp_path), str(tmp_path / "out"))


def test_to_hf_loads_in_transformers_and_converts_back_bit_identical(converted, hf_dir,
                                                                    tmp_path):
    """Ours -> Hugging Face: transformers loads the folder and gives the logits of the
    original Hugging Face model exactly (same weights); converting it back gives our
    checkpoint bit for bit."""
    config, lm, original, ckpt = converted
    config_path = os.path.join(os.path.dirname(ckpt), "config.yaml")
    out = tmp_path / "hf"
    result = run_cli("convert", "gpt2", "--to-hf", "--config", config_path, "--ckpt", ckpt,
                     "--output-dir", out)
    assert result.returncode == 0, result.stderr
    exported = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(2, SEQ)).astype(np.int64)
    with torch.no_grad():
        theirs = exported(torch.from_numpy(ids)).logits.numpy()
        reference = original(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_array_equal(theirs, reference)
    ours = lm(ms.Tensor(ids.astype(np.int32))).asnumpy().reshape(theirs.shape)
    assert np.abs(ours - theirs).max() < 1e-4          # the parity bound of test_logits_match

    _, back = convert_hf_gpt2(str(out), str(tmp_path / "back"))
    first, second = read_checkpoint(ckpt), read_checkpoint(back)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name].asnumpy(), second[name].asnumpy(), name)
