"""MindRecord files: atomic writing, packing token streams into samples, and training pipelines."""

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import mindspore.dataset as ms_dataset
from mindspore.mindrecord import FileWriter

from model_zoo.errors import DataError

ROWS_PER_WRITE = 4096
WRITER_PAGE_BYTES = 32 * 2 ** 20   # FileWriter's default page (shard_writer: 32 MB)


def index_path(path):
    """The `.db` index that FileWriter writes next to a MindRecord data file."""
    return Path(f"{path}.db")


def write_mindrecord(path, schema, rows, *, description, overwrite=False):
    """Write `rows` (dicts matching `schema`) as a single-shard MindRecord file and its index.

    The index stores the data file's name, so both files are written under their final names
    in a temporary directory next to `path` and moved into place only after commit succeeds.
    FileWriter drops rows that do not match the schema (e.g. int64 arrays for an int32 field)
    with only a log warning (removing them from the list it is given), so the written count
    is checked. Returns the number of rows written.
    """
    path = Path(path)
    if not overwrite and (path.exists() or index_path(path).exists()):
        raise DataError(f"{path} already exists; delete it or choose another output path")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as staging:
        staged = Path(staging, path.name)
        writer = FileWriter(str(staged), shard_num=1, overwrite=False)
        writer.add_schema(schema, description)
        rows = iter(rows)
        row_count = 0
        while chunk := list(itertools.islice(rows, ROWS_PER_WRITE)):
            first_row, row_count = row_count, row_count + len(chunk)
            try:
                writer.write_raw_data(chunk)
            except RuntimeError:
                # FileWriter says the same for a full disk as for rows of another schema
                free = shutil.disk_usage(staging).free
                needed = sum(getattr(value, "nbytes", 0) for row in chunk
                             for value in row.values())
                if free < needed + WRITER_PAGE_BYTES:
                    raise DataError(f"{path}: no space left to write rows {first_row}.."
                                    f"{row_count - 1} ({free / 2**20:.1f} MB free on its "
                                    f"disk); free some space and run again: the build "
                                    f"resumes") from None
                raise DataError(f"{path}: none of rows {first_row}..{row_count - 1} match the "
                                f"schema {schema}") from None
        writer.commit()
        written = count_samples(staged)
        if written != row_count:
            raise DataError(f"{path}: only {written} of {row_count} rows match the schema {schema}")
        os.replace(index_path(staged), index_path(path))
        os.replace(staged, path)
    return row_count


