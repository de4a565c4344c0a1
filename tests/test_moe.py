"""The mixture-of-experts block (`nn.moe`): dropless routing as Hugging Face's Mixtral
computes it, its load-balancing loss, and the capacity rule that drops what overflows."""

import numpy as np
import pytest
import mindspore as ms

from model_zoo.nn.backend import kernels_for
from model_zoo.nn.moe import LoadBalancingLoss, MixtureOfExperts, expert_capacity
from model_zoo.parallel.config import ParallelConfig

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
HIDDEN, FFN, EXPERTS, TOP_K = 16, 24, 4, 2


@pytest.fixture(scope="module")
def mixtral():
    """Hugging Face's Mixtral MoE block with random weights, our block with the same ones,
    and a batch of 2 x 5 tokens."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    reference = MixtralSparseMoeBlock(config).eval()
    for parameter in reference.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    gate_up = reference.experts.gate_up_proj.detach().numpy()   # (E, 2 ffn, hidden)
    weights = {"router": reference.gate.weight.detach().numpy(),
               "gate": gate_up[:, :FFN].transpose(0, 2, 1),
               "up": gate_up[:, FFN:].transpose(0, 2, 1),
               "down": reference.experts.down_proj.detach().numpy().transpose(0, 2, 1)}
    x = torch.randn(2, 5, HIDDEN)
    return reference, weights, x


def block(weights, parallel_config=None, **options):
    layer = MixtureOfExperts(HIDDEN, FFN, EXPERTS, TOP_K,
                             parallel_config=parallel_config or ParallelConfig(), **options)
    for name, value in weights.items():
        getattr(layer, name).set_data(ms.Tensor(np.ascontiguousarray(value)))
    return layer


@pytest.mark.parametrize("kernels", ["CPU", "Ascend"])
def test_dropless_routing_is_hugging_faces_mixtral(mixtral, kernels):
    """Both ways to the experts: the CPU kernel's products on the rows routed to each
    expert, and the slots the dispatch products fill (Ascend's operators, run here on
    CPU)."""
    reference, weights, x = mixtral
    expected = reference(x).detach().numpy()
    with kernels_for(kernels):
        layer = block(weights)
    assert (layer.kernel is not None) == (kernels == "CPU")
    found, statistics = layer(ms.Tensor(x.numpy()))
    assert np.abs(found.asnumpy() - expected).max() < 1e-5
    choices, probability_sums = statistics.asnumpy()
    assert choices.sum() == 2 * 5 * TOP_K
    assert probability_sums.sum() == pytest.approx(10, rel=1e-5)


@pytest.mark.parametrize("tokens", [5, 1])
def test_the_cpu_kernels_gradients_are_the_operators(mixtral, tokens):
    """The routed CPU kernel's backward pass (input, router through the weights, the three
    expert projections) against MindSpore's autograd through the slots; with one token,
    two experts are picked by no token (their gradients zero)."""
    _, weights, x = mixtral
    inputs = ms.Tensor(np.ascontiguousarray(x.numpy()[:, :tokens]))
    probe = ms.Tensor(np.random.default_rng(1).normal(size=inputs.shape).astype(np.float32))

    def gradients(kernels):
        with kernels_for(kernels):
            layer = block(weights)
        def loss(x):
            return (layer(x)[0] * probe).sum()
        grad = ms.grad(loss, grad_position=0, weights=layer.trainable_params())
        dx, dparams = grad(inputs)
        return [dx.asnumpy()] + [p.asnumpy() for p in dparams]

    found, expected = gradients("CPU"), gradients("Ascend")
    assert len(found) == 5   # x, router, gate, up, down
    for got, want in zip(found, expected):
        assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    unpicked = [e for e in range(EXPERTS) if not np.abs(found[2][e]).any()]
    if tokens == 1:
        assert len(unpicked) == 2 and all(not found[4][e].any() for e in unpicked)


def test_the_load_balancing_loss_is_hugging_faces(mixtral):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    reference, weights, x = mixtral
    logits = x.reshape(-1, HIDDEN) @ reference.gate.weight.T
    expected = load_balancing_loss_func((logits, logits), EXPERTS, TOP_K).item()
    layer = block(weights)
    _, statistics = layer(ms.Tensor(x.numpy()))
    _, statistics = layer(ms.Tensor(x.numpy()), statistics)   # the two layers' sums
    found = LoadBalancingLoss(EXPERTS)(statistics, 2 * 10)
    assert float(found.asnumpy()) == pytest.approx(expected, rel=1e-5)


def capacity_reference(tokens, weights, capacity):
    """numpy: the block's output and choices per expert for one group of tokens, each
    expert taking `capacity` of them in priority order (module docstring of nn.moe)."""
    logits = tokens @ weights["router"].T
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    order = np.argsort(-probabilities, -1)[:, :TOP_K]
    top = np.take_along_axis(probabilities, order, -1)
    top /= top.sum(-1, keepdims=True)

    def expert(e, rows):
        gate, up = rows @ weights["gate"][e], rows @ weights["up"][e]
        return (gate / (1 + np.exp(-gate)) * up) @ weights["down"][e]

    expected, taken = np.zeros_like(tokens), np.zeros(EXPERTS, int)
    for j in range(TOP_K):
        for t in range(len(tokens)):
            e = order[t, j]
            if taken[e] < capacity:
                expected[t] += top[t, j] * expert(e, tokens[t])
            taken[e] += 1
    return expected, taken


def test_a_full_expert_drops_the_later_choices(mixtral):
    """Capacity 1.0: each sequence (a routing group) gives an expert C = k T / E of its T
    tokens' choices; they fill them in priority order (every token's first choice, then
    the second ones, each in token order) and the rest are dropped, the token keeping its
    other expert's weighted output."""
    _, weights, x = mixtral
    capacity = expert_capacity(5, EXPERTS, TOP_K, 1.0)
    assert capacity == 3
    sequences = [capacity_reference(tokens, weights, capacity) for tokens in x.numpy()]
    taken = sequences[0][1] + sequences[1][1]
    assert max(taken_here.max() for _, taken_here in sequences) > capacity   # drops
    layer = block(weights, capacity_factor=1.0)
    found, statistics = layer(ms.Tensor(x.numpy()))
    expected = np.stack([output for output, _ in sequences])
    assert np.abs(found.asnumpy() - expected).max() < 1e-5
    assert list(statistics.asnumpy()[0]) == list(taken)   # dropped choices still count
    # the layer's record of its routing, which the run log reads
    assert list(layer.expert_load.asnumpy()) == list(taken)
    dropped = sum(np.maximum(here - capacity, 0).sum() for _, here in sequences)
    assert dropped > 0 and layer.expert_dropped.asnumpy()[0] == dropped


