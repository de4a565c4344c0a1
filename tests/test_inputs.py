"""What the generation and translation commands read from the user: text files that are
not UTF-8 and beam sizes that are not beams are one clear error before any model loads."""

import argparse

import pytest

from model_zoo.config import load_config
from model_zoo.errors import UserInputError
from model_zoo.files import read_text_lines
from model_zoo.causal_lm.tasks import read_prompts
from model_zoo.models.transformer.tasks import run_translate

TRANSFORMER_TINY = "model_zoo/models/transformer/configs/tiny.yaml"


def latin1_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("Grüße aus Köln\n".encode("latin-1"))
    return str(path)


def test_a_file_that_is_not_utf8_names_the_flag_and_the_byte(tmp_path):
    path = latin1_file(tmp_path)
    with pytest.raises(UserInputError, match=r"--input .*prompts.txt' is not UTF-8 text: "
                                             r"byte 2 is b'\\xfc'"):
        read_text_lines(path, "--input")
    (tmp_path / "good.txt").write_text("one\ntwo\n", encoding="utf-8")
    assert read_text_lines(str(tmp_path / "good.txt"), "--input") == ["one", "two"]


def test_generate_refuses_a_latin1_prompt_file(tmp_path):
    args = argparse.Namespace(input=latin1_file(tmp_path), prompt_ids_file=None,
                              prompt_ids=None, prompt=None)
    with pytest.raises(UserInputError, match="not UTF-8 text"):
        read_prompts(args, tokenizer=None, vocab_size=100, dataset_dir=str(tmp_path))


@pytest.mark.parametrize("beam", [0, -2])
def test_translate_refuses_a_beam_of_no_hypothesis_before_loading(beam, tmp_path):
    config = load_config(TRANSFORMER_TINY)
    args = argparse.Namespace(beam=beam, input=latin1_file(tmp_path))
    with pytest.raises(UserInputError, match=f"--beam {beam}: a beam holds at least 1"):
        run_translate(config, str(tmp_path / "no.ckpt"), args)
