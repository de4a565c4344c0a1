"""Length bucketing: fixed-shape batches of similar-length examples, the same on every rank.

Examples are grouped by the bucket they fit (the smallest boundary not below their length)
and each batch is padded to its bucket's boundary, so a GRAPH-mode network compiles once
per bucket and padding stays small.

Batches are scheduled per *global* step, for all ranks at once: a global batch of
`batch_size * num_shards` examples of one bucket is cut into `num_shards` consecutive slices
and rank `shard_id` reads slice `shard_id`. Every rank therefore feeds the same shape at the
same step (which model-parallel groups and the dataset strategy need), ranks read disjoint
examples, and together they read exactly the global batch that one rank would read with
`batch_size * num_shards`. The schedule of epoch `e` depends only on (seed, e), so skipping
`k` batches to resume costs nothing and gives the batches an uninterrupted run would see.
"""

import numpy as np
import mindspore.dataset as ms_dataset

from model_zoo.errors import DataError

DEFAULT_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128)


def bucket_boundaries(seq_length, boundaries=DEFAULT_BUCKETS):
    """The boundaries below `seq_length`, then `seq_length` itself: the padded lengths in use.

    >>> bucket_boundaries(40)
    (8, 16, 24, 32, 40)
    """
    if not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"seq_length must be a positive integer, got {seq_length!r}")
    if any(not isinstance(b, int) or b < 1 for b in boundaries):
        raise DataError(f"bucket boundaries must be positive integers, got {list(boundaries)}")
    return tuple(sorted({b for b in boundaries if b < seq_length} | {seq_length}))


def assign_buckets(lengths, boundaries):
    """For each length, the smallest boundary >= it (int32 array). DataError if one is too long."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.asarray(boundaries, dtype=np.int64)
    if lengths.size and lengths.max() > bounds[-1]:
        raise DataError(f"length {int(lengths.max())} exceeds the largest bucket {int(bounds[-1])}")
    return bounds[np.searchsorted(bounds, lengths, side="left")].astype(np.int32)


def padding_ratio(real_tokens, padded_tokens):
    """Padded tokens / total tokens once every example is padded: (padded - real) / padded."""
    return float(padded_tokens - real_tokens) / padded_tokens if padded_tokens else 0.0


def bucket_counts(buckets):
    """{bucket length: number of examples} in increasing bucket order."""
    values, counts = np.unique(np.asarray(buckets), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def global_batches(buckets, global_batch_size, *, seed=1, epoch=0, shuffle=True,
                   drop_remainder=True):
    """One epoch's global batches as a list of (bucket length, example indices).

    Each bucket's examples (permuted with (seed, epoch) when shuffling) are cut into chunks of
    `global_batch_size`; the chunks of all buckets are then put in a seeded random order (or
    bucket by bucket without shuffling). Remainders shorter than a global batch are dropped
    unless `drop_remainder` is False.
    """
    buckets = np.asarray(buckets)
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    chunks = []
    for bucket in np.unique(buckets):
        members = np.flatnonzero(buckets == bucket)
        if rng is not None:
            members = rng.permutation(members)
        stop = len(members) if not drop_remainder else (
            len(members) - len(members) % global_batch_size)
        for start in range(0, stop, global_batch_size):
            chunks.append((int(bucket), members[start:start + global_batch_size]))
    if rng is not None:
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
    return chunks


class BucketedBatches:
    """Iterable of this rank's batches, epoch after epoch: `read_batches(schedule)` yields
    the batches (tuples of arrays) of a `schedule`, the list of (bucket length, example
    indices) of this rank for the rest of an epoch.

    With `repeat` the stream is endless (epoch after epoch); `skip_batches` global steps are
    skipped without building them.
    """

    def __init__(self, buckets, read_batches, batch_size, *, num_shards=1, shard_id=0, seed=1,
                 shuffle=True, skip_batches=0, repeat=True, drop_remainder=True):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise DataError(f"shard_id={shard_id} is not in [0, num_shards={num_shards})")
        if skip_batches < 0:
            raise DataError(f"skip_batches must not be negative, got {skip_batches}")
        self.buckets = np.asarray(buckets)
        self.read_batches = read_batches
        self.batch_size = batch_size
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.seed = seed
        self.shuffle = shuffle
        self.skip_batches = skip_batches
        self.repeat = repeat
        self.drop_remainder = drop_remainder
        self.global_batch_size = batch_size * num_shards
        self.batches_per_epoch = len(self._epoch(0))
        if self.batches_per_epoch == 0:
            raise DataError(
                f"no bucket holds a global batch of {batch_size} x {num_shards} shard(s) = "
                f"{self.global_batch_size} examples (examples per bucket: "
                f"{bucket_counts(self.buckets)}); use a smaller batch or more data")

    def _epoch(self, epoch):
        return global_batches(self.buckets, self.global_batch_size, seed=self.seed, epoch=epoch,
                              shuffle=self.shuffle, drop_remainder=self.drop_remainder)

    def __iter__(self):
        epoch, position = divmod(self.skip_batches, self.batches_per_epoch)
        while self.repeat or epoch == 0:
            mine = slice(self.shard_id * self.batch_size, (self.shard_id + 1) * self.batch_size)
            schedule = [(bucket, members[mine]) for bucket, members
                        in self._epoch(epoch)[position:] if len(members[mine])]
            if schedule:
                yield from self.read_batches(schedule)
            epoch, position = epoch + 1, 0


def bucketed_dataset(batches, column_names):
    """A MindSpore dataset over a BucketedBatches (or any iterable of array tuples).

    One worker, no multiprocessing and no shuffling of its own: the order is the iterable's.
    An endless iterable makes an endless dataset; do not ask it for its size.
    """
    return ms_dataset.GeneratorDataset(batches, column_names=list(column_names), shuffle=False,
                                       num_parallel_workers=1, python_multiprocessing=False)
