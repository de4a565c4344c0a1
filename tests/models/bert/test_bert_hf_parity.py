"""A converted Hugging Face BERT gives the same MLM/NSP logits and fill-mask ids as the original."""

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
from model_zoo.models.bert.convert import convert_hf_bert  # noqa: E402
from model_zoo.models.bert.fill_mask import fill_mask, format_fill_mask  # noqa: E402
from model_zoo.models.bert.model import BertForPreTraining, LogitsCell  # noqa: E402
from model_zoo.config import load_config  # noqa: E402
from model_zoo.errors import CheckpointError, DataError  # noqa: E402
from model_zoo.checkpoint.files import load_weights, read_checkpoint  # noqa: E402

SEQ, VOCAB = 32, 120
CLS, SEP, MASK = 101, 102, 103  # BERT's usual ids, which the converter assumes by default
TOLERANCE = 1e-4


def _hf_config():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQ, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _save_perturbed(model, path):
    # Hugging Face initialises biases to 0 and layer norms to (1, 0): perturb every
    # parameter so the test also checks how biases and norms are mapped.
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(path))
    return model


def _load(config_path, ckpt_path):
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = load_config(config_path)
    network = BertForPreTraining(config.model)
    load_weights(network, ckpt_path)
    network.set_train(False)
    return config, network


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf_bert")
    return path, _save_perturbed(transformers.BertForPreTraining(_hf_config()), path)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    path, model = hf_dir
    out = tmp_path_factory.mktemp("converted")
    notes = []
    config_path, ckpt_path = convert_hf_bert(str(path), str(out), log=notes.append)
    assert notes == []  # a BertForPreTraining has every head
    config, network = _load(config_path, ckpt_path)
    return config, network, LogitsCell(network), model, ckpt_path


