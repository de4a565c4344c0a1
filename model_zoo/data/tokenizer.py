"""Tokenizers: SentencePiece (trained from documents in memory, a `.model` file) and the
Hugging Face tokenizers of imported models (`tokenizer.json`, read by the `tokenizers`
library), behind one interface (encode, decode, vocab_size and the special ids)."""

import io
import json
import re
import shutil
from pathlib import Path

import sentencepiece

from model_zoo.errors import DataError, UserInputError
from model_zoo.files import write_atomically

TOKENIZER_FILE = "tokenizer.model"  # its name in every dataset directory
HF_TOKENIZER_FILE = "tokenizer.json"  # an imported Hugging Face tokenizer, instead of it
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NEWLINE = "\n"
MAX_LINE_BYTES = 1 << 16
VOCAB_TOO_HIGH = re.compile(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)")


class Tokenizer:
    """A trained SentencePiece model that turns text into token ids and back."""

    def __init__(self, model_path):
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"{self.model_path}: tokenizer model not found")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(self.model_path))
        except (RuntimeError, OSError) as error:
            raise DataError(f"{self.model_path}: not a readable SentencePiece model "
                            f"({error})") from None

    def encode(self, text):
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts):
        """The ids of each text, on this thread (a worker process is one core's work)."""
        return self._processor.encode(list(texts), out_type=int, num_threads=1)

    def decode(self, ids):
        return self._processor.decode([int(token_id) for token_id in ids])

    def id_to_piece(self, token_id):
        return self._processor.id_to_piece(int(token_id))

    @property
    def vocab_size(self):
        return self._processor.get_piece_size()

    @property
    def pad_id(self):
        return self._processor.pad_id()

    @property
    def unk_id(self):
        return self._processor.unk_id()

    @property
    def bos_id(self):
        return self._processor.bos_id()

    @property
    def eos_id(self):
        return self._processor.eos_id()


