"""`model-zoo export`: the MindIR graphs of a checkpoint, loaded back with `mindspore.load`
and `nn.GraphCell`, give the network's own outputs."""

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

from conftest import run_cli
from model_zoo.config import import_model, load_config

CONFIGS = {"gpt2": "model_zoo/models/gpt2/configs/tiny.yaml",
           "bert": "model_zoo/models/bert/configs/tiny.yaml",
           "bert classifier": "model_zoo/models/bert/configs/finetune.yaml",
           "transformer": "model_zoo/models/transformer/configs/tiny.yaml"}
SMALL = {"gpt2": ["model.num_layers=1"], "bert": ["model.num_layers=1"],
         "bert classifier": ["model.num_layers=1"], "transformer": ["model.num_layers=1"]}


def flat(outputs):
    """Every tensor of a (nested) output tuple, in order."""
    if isinstance(outputs, (tuple, list)):
        return [tensor for item in outputs for tensor in flat(item)]
    return [outputs]


def with_random_tokens(inputs, rng, vocab):
    """The example inputs with random token ids as the first input where it is a batch of
    id sequences (GPT-2's ids, BERT's input_ids, the source of the encoder); the rest (token
    types, masks, positions, caches) as the model folder gives them."""
    first = inputs[0]
    if isinstance(first, tuple) or first.dtype != ms.int32 or first.shape[-1] == 1:
        return list(inputs)
    return [ms.Tensor(rng.integers(4, vocab, first.shape).astype(np.int32)), *inputs[1:]]


@pytest.mark.parametrize("model", list(CONFIGS))
def test_exported_graphs_give_the_network_outputs(model, tmp_path):
    overrides = [f"data.dataset_dir={tmp_path / 'no-data'}", "train.device_target=CPU",
                 *SMALL[model]]
    config = load_config(CONFIGS[model], overrides)
    module = import_model(config.model.name)
    ms.set_seed(3)
    network = module.build_train_network(config, ms.float32)
    ckpt = tmp_path / "model.ckpt"
    ms.save_checkpoint(network, str(ckpt))

    result = run_cli("export", CONFIGS[model], "--ckpt", ckpt, "--batch-size", "2",
                     "--output", tmp_path / "out.mindir",
                     *[arg for override in overrides for arg in ("--set", override)])

    assert result.returncode == 0, result.stderr
    network.set_train(False)
    graphs = module.inference_graphs(config, network, 2)
    written = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert list(written) == list(graphs)
    rng = np.random.default_rng(0)
    for name, (cell, inputs) in graphs.items():
        inputs = with_random_tokens(inputs, rng, config.model.vocab_size)
        expected = flat(cell(*inputs))
        loaded = nn.GraphCell(ms.load(written[name]))
        got = flat(loaded(*flat(inputs)))
        assert len(got) == len(expected), name
        for mine, theirs in zip(got, expected):
            np.testing.assert_allclose(mine.asnumpy(), theirs.asnumpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{model} {name}")