def _batch(length, predictions=4, seed=0):
    """Two sequences of `length`; the second padded over its last third."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 100, size=(2, length)).astype(np.int32)
    ids[:, 0] = CLS
    real = [length, length - length // 3]
    mask = np.zeros((2, length), np.int32)
    types = np.zeros((2, length), np.int32)
    positions = np.zeros((2, predictions), np.int32)
    for row, n in enumerate(real):
        ids[row, n - 1] = SEP
        ids[row, n:] = 0
        mask[row, :n] = 1
        types[row, n // 2:n] = 1
        positions[row] = np.sort(rng.choice(np.arange(1, n - 1), predictions, replace=False))
        ids[row, positions[row, :2]] = MASK
    return ids, types, mask, positions


def _hf_logits(model, ids, types, mask):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64)),
                    token_type_ids=torch.from_numpy(types.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask.astype(np.int64)))
    nsp = out.seq_relationship_logits.numpy() if hasattr(out, "seq_relationship_logits") else None
    mlm = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    return mlm.numpy(), nsp


def test_config_matches(converted):
    model = converted[0].model
    assert (model.name, model.task, model.num_layers, model.hidden_size, model.num_heads,
            model.seq_length, model.vocab_size, model.ffn_hidden_size, model.type_vocab_size) \
        == ("bert", "pretrain", 2, 64, 4, SEQ, VOCAB, 128, 2)
    assert (model.pad_token_id, model.cls_token_id, model.sep_token_id,
            model.mask_token_id) == (0, CLS, SEP, MASK)
    assert model.dropout == 0.0 and model.attention_dropout == 0.0
    assert model.layer_norm_eps == pytest.approx(1e-12)
    assert converted[0].data.dataset_dir.startswith(os.path.dirname(converted[4]))


@pytest.mark.parametrize("length", [SEQ, 13])
def test_logits_match(converted, length):
    _, _, logits_cell, model, _ = converted
    ids, types, mask, positions = _batch(length)
    mlm, nsp = logits_cell(*(ms.Tensor(a) for a in (ids, types, mask, positions)))
    their_mlm, their_nsp = _hf_logits(model, ids, types, mask)
    expected = np.stack([their_mlm[row, positions[row]] for row in range(2)])
    mlm_diff = np.abs(mlm.asnumpy().reshape(expected.shape) - expected).max()
    nsp_diff = np.abs(nsp.asnumpy() - their_nsp).max()
    print(f"length {length}: max |MLM logit difference| {mlm_diff:.3e}, "
          f"max |NSP logit difference| {nsp_diff:.3e}")
    assert mlm_diff < TOLERANCE and nsp_diff < TOLERANCE


def test_fill_mask_matches_argmax(converted):
    _, network, _, model, _ = converted
    ids = [CLS, 7, 45, MASK, 12, 88, MASK, 3, 60, MASK, SEP]
    results = fill_mask(network, ids, mask_id=MASK, top_k=3, seq_length=SEQ)
    theirs, _ = _hf_logits(model, np.array([ids]), np.zeros((1, len(ids)), np.int32),
                           np.ones((1, len(ids)), np.int32))
    assert [position for position, _ in results] == [3, 6, 9]
    for position, best in results:
        assert len(best) == 3
        assert best[0] == int(np.argmax(theirs[0, position]))
    text = format_fill_mask(results)
    assert text.splitlines()[0].startswith("mask 3: ")
    with pytest.raises(ValueError, match="no mask id"):
        fill_mask(network, [CLS, 5, SEP], mask_id=MASK, seq_length=SEQ)


def test_masked_lm_folder(tmp_path):
    torch.manual_seed(1)
    model = _save_perturbed(transformers.BertForMaskedLM(_hf_config()), tmp_path / "hf")
    notes = []
    config_path, ckpt_path = convert_hf_bert(str(tmp_path / "hf"), str(tmp_path / "out"),
                                             log=notes.append)
    assert len(notes) == 2
    assert "pooler" in notes[0] and "next-sentence head" in notes[1]
    assert all("initialisation" in note for note in notes)
    _, network = _load(config_path, ckpt_path)
    ids, types, mask, positions = _batch(SEQ, seed=3)
    mlm, _ = LogitsCell(network)(*(ms.Tensor(a) for a in (ids, types, mask, positions)))
    theirs, _ = _hf_logits(model, ids, types, mask)
    expected = np.stack([theirs[row, positions[row]] for row in range(2)])
    diff = np.abs(mlm.asnumpy().reshape(expected.shape) - expected).max()
    print(f"BertForMaskedLM: max |MLM logit difference| {diff:.3e}")
    assert diff < TOLERANCE


def test_bin_weights_without_prefix_convert_identically(hf_dir, converted, tmp_path):
    path, model = hf_dir
    source = tmp_path / "bin"
    source.mkdir()
    (source / "config.json").write_text((path / "config.json").read_text())
    state = {(key[len("bert."):] if key.startswith("bert.") else key): value
             for key, value in model.state_dict().items()}
    assert "cls.predictions.decoder.weight" in state  # tied, stored here, must be accepted
    torch.save(state, str(source / "pytorch_model.bin"))
    _, ckpt = convert_hf_bert(str(source), str(tmp_path / "out"))
    expected, got = read_checkpoint(converted[4]), read_checkpoint(ckpt)
    assert sorted(expected) == sorted(got)
    for name in expected:
        np.testing.assert_array_equal(expected[name].asnumpy(), got[name].asnumpy())


def test_refuses_to_overwrite(hf_dir, tmp_path):
    path, _ = hf_dir
    convert_hf_bert(str(path), str(tmp_path))
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf_bert(str(path), str(tmp_path))
    convert_hf_bert(str(path), str(tmp_path), overwrite=True)


def test_not_a_bert_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DataError, match="config.json.*not a BERT config"):
        convert_hf_bert(str(tmp_path), str(tmp_path / "out"))


@pytest.mark.parametrize("key, value", [("position_embedding_type", "relative_key"),
                                        ("hidden_act", "relu"), ("is_decoder", True)])
def test_unsupported_option(tmp_path, key, value):
    _hf_config().save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=f"config.json.*{key}"):
        convert_hf_bert(str(tmp_path), str(tmp_path / "out"))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        convert_hf_bert(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    with pytest.raises(DataError, match="config.json"):
        convert_hf_bert(str(tmp_path), str(tmp_path / "out"))


def test_missing_weight_file(tmp_path):
    _hf_config().save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="no weight file"):
        convert_hf_bert(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_tensor(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    path, _ = hf_dir
    tensors = load_file(str(path / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("layer.1.intermediate.dense.bias"))
    del tensors[key]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"bert\.encoder\.layer\.1\.intermediate\.dense\.bias"):
        convert_hf_bert(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "model.ckpt").exists()


def test_to_hf_loads_in_transformers_and_converts_back_bit_identical(converted, tmp_path):
    """Ours -> Hugging Face: transformers loads the BertForPreTraining folder and gives the
    original model's MLM and NSP logits exactly (same weights); converting it back gives our
    checkpoint bit for bit."""
    _, _, _, original, ckpt = converted
    out = tmp_path / "hf"
    result = run_cli("convert", "bert", "--to-hf", "--config",
                     os.path.join(os.path.dirname(ckpt), "config.yaml"), "--ckpt", ckpt,
                     "--output-dir", out)
    assert result.returncode == 0, result.stderr
    exported = transformers.BertForPreTraining.from_pretrained(str(out)).eval()
    ids, types, mask, _ = _batch(SEQ)
    for theirs, reference in zip(_hf_logits(exported, ids, types, mask),
                                 _hf_logits(original, ids, types, mask)):
        np.testing.assert_array_equal(theirs, reference)

    _, back = convert_hf_bert(str(out), str(tmp_path / "back"), log=None)
    first, second = read_checkpoint(ckpt), read_checkpoint(back)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name].asnumpy(), second[name].asnumpy(), name)