def test_the_routing_does_not_depend_on_the_layout(mixtral):
    """The groups are sequences whatever the layout: data_parallel 2 with expert parallel
    routes as one device does; only when the ranks hold less than a sequence each (4 ranks,
    2 sequences) is each sequence cut in equal parts (here halves of 2 tokens, 1 slot an
    expert)."""
    _, weights, x = mixtral
    one_device, _ = block(weights, capacity_factor=1.0)(ms.Tensor(x.numpy()))
    layout = ParallelConfig(data_parallel=2, expert_parallel=2)
    found, _ = block(weights, capacity_factor=1.0, parallel_config=layout)(
        ms.Tensor(x.numpy()))
    assert np.abs(found.asnumpy() - one_device.asnumpy()).max() < 1e-6
    halves = x.numpy()[:, :4].reshape(4, 2, HIDDEN)
    capacity = expert_capacity(2, EXPERTS, TOP_K, 1.0)
    expected = np.stack([capacity_reference(piece, weights, capacity)[0] for piece in halves])
    found, _ = block(weights, capacity_factor=1.0, parallel_config=ParallelConfig(
        data_parallel=4))(ms.Tensor(np.ascontiguousarray(x.numpy()[:, :4])))
    assert np.abs(found.asnumpy() - expected.reshape(2, 4, HIDDEN)).max() < 1e-5


def test_expert_capacity():
    assert expert_capacity(512, 8, 2, 0.0) == 512      # dropless: every token fits
    assert expert_capacity(512, 8, 2, 1.25) == 160     # ceil(2 x 512 / 8 x 1.25)
    assert expert_capacity(4, 8, 1, 1.0) == 1
    assert expert_capacity(10, 2, 2, 4.0) == 10        # never more than the tokens


def test_expert_parallel_must_divide_the_data_parallel_devices_and_the_experts():
    from model_zoo.errors import ConfigError
    with pytest.raises(ConfigError, match="expert_parallel=4 must divide "
                                          "parallel.data_parallel=2"):
        ParallelConfig(data_parallel=2, expert_parallel=4).validate()
    with pytest.raises(ConfigError, match="model.num_experts=4 is not divisible by "
                                          "parallel.expert_parallel=8"):
        MixtureOfExperts(HIDDEN, FFN, EXPERTS, TOP_K, parallel_config=ParallelConfig(
            data_parallel=8, expert_parallel=8))


def test_dense_layers_and_the_shared_gate_are_checked_where_the_config_is_read():
    from model_zoo.config import load_config
    from model_zoo.cost.advisor import Advisor
    from model_zoo.errors import ConfigError, UserInputError
    mixtral_config_file = "model_zoo/models/mixtral/configs/tiny.yaml"
    with pytest.raises(ConfigError, match=r"model.moe_layer_freq=3 must be in \[1, "
                                          r"model.num_layers=2\]"):
        load_config(mixtral_config_file, ["model.moe_layer_freq=3"])
    with pytest.raises(ConfigError, match="shared_expert_gate needs shared experts"):
        load_config(mixtral_config_file, ["model.shared_expert_gate=true"])
    config = load_config(mixtral_config_file, ["model.moe_layer_freq=2"])
    assert [config.model.has_experts(layer) for layer in range(2)] == [False, True]
    with pytest.raises(UserInputError, match="alternates dense and expert blocks"):
        Advisor(config)


def test_a_run_logs_each_layers_expert_load_and_the_drop_rate(tmp_path):
    """metrics.jsonl of a Mixtral run with a capacity: per layer the choices each expert
    received (k of every token: 2 x 64 x 16 a step), their max over mean, and the share
    dropped; the progress line shows them; checkpoints leave the records out."""
    import json
    from conftest import run_cli
    out = tmp_path / "run"
    result = run_cli("train", "model_zoo/models/mixtral/configs/tiny.yaml", "--set",
                     "train.steps=2", "train.log_steps=1", "train.save_steps=2",
                     "model.capacity_factor=1.0", "--output-dir", out, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for entry in entries:
        assert len(entry["expert_load"]) == 2                       # one list a layer
        assert all(sum(load) == 2 * 64 * 16 for load in entry["expert_load"])
        assert all(ratio >= 1.0 for ratio in entry["expert_load_max_over_mean"])
        assert 0.0 < entry["expert_drop_rate"] < 1.0
    assert "experts max/mean" in result.stdout and "% dropped" in result.stdout
    saved = ms.load_checkpoint(str(next((out / "checkpoints").glob("*.ckpt"))))
    assert not any(name.endswith(("expert_load", "expert_dropped")) for name in saved)
