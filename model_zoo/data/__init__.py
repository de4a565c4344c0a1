"""Data pipeline shared by the models: text corpora, SentencePiece tokenizers, MindRecord files,
dataset.json manifests."""

from model_zoo.data.buckets import (
    DEFAULT_BUCKETS,
    BucketedBatches,
    assign_buckets,
    bucket_boundaries,
    bucket_counts,
    bucketed_dataset,
    global_batches,
    padding_ratio,
)
from model_zoo.data.corpus import (
    BUILTIN_PYTHON_DOCS,
    Docstring,
    load_documents,
    python_docstring_records,
    python_docstrings_corpus,
    read_text_documents,
    split_documents,
)
from model_zoo.data.manifest import (
    MANIFEST_FILE,
    check_built_with,
    check_files,
    check_no_dataset,
    check_positive,
    dataset_ready,
    read_manifest,
    split_path,
)
from model_zoo.data.mindrecord import (
    count_samples,
    create_dataset,
    pack_token_stream,
    read_mindrecord,
    write_mindrecord,
)
from model_zoo.data.tokenizer import Tokenizer, parse_token_ids, train_tokenizer

__all__ = [
    "BUILTIN_PYTHON_DOCS",
    "DEFAULT_BUCKETS",
    "MANIFEST_FILE",
    "BucketedBatches",
    "Docstring",
    "Tokenizer",
    "assign_buckets",
    "bucket_boundaries",
    "bucket_counts",
    "bucketed_dataset",
    "check_built_with",
    "check_files",
    "check_no_dataset",
    "check_positive",
    "count_samples",
    "create_dataset",
    "dataset_ready",
    "global_batches",
    "load_documents",
    "pack_token_stream",
    "padding_ratio",
    "parse_token_ids",
    "python_docstring_records",
    "python_docstrings_corpus",
    "read_manifest",
    "read_mindrecord",
    "read_text_documents",
    "split_documents",
    "split_path",
    "train_tokenizer",
    "write_mindrecord",
]