class HFTokenizer:
    """A Hugging Face tokenizer (`tokenizer.json`) with Tokenizer's interface. `encode` adds
    no special tokens ([CLS], [SEP]): the models' own code places them, as with
    SentencePiece."""

    # the names special tokens go by in GPT-2's and BERT's vocabularies
    SPECIAL = {"pad": ("[PAD]", "<pad>"), "unk": ("[UNK]", "<unk>"),
               "bos": ("<|endoftext|>", "<s>", "[CLS]"),
               "eos": ("<|endoftext|>", "</s>", "[SEP]"), "mask": ("[MASK]", "<mask>")}

    def __init__(self, path):
        import tokenizers
        self.model_path = Path(path)
        if not self.model_path.is_file():
            raise DataError(f"{self.model_path}: tokenizer file not found")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.model_path))
        except Exception as error:   # the library raises its own exception type
            raise DataError(f"{self.model_path}: not a readable Hugging Face tokenizer "
                            f"({error})") from None

    def encode(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        """The ids of each text, one at a time: the library's own batches would use every
        core in each worker process."""
        return [self.encode(text) for text in texts]

    def decode(self, ids):
        return self._tokenizer.decode([int(token_id) for token_id in ids],
                                      skip_special_tokens=False)

    def id_to_piece(self, token_id):
        return self._tokenizer.id_to_token(int(token_id))

    @property
    def vocab_size(self):
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def special_id(self, kind: str):
        """The id of the `kind` special token (pad, unk, bos, eos, mask), or -1 (as
        SentencePiece says of an id it does not have)."""
        for token in self.SPECIAL[kind]:
            found = self._tokenizer.token_to_id(token)
            if found is not None:
                return found
        return -1

    pad_id = property(lambda self: self.special_id("pad"))
    unk_id = property(lambda self: self.special_id("unk"))
    bos_id = property(lambda self: self.special_id("bos"))
    eos_id = property(lambda self: self.special_id("eos"))


def load_tokenizer_file(path):
    """The tokenizer in `path`: a Hugging Face tokenizer for a .json file, else SentencePiece."""
    return HFTokenizer(path) if str(path).endswith(".json") else Tokenizer(path)


def load_tokenizer(directory):
    """The tokenizer of a dataset directory: the one its dataset.json names (the dataset was
    tokenized with it), else its imported Hugging Face `tokenizer.json`, else its
    SentencePiece `tokenizer.model`, else None."""
    directory = Path(directory)
    try:
        named = json.loads((directory / "dataset.json").read_text(encoding="utf-8"))["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        named = None
    if named == TOKENIZER_FILE and (directory / TOKENIZER_FILE).is_file():
        return Tokenizer(directory / TOKENIZER_FILE)
    if (directory / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer(directory / HF_TOKENIZER_FILE)
    if (directory / TOKENIZER_FILE).is_file():
        return Tokenizer(directory / TOKENIZER_FILE)
    return None


def import_hf_tokenizer(hf_dir, output_dir) -> Path:
    """Write the tokenizer of a Hugging Face model folder as `output_dir/tokenizer.json`: its
    own `tokenizer.json`, else one built by the `tokenizers` library from GPT-2's
    `vocab.json` + `merges.txt` (byte-level BPE, as GPT2TokenizerFast) or BERT's `vocab.txt`
    (WordPiece, lower-cased unless tokenizer_config.json says do_lower_case false). Returns
    the path; DataError when the folder has none of these files."""
    from tokenizers import AddedToken, Tokenizer as Built, decoders, models, pre_tokenizers
    from tokenizers.implementations import BertWordPieceTokenizer
    hf_dir, output_dir = Path(hf_dir), Path(output_dir)
    target = output_dir / HF_TOKENIZER_FILE
    output_dir.mkdir(parents=True, exist_ok=True)
    if (hf_dir / HF_TOKENIZER_FILE).is_file():
        HFTokenizer(hf_dir / HF_TOKENIZER_FILE)         # readable, or DataError
        _copy_unless_same(hf_dir / HF_TOKENIZER_FILE, target)
        return target
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        built = Built(models.BPE.from_file(str(hf_dir / "vocab.json"),
                                           str(hf_dir / "merges.txt")))
        built.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        built.decoder = decoders.ByteLevel()
        if built.token_to_id("<|endoftext|>") is not None:
            built.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    elif (hf_dir / "vocab.txt").is_file():
        settings = hf_dir / "tokenizer_config.json"
        lowercase = True
        if settings.is_file():
            lowercase = bool(json.loads(settings.read_text(encoding="utf-8"))
                             .get("do_lower_case", True))
        built = BertWordPieceTokenizer(str(hf_dir / "vocab.txt"), lowercase=lowercase)
    else:
        raise DataError(f"{hf_dir}: no tokenizer.json, vocab.json + merges.txt or vocab.txt")
    built.save(str(target))
    return target


def tokenizer_from_flag(value: str):
    """The tokenizer `--tokenizer` names: `hf:DIR` (a Hugging Face model or tokenizer
    folder) or the path of a SentencePiece model; DataError naming the flag otherwise."""
    if value.startswith("hf:"):
        folder = Path(value[3:])
        if not folder.is_dir():
            raise DataError(f"--tokenizer {value}: {folder} is not a folder")
        return folder
    if not Path(value).is_file():
        raise DataError(f"--tokenizer {value}: no such file (give a SentencePiece .model, or "
                        f"hf:DIR for a Hugging Face tokenizer folder)")
    Tokenizer(value)
    return Path(value)


def install_tokenizer(source: Path, output_dir):
    """Put the tokenizer `tokenizer_from_flag` found into a dataset directory (as
    tokenizer.json or tokenizer.model) and return it loaded."""
    output_dir = Path(output_dir)
    if source.is_dir():
        return HFTokenizer(import_hf_tokenizer(source, output_dir))
    output_dir.mkdir(parents=True, exist_ok=True)
    _copy_unless_same(source, output_dir / TOKENIZER_FILE)
    return Tokenizer(output_dir / TOKENIZER_FILE)


def _copy_unless_same(source: Path, target: Path):
    """Copy a tokenizer file into a dataset folder, unless it is already that file (a
    dataset built in the folder its tokenizer came from)."""
    if not target.exists() or not target.samefile(source):
        shutil.copyfile(source, target)


def train_tokenizer(documents, model_path, vocab_size, *, model_type="bpe",
                    user_defined_symbols=(), character_coverage=1.0, word_boundaries=False,
                    sentences: int = 0, seed: int = 1):
    """Train a SentencePiece model of exactly `vocab_size` pieces and write it to `model_path`.

    Documents are fed line by line. By default (GPT-2) the newline is a piece of its own, and
    text is neither normalized nor stripped of spaces, so decode(encode(text)) gives back any
    text made of characters seen in training. Ids: pad=0, unk=1, bos=2, eos=3, the newline 4,
    then the `user_defined_symbols` in the order given.

    A piece that follows a space starts with SentencePiece's word-boundary marker "▁", but
    the first word of a text or line has none, so word boundaries cannot be read off the
    pieces. `word_boundaries=True` selects SentencePiece's usual settings instead: NFKC
    normalization in which newlines and tabs are spaces, runs of spaces collapsed, and a
    dummy "▁" before the text, so the first piece of every word starts with "▁" (whole-word
    masking relies on it). There is no newline piece then: the `user_defined_symbols` take
    ids 4, 5, ... and decode gives back the text with its whitespace normalized.

    `documents` may be a stream of any length: with `sentences` > 0 SentencePiece keeps a
    uniform sample of that many lines (reservoir sampling, seeded with `seed`), so memory
    does not grow with the corpus; 0 trains on every line.

    Training is single-threaded and the model is serialized in memory (a model records its
    file prefix, so training into a temporary prefix would make every file differ): equal
    inputs give byte-identical files. `model_path` is replaced atomically.
    """
    if word_boundaries:
        symbols = list(dict.fromkeys(user_defined_symbols))
        whitespace = {"normalization_rule_name": "nmt_nfkc", "remove_extra_whitespaces": True,
                      "add_dummy_prefix": True}
    else:
        symbols = [NEWLINE] + [symbol for symbol in user_defined_symbols if symbol != NEWLINE]
        whitespace = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False,
                      "add_dummy_prefix": False}
    smallest_vocab = 4 + len(symbols) + 1
    if vocab_size < smallest_vocab:
        raise DataError(f"vocab_size={vocab_size} is too small: need at least {smallest_vocab} "
                        f"(4 special ids, {len(symbols)} user symbols and one character)")
    model = io.BytesIO()
    lines = _TrainingLines(documents)
    sentencepiece.set_random_generator_seed(seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            user_defined_symbols=symbols,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            **whitespace,
            max_sentence_length=MAX_LINE_BYTES,
            num_threads=1,
            minloglevel=2,
            input_sentence_size=sentences,
            shuffle_input_sentence=True,
        )
    except RuntimeError as error:
        if lines.count == 0:
            raise DataError("no text to train the tokenizer on") from None
        raise _training_error(error, vocab_size) from None
    trained = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    trained_size = trained.get_piece_size()
    if trained_size != vocab_size:
        raise DataError(f"tokenizer training produced {trained_size} pieces instead of "
                        f"vocab_size={vocab_size} (model_type={model_type!r}); "
                        f"use model_type 'bpe' or 'unigram', or vocab_size={trained_size}")
    write_atomically(model_path, model.getvalue())
    return Tokenizer(model_path)


class _TrainingLines:
    """The non-blank lines of documents, counted as SentencePiece reads them."""

    def __init__(self, documents):
        self.documents, self.count = documents, 0

    def __iter__(self):
        for document in self.documents:
            for line in document.split(NEWLINE):
                if line.strip():
                    self.count += 1
                    yield line


def _training_error(error, vocab_size):
    too_high = VOCAB_TOO_HIGH.search(str(error))
    if too_high:
        return DataError(f"the corpus is too small for vocab_size={vocab_size}: it supports "
                         f"at most {too_high.group(1)} pieces; use a smaller vocab_size "
                         f"or more text")
    return DataError(f"tokenizer training failed: {error}")


def parse_token_ids(text: str, flag: str, vocab_size: int) -> list:
    """Token ids typed on the command line ("1 2 3" or "1,2,3"), each checked against the
    vocabulary; UserInputError naming `flag` otherwise."""
    try:
        ids = [int(token) for token in text.replace(",", " ").split()]
    except ValueError:
        raise UserInputError(f"{flag} {text!r}: give integers separated by spaces") from None
    bad = [token for token in ids if not 0 <= token < vocab_size]
    if bad:
        raise UserInputError(f"{flag}: id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids

