"""A converted Hugging Face LLaMA (grouped heads, an odd SwiGLU width, a rotary base other
than the default, untied and tied heads) gives the same logits and greedy ids as the
original, and goes back to Hugging Face bit for bit."""

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
from model_zoo.causal_lm.generate import CachedGenerator, generate  # noqa: E402
from model_zoo.config import load_config  # noqa: E402
from model_zoo.errors import CheckpointError, DataError  # noqa: E402
from model_zoo.models.llama.convert import convert_hf_llama  # noqa: E402
from model_zoo.models.llama.model import LlamaForTraining  # noqa: E402
from model_zoo.checkpoint.files import load_weights, read_checkpoint  # noqa: E402

SEQ, VOCAB = 32, 101


def _hf_config(tied=False):
    # 4 query heads over 2 key/value heads, an odd intermediate size, rope_theta 500000
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=75, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _saved(tmp_path_factory, tied):
    torch.manual_seed(1 + tied)
    model = transformers.LlamaForCausalLM(_hf_config(tied)).eval()
    # norms start at 1: perturb every parameter so the test also checks how they map
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("hf_llama_tied" if tied else "hf_llama")
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def converted(request, tmp_path_factory):
    path, model = _saved(tmp_path_factory, request.param)
    out = tmp_path_factory.mktemp("converted")
    config_path, ckpt_path = convert_hf_llama(str(path), str(out))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = load_config(config_path)
    network = LlamaForTraining(config.model)
    assert load_weights(network, ckpt_path) == []
    network.set_train(False)
    return config, network.lm, model, ckpt_path, path


def test_config_matches(converted):
    model = converted[0].model
    assert (model.name, model.num_layers, model.hidden_size, model.num_heads,
            model.num_kv_heads, model.ffn_hidden_size, model.seq_length,
            model.vocab_size) == ("llama", 2, 64, 4, 2, 75, SEQ, VOCAB)
    assert model.rope_theta == 500000.0 and model.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("length", [SEQ, 13])
def test_logits_match(converted, length):
    _, lm, model, _, _ = converted
    ids = np.random.default_rng(length).integers(0, VOCAB, size=(2, length)).astype(np.int32)
    ours = lm(ms.Tensor(ids)).asnumpy().reshape(2, length, VOCAB)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    diff = np.abs(ours - theirs).max()
    print(f"max |logit difference| at length {length}: {diff:.3e}")
    assert diff < 1e-4


def test_greedy_generation_matches(converted):
    _, lm, model, _, _ = converted
    prompt = [5, 17, 42, 3, 99]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), do_sample=False, max_new_tokens=8,
            pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == 8
    assert generate(lm, prompt, 8, seq_length=SEQ) == theirs


def test_cached_batch_generation_matches_hugging_face(converted):
    """Prompts of different lengths through the key/value caches of the 2 key/value heads:
    Hugging Face left-pads them with an attention mask (positions from the mask), ours
    feeds each row from its first token."""
    _, lm, model, _, _ = converted
    prompts = [[5, 17, 42, 3, 99, 7, 64, 12, 33, 81, 2, 4, 6, 8, 10, 12, 14, 16, 18],
               [8], [61, 2, 77]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                             pad_token_id=0)
    theirs = out[:, width:].tolist()
    assert CachedGenerator(lm).generate(prompts, 10) == theirs


def test_to_hf_loads_in_transformers_and_converts_back_bit_identical(converted, tmp_path):
    """Ours -> Hugging Face through the command: transformers loads the folder and gives the
    original model's logits exactly; converting it back gives our checkpoint bit for bit."""
    config, _, original, ckpt, _ = converted
    config_path = os.path.join(os.path.dirname(ckpt), "config.yaml")
    out = tmp_path / "hf"
    result = run_cli("convert", "llama", "--to-hf", "--config", config_path, "--ckpt", ckpt,
                     "--output-dir", out)
    assert result.returncode == 0, result.stderr
    exported = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(2, SEQ)).astype(np.int64)
    with torch.no_grad():
        theirs = exported(torch.from_numpy(ids)).logits.numpy()
        reference = original(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_array_equal(theirs, reference)
    _, back = convert_hf_llama(str(out), str(tmp_path / "back"))
    first, second = read_checkpoint(ckpt), read_checkpoint(back)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name].asnumpy(), second[name].asnumpy(), name)


def test_bin_weights_convert_identically(converted, tmp_path):
    _, _, model, ckpt, path = converted
    source = tmp_path / "bin"
    source.mkdir()
    (source / "config.json").write_text((path / "config.json").read_text())
    torch.save(model.state_dict(), str(source / "pytorch_model.bin"))
    _, again = convert_hf_llama(str(source), str(tmp_path / "out"))
    expected, got = read_checkpoint(ckpt), read_checkpoint(again)
    assert sorted(expected) == sorted(got)
    for name in expected:
        np.testing.assert_array_equal(expected[name].asnumpy(), got[name].asnumpy())


def test_unsupported_options_and_missing_tensors(tmp_path):
    _hf_config().save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attention_bias": True,
                                                      "rope_scaling": {"type": "linear",
                                                                       "factor": 2.0}}))
    with pytest.raises(DataError, match="attention_bias=true.*|rope_scaling"):
        convert_hf_llama(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DataError, match="not a LLaMA config"):
        convert_hf_llama(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no weight file"):
        convert_hf_llama(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