def write_mindrecord_unless_empty(path, schema, rows, *, description) -> int:
    """`write_mindrecord` (replacing `path`) unless `rows` is empty; the rows written."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return 0
    return write_mindrecord(path, schema, itertools.chain([first], rows),
                            description=description, overwrite=True)


def pack_token_stream(documents_ids, length, eos_id):
    """Concatenate documents' token ids, each followed by `eos_id`, into rows of `length` tokens.

    Returns an int32 array of shape (N, length); the tail shorter than `length` is dropped.
    GPT-2 packs with length = seq_length + 1 so that inputs and labels are shifted views.
    """
    return TokenPacker(length, eos_id).add(documents_ids)


class TokenPacker:
    """Packs documents' token ids, each followed by `eos_id`, into rows of `length` tokens as
    they come; what is left at the end (fewer than `length` tokens) is dropped."""

    def __init__(self, length: int, eos_id: int):
        if length < 1:
            raise DataError(f"packing length must be positive, got {length}")
        self.length, self.eos_id = length, eos_id
        self.tail = np.empty(0, dtype=np.int32)
        self.tokens = 0

    def add(self, documents_ids) -> np.ndarray:
        """The rows (N, length) that the tail and these documents complete."""
        parts = [self.tail]
        for ids in documents_ids:
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.array([self.eos_id], dtype=np.int32))
            self.tokens += len(ids) + 1
        stream = np.concatenate(parts)
        rows = len(stream) // self.length
        self.tail = stream[rows * self.length:]
        return stream[:rows * self.length].reshape(rows, self.length)

    @property
    def dropped(self) -> int:
        return len(self.tail)



def create_dataset(path, columns, batch_size, *, num_shards=1, shard_id=0, shuffle=True, seed=1,
                   skip_batches=0, repeat=True, drop_remainder=True):
    """A batched MindDataset over this shard's samples of a MindRecord file (or a list of
    them, read as one dataset: a sharded build's files).

    Shuffling is deterministic and differs every epoch. It follows MindSpore's dataset seed
    when an iterator is created, which this sets to `seed`: a later `mindspore.set_seed` or
    `mindspore.dataset.config.set_seed` before iterating changes the order. Batches drop the
    remainder; `skip_batches` skips that many batches of the (repeated) stream, which resumes
    training at its data position with the same batches an uninterrupted run would see.
    Evaluation passes drop_remainder=False to read every sample once.
    """
    paths = _paths(path)
    path = paths[0] if len(paths) == 1 else paths[0].parent / f"{paths[0].name} ..."
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise DataError(f"shard_id={shard_id} is not in [0, num_shards={num_shards})")
    if skip_batches < 0:
        raise DataError(f"skip_batches must not be negative, got {skip_batches}")
    for file in paths:
        _check_columns(file, columns)

    sharding = {"num_shards": num_shards, "shard_id": shard_id} if num_shards > 1 else {}
    ms_dataset.config.set_seed(seed)
    dataset = ms_dataset.MindDataset([str(file) for file in paths], columns_list=list(columns),
                                     shuffle=shuffle, **sharding)
    samples_per_shard = dataset.get_dataset_size()
    if drop_remainder and samples_per_shard < batch_size:
        raise DataError(f"{path}: {count_samples(paths)} samples over {num_shards} shard(s) give "
                        f"{samples_per_shard} per shard, fewer than one batch of {batch_size}")
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    if repeat:
        dataset = dataset.repeat()
    if skip_batches:
        dataset = dataset.skip(skip_batches)
    return dataset


def read_mindrecord(path, columns=None):
    """All rows of a MindRecord file in file order, as a list of dicts of numpy values.

    `columns` (default: all) selects the columns read; DataError if one is missing.
    """
    path = Path(path)
    _check_readable(path)
    columns = _check_columns(path, columns)
    dataset = ms_dataset.MindDataset(str(path), columns_list=columns, shuffle=False,
                                     num_parallel_workers=1)
    return list(dataset.create_dict_iterator(output_numpy=True, num_epochs=1))


def count_samples(path):
    """Number of samples in a MindRecord file, or in a list of them."""
    return sum(_open(file).get_dataset_size() for file in _paths(path))


def _paths(path) -> list:
    """The readable MindRecord files of a path or a list of paths; DataError otherwise."""
    paths = [Path(file) for file in (path if isinstance(path, (list, tuple)) else [path])]
    if not paths:
        raise DataError("no MindRecord files given")
    for file in paths:
        _check_readable(file)
    return paths


def _check_columns(path: Path, columns):
    """The columns asked for (default: all of the file's); DataError naming a missing one."""
    available = _open(path).get_col_names()
    columns = list(columns) if columns is not None else list(available)
    missing = [column for column in columns if column not in available]
    if missing:
        raise DataError(f"{path}: has no column {', '.join(missing)} "
                        f"(columns: {', '.join(available)})")
    return columns


def _check_readable(path):
    if not path.is_file():
        raise DataError(f"{path}: MindRecord file not found")
    if not index_path(path).is_file():
        raise DataError(f"{index_path(path)}: index of the MindRecord file {path} not found")


def _open(path):
    """An unshuffled MindDataset of the whole file; DataError if MindSpore cannot read it."""
    try:
        dataset = ms_dataset.MindDataset(str(path), shuffle=False)
        dataset.get_dataset_size()
    except (RuntimeError, ValueError) as error:
        raise DataError(f"{path}: not a readable MindRecord file "
                        f"({_first_error_line(error)})") from None
    return dataset


def _first_error_line(error):
    """The informative line of a MindSpore error, which wraps it in a banner and a call stack."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reported = [line for line in lines if line.startswith("[ERROR]")]
    return (reported or lines or [type(error).__name__])[0]
