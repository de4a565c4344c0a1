"""A converted Hugging Face Mixtral (4 experts, 2 a token, grouped heads, a rotary base
other than LLaMA's) and Qwen2-MoE (a dense layer before a sparse one, a gated shared expert,
query/key/value biases, top-k weights not renormalised) give the same logits, greedy ids and
load-balancing loss as the originals, and go back to Hugging Face bit for bit."""

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
from model_zoo.checkpoint.files import load_weights, read_checkpoint  # noqa: E402
from model_zoo.config import load_config  # noqa: E402
from model_zoo.models.mixtral.convert import convert_hf_mixtral  # noqa: E402
from model_zoo.models.mixtral.model import MixtralForTraining  # noqa: E402

SEQ, VOCAB, EXPERTS = 32, 101, 4


SHARED = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, num_experts_per_tok=2,
              rope_theta=500000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_MODELS = {   # model_type: (causal LM class, its config, our expected (expert width, shared))
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        intermediate_size=76, num_local_experts=EXPERTS, **SHARED), (76, 0)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        intermediate_size=88, moe_intermediate_size=40, shared_expert_intermediate_size=80,
        num_experts=EXPERTS, decoder_sparse_step=2, norm_topk_prob=False, **SHARED),
        (40, 2))}


@pytest.fixture(scope="module", params=list(HF_MODELS))
def converted(request, tmp_path_factory):
    torch.manual_seed(3)
    model_class, hf_config, _ = HF_MODELS[request.param]
    model = model_class(hf_config).eval()
    with torch.no_grad():   # norms start at 1: perturb everything so the mapping counts
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("hf_mixtral")
    model.save_pretrained(str(path))
    out = tmp_path_factory.mktemp("converted")
    config_path, ckpt_path = convert_hf_mixtral(str(path), str(out))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = load_config(config_path)
    network = MixtralForTraining(config.model)
    assert load_weights(network, ckpt_path) == []
    network.set_train(False)
    return config, network.lm, model, ckpt_path


def test_config_matches(converted):
    model = converted[0].model
    width, shared = HF_MODELS[converted[2].config.model_type][2]
    assert (model.name, model.num_experts, model.num_experts_per_tok, model.expert_size,
            model.num_shared_experts, model.kv_heads, model.rope_theta) == (
        "mixtral", EXPERTS, 2, width, shared, 2, 500000.0)


def test_logits_and_balance_loss_match(converted):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    _, lm, model, _ = converted
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ)).astype(np.int32)
    logits, balance = lm.with_balance_loss(ms.Tensor(ids))
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), output_router_logits=True)
    assert np.abs(logits.asnumpy().reshape(2, SEQ, VOCAB) - out.logits.numpy()).max() < 1e-4
    expected = load_balancing_loss_func(out.router_logits, EXPERTS, 2).item()
    assert float(balance.asnumpy()) == pytest.approx(expected, rel=1e-4)


def test_greedy_generation_matches(converted):
    """Through the key/value caches too, prompts of different lengths left-padded by
    Hugging Face."""
    _, lm, model, _ = converted
    prompt = [5, 17, 42, 3, 99]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), do_sample=False, max_new_tokens=8,
            pad_token_id=0)
    assert generate(lm, prompt, 8, seq_length=SEQ) == out[0, len(prompt):].tolist()
    prompts = [[5, 17, 42, 3, 99, 7, 64, 12], [8], [61, 2, 77]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                             pad_token_id=0)
    assert CachedGenerator(lm).generate(prompts, 6) == out[:, width:].tolist()


def test_to_hf_converts_back_bit_identical(converted, tmp_path):
    config, _, original, ckpt = converted
    config_path = os.path.join(os.path.dirname(ckpt), "config.yaml")
    out = tmp_path / "hf"
    result = run_cli("convert", "mixtral", "--to-hf", "--config", config_path, "--ckpt",
                     ckpt, "--output-dir", out)
    assert result.returncode == 0, result.stderr
    exported = type(original).from_pretrained(str(out)).eval()
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(2, SEQ)).astype(np.int64)
    with torch.no_grad():
        np.testing.assert_array_equal(exported(torch.from_numpy(ids)).logits.numpy(),
                                      original(torch.from_numpy(ids)).logits.numpy())
    _, back = convert_hf_mixtral(str(out), str(tmp_path / "back"))
    first, second = read_checkpoint(ckpt), read_checkpoint(back)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name].asnumpy(), second[name].asnumpy(), name)
