"""Imported Hugging Face tokenizers against `transformers`' own (Python) tokenizers, and
their use: `convert` imports them, `generate --prompt` and `data gpt2 --tokenizer hf:DIR`
read them."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_v", "3")

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from tokenizers import ByteLevelBPETokenizer  # noqa: E402
from tokenizers.implementations import BertWordPieceTokenizer  # noqa: E402

from conftest import run_cli  # noqa: E402
from model_zoo.data import HFTokenizer, load_tokenizer  # noqa: E402
from model_zoo.data.tokenizer import import_hf_tokenizer  # noqa: E402
from model_zoo.errors import DataError  # noqa: E402

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 3.14 o'clock, isn't it?",
    "Héllo wörld! Naïve café façade — «quoted» text, and émigré coöperation.",
    "def main():\n    return {'key': [1, 2, 3]}  # a comment\n\tindented with a tab",
    "Unicode: 中文字符, русский текст, Ελληνικά, emoji 😀🚀 and symbols ©®™ ±×÷.",
] * 20
# mixed text: unicode, runs of spaces, tabs, newlines, punctuation, digits, an unseen script
PARAGRAPH = ("  Héllo wörld!!  The   quick\tbrown fox's \"naïve\" café — costs $1,234.56?\n"
             "Newlines\n\nand  中文字符 mixed with русский; emoji 😀 (ok) [x] {y} <z> "
             "עברית unseen, don't stop... end.")


@pytest.fixture(scope="module")
def gpt2_vocab(tmp_path_factory):
    """A small byte-level BPE saved as GPT-2 saves its tokenizer: vocab.json + merges.txt."""
    folder = tmp_path_factory.mktemp("gpt2_tokenizer")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(TRAINING_TEXT, vocab_size=400, min_frequency=2,
                                special_tokens=["<|endoftext|>"])
    trainer.save_model(str(folder))
    return folder


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_tokenizer")
    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(TRAINING_TEXT, vocab_size=300, min_frequency=2)
    trainer.save_model(str(folder))
    return folder


def test_gpt2_ids_equal_transformers(gpt2_vocab, tmp_path):
    mine = HFTokenizer(import_hf_tokenizer(gpt2_vocab, tmp_path))
    theirs = transformers.GPT2Tokenizer(str(gpt2_vocab / "vocab.json"),
                                        str(gpt2_vocab / "merges.txt"))
    for text in (PARAGRAPH, PARAGRAPH + "<|endoftext|>Next document", " leading space"):
        ids = mine.encode(text)
        assert ids == theirs.encode(text), text
        assert mine.decode(ids) == theirs.decode(ids) == text   # byte-level: lossless
    assert mine.eos_id == theirs.convert_tokens_to_ids("<|endoftext|>")
    assert mine.vocab_size == len(theirs)


def test_bert_ids_equal_transformers(bert_vocab, tmp_path):
    mine = HFTokenizer(import_hf_tokenizer(bert_vocab, tmp_path))
    theirs = transformers.BertTokenizer(str(bert_vocab / "vocab.txt"), do_lower_case=True)
    ids = mine.encode(PARAGRAPH)
    assert ids == theirs.encode(PARAGRAPH, add_special_tokens=False)
    assert mine.decode(ids).split() == theirs.decode(ids).split()
    assert (mine.pad_id, mine.unk_id, mine.special_id("mask")) == \
        tuple(theirs.convert_tokens_to_ids(t) for t in ("[PAD]", "[UNK]", "[MASK]"))


def test_a_cased_bert_keeps_its_case(bert_vocab, tmp_path):
    folder = tmp_path / "cased"
    folder.mkdir()
    (folder / "vocab.txt").write_bytes((bert_vocab / "vocab.txt").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    mine = HFTokenizer(import_hf_tokenizer(folder, tmp_path / "out"))
    theirs = transformers.BertTokenizer(str(folder / "vocab.txt"), do_lower_case=False)
    assert mine.encode(PARAGRAPH) == theirs.encode(PARAGRAPH, add_special_tokens=False)


def test_a_tokenizer_json_is_copied_and_preferred(gpt2_vocab, tmp_path):
    first = import_hf_tokenizer(gpt2_vocab, tmp_path / "a")
    again = import_hf_tokenizer(tmp_path / "a", tmp_path / "b")     # from its tokenizer.json
    assert again.read_bytes() == first.read_bytes()
    (tmp_path / "b" / "tokenizer.model").write_bytes(b"not used")
    assert isinstance(load_tokenizer(tmp_path / "b"), HFTokenizer)


def test_the_tokenizer_a_dataset_names_is_the_one_loaded(gpt2_vocab, tmp_path):
    import shutil
    import sentencepiece
    import_hf_tokenizer(gpt2_vocab, tmp_path)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT), model_prefix=str(tmp_path / "sp"),
        vocab_size=100, minloglevel=2)
    shutil.move(tmp_path / "sp.model", tmp_path / "tokenizer.model")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)
    (tmp_path / "dataset.json").write_text(json.dumps({"tokenizer": "tokenizer.model"}))
    assert not isinstance(load_tokenizer(tmp_path), HFTokenizer)
    assert load_tokenizer(tmp_path).vocab_size == 100


def test_folders_without_a_tokenizer_are_named(tmp_path):
    with pytest.raises(DataError, match="no tokenizer.json, vocab.json"):
        import_hf_tokenizer(tmp_path, tmp_path / "out")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="tokenizer.json: not a readable Hugging Face"):
        import_hf_tokenizer(tmp_path, tmp_path / "out")


@pytest.fixture(scope="module")
def converted_with_tokenizer(gpt2_vocab, tmp_path_factory):
    """A random Hugging Face GPT-2 over the small vocabulary, with its tokenizer files,
    converted by the CLI."""
    hf_dir = tmp_path_factory.mktemp("hf_gpt2_tok")
    vocab = len(json.loads((gpt2_vocab / "vocab.json").read_text(encoding="utf-8")))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64,
                                     vocab_size=vocab)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(hf_dir))
    for name in ("vocab.json", "merges.txt"):
        (hf_dir / name).write_bytes((gpt2_vocab / name).read_bytes())
    out = tmp_path_factory.mktemp("converted_tok")
    result = run_cli("convert", "gpt2", "--hf-dir", hf_dir, "--output-dir", out)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out / 'dataset' / 'tokenizer.json'}" in result.stdout
    return out, hf_dir


def test_generate_takes_text_prompts_on_a_converted_model(converted_with_tokenizer):
    out, hf_dir = converted_with_tokenizer
    result = run_cli("generate", out / "config.yaml", "--ckpt", out / "model.ckpt",
                     "--prompt", "The quick brown", "--max-new-tokens", "5", "--greedy")
    assert result.returncode == 0, result.stderr
    ids_line, text = result.stdout.strip().splitlines()
    new_ids = [int(i) for i in ids_line.split(":")[1].split()]
    # the same continuation as Hugging Face's greedy generate of the same prompt
    theirs = transformers.GPT2Tokenizer(str(hf_dir / "vocab.json"), str(hf_dir / "merges.txt"))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    prompt = torch.tensor([theirs.encode("The quick brown")])
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert new_ids == expected[0, prompt.shape[1]:].tolist()
    assert text == theirs.decode(expected[0].tolist())


def test_data_gpt2_tokenizes_with_the_imported_tokenizer(converted_with_tokenizer, tmp_path):
    out, _ = converted_with_tokenizer
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(TRAINING_TEXT), encoding="utf-8")
    dataset = tmp_path / "dataset"
    result = run_cli("data", "gpt2", "--input", corpus, "--output-dir", dataset,
                     "--seq-length", "16", "--tokenizer", f"hf:{out / 'dataset'}")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((dataset / "dataset.json").read_text())
    tokenizer = load_tokenizer(dataset)
    assert manifest["tokenizer"] == "tokenizer.json"
    assert manifest["vocab_size"] == tokenizer.vocab_size
    from model_zoo.data import read_mindrecord
    first = next(iter(read_mindrecord(dataset / "train.mindrecord")))["input_ids"].tolist()
    stream = []
    for document in TRAINING_TEXT:   # the documents in some order, each ended by eos
        stream += tokenizer.encode(document) + [tokenizer.eos_id]
    assert any(stream[i:i + 17] == first for i in range(len(stream) - 16))

    # into the folder the tokenizer came from (convert's dataset folder): no copy onto itself
    in_place = run_cli("data", "gpt2", "--input", corpus, "--output-dir", out / "dataset",
                       "--seq-length", "16", "--tokenizer", f"hf:{out / 'dataset'}")
    assert in_place.returncode == 0, in_place.stderr

    mismatch = run_cli("data", "gpt2", "--input", corpus, "--output-dir", tmp_path / "other",
                       "--seq-length", "16", "--tokenizer", f"hf:{out / 'dataset'}",
                       "--vocab-size", "999")
    assert mismatch.returncode != 0
    assert "--vocab-size 999 differs" in mismatch.stderr


def test_fill_mask_takes_text_on_a_converted_bert(bert_vocab, tmp_path):
    """A BERT vocab.txt laid out as Google's ([PAD] 0, [UNK] [CLS] [SEP] [MASK] 100-103),
    with a random BertForMaskedLM over it: the converted model's fill-mask of a text equals
    Hugging Face's top ids at the mask."""
    trained = (bert_vocab / "vocab.txt").read_text(encoding="utf-8").split("\n")
    special = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    vocab = (["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] +
             ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
             [token for token in trained if token and token not in special])
    hf_dir = tmp_path / "hf_bert"
    hf_dir.mkdir()
    (hf_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config).eval()
    model.save_pretrained(str(hf_dir))
    out = tmp_path / "converted"
    result = run_cli("convert", "bert", "--hf-dir", hf_dir, "--output-dir", out)
    assert result.returncode == 0, result.stderr

    text = "The quick [MASK] fox jumps, naïve café!"
    result = run_cli("fill-mask", out / "config.yaml", "--ckpt", out / "model.ckpt",
                     "--text", text, "--top-k", "3")
    assert result.returncode == 0, result.stderr
    position, ids = result.stdout.splitlines()[0].split(" -> ")[0].split(": ")
    theirs = transformers.BertTokenizer(str(hf_dir / "vocab.txt"))
    encoded = theirs(text, return_tensors="pt")
    mask_at = encoded["input_ids"][0].tolist().index(theirs.mask_token_id)
    assert position == f"mask {mask_at}"
    with torch.no_grad():
        logits = model(**encoded).logits[0, mask_at]
    assert [int(i) for i in ids.split()] == torch.topk(logits, 3).indices.tolist()
