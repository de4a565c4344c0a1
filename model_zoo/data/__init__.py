"""Data pipeline shared by the models: text corpora, SentencePiece tokenizers, MindRecord files."""

from model_zoo.data.corpus import python_docstrings_corpus, read_text_documents, split_documents
from model_zoo.data.mindrecord import (
    count_samples,
    create_dataset,
    pack_token_stream,
    write_mindrecord,
)
from model_zoo.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "Tokenizer",
    "count_samples",
    "create_dataset",
    "pack_token_stream",
    "python_docstrings_corpus",
    "read_text_documents",
    "split_documents",
    "train_tokenizer",
    "write_mindrecord",
]
