"""Which devices hold the same slice of a parameter, and how a global norm counts each once.

In semi-auto parallel every device of a pipeline stage (S = dp x mp of them) holds, of each
parameter of its stage, the slice its strategy gives it: a parameter split (s_1, ..., s_n)
has prod(s) distinct slices, each held by r = S / prod(s) devices (its mirror group, over
which MindSpore all-reduces the slice's gradient). With the parallel optimizer a slice is
further cut on dimension 0 over z devices of that group (`optimizer_shard_size`), and each
of them keeps, and gets the gradient of, only its piece. After the backward pass a device
therefore holds a gradient piece that r / z devices hold too.

A global gradient norm summed over every device counts each piece r / z times, so each
device weights its local squared norm of a parameter by z / r (`norm_weights`) and by 0 for
parameters of other stages; one all-reduce of the weighted sum over all devices then gives
every device the true squared norm. This is PanGu-alpha's `GlobalNorm` (models repository,
`official/nlp/Pangu_alpha/src/utils.py`) with the weights derived from the layout instead of
from parameter names.

Device order (used by `device_piece`): the ranks of stage k are k S ... (k + 1) S - 1.
Every weight here is used by an operator whose device matrix covers the whole stage with dp
as its leading dimension (e.g. MatMul ((dp, 1), (mp, 1)): [dp, 1, mp]), so a slice's copies
are that leading coordinate: rank-in-stage q = (copy x s_1 + i_1) x s_2 + i_2 ... (an
operator with repeated calculation would put the repeats last instead, rule G5, unsure). With
the parallel optimizer the piece a device keeps is its position in the mirror group (the
copy index) divided among z. The norm weights do not depend on this order, only on counts.
"""

import math
from typing import Dict, List, Sequence

from model_zoo.parallel.config import ParallelConfig

# MindSpore shards a parameter with the parallel optimizer only from this size (its
# `parallel_optimizer_threshold`, 64 KB, AutoParallel.hsdp's `threshold`)
OPTIMIZER_SHARD_THRESHOLD = 64 * 1024


def split_of(param) -> tuple:
    """The parameter's split per dimension; a parameter no strategy touches is whole."""
    return tuple(param.split) if param.split else (1,) * len(param.shape)


def mirror_group_size(param, parallel: ParallelConfig) -> int:
    """r: devices of the stage that hold the same slice of `param`."""
    return max(1, parallel.devices_per_stage // math.prod(split_of(param)))


def optimizer_shard_size(param, parallel: ParallelConfig) -> int:
    """z: the devices a slice's weights, moments and gradient are divided among with the
    parallel optimizer (1 without it, for frozen parameters, and where MindSpore leaves a
    slice whole: dimension 0 of the slice not divisible by r, a parameter under the 64 KB
    threshold (MindSpore compares the whole parameter, in its own dtype, with it), or one
    marked `parallel_optimizer=False`).

    `param` needs shape, split, requires_grad and nbytes, and may have parallel_optimizer
    (a plan's ParamInfo)."""
    if not (parallel.optimizer_shard and param.requires_grad and param.shape
            and getattr(param, "parallel_optimizer", True)):
        return 1
    split = split_of(param)
    replicas = mirror_group_size(param, parallel)
    if replicas == 1:
        return 1
    dim0 = param.shape[0] // split[0]
    if dim0 % replicas or param.nbytes < OPTIMIZER_SHARD_THRESHOLD:
        return 1
    return replicas


def gradient_copies(param, parallel: ParallelConfig) -> int:
    """Devices that hold the same gradient piece of `param` after the backward pass: r / z."""
    return mirror_group_size(param, parallel) // optimizer_shard_size(param, parallel)


def stage_of_rank(rank: int, parallel: ParallelConfig) -> int:
    """The pipeline stage of a global rank (stages hold consecutive ranks)."""
    return rank // parallel.devices_per_stage


def norm_weights(params: Sequence, parallel: ParallelConfig, stage: int) -> List[float]:
    """Per parameter, the factor a device of `stage` applies to its local squared norm so
    that the sum over all devices is the full squared norm: 1 / gradient_copies for the
    parameters of its stage, 0 for the others (their gradients live on their own stage)."""
    return [1.0 / gradient_copies(p, parallel) if p.stage == stage else 0.0 for p in params]


def device_piece(param, parallel: ParallelConfig, rank: int):
    """The piece of `param` that global `rank` holds after the backward pass.

    Returns None for a rank of another stage, else a tuple of slices into the full tensor.
    """
    if stage_of_rank(rank, parallel) != param.stage:
        return None
    split = split_of(param)
    position = rank % parallel.devices_per_stage
    copies = mirror_group_size(param, parallel)
    coordinates = []
    for size in reversed(split):
        coordinates.append(position % size)
        position //= size
    coordinates.reverse()
    copy = position % copies
    z = optimizer_shard_size(param, parallel)
    pieces = []
    for axis, (length, size, index) in enumerate(zip(param.shape, split, coordinates)):
        step = length // size
        start, stop = index * step, (index + 1) * step
        if axis == 0 and z > 1:
            piece = step // z
            start, stop = start + (copy % z) * piece, start + (copy % z + 1) * piece
        pieces.append(slice(start, stop))
    return tuple(pieces)


def layouts_by_name(params: Dict[str, object], names: Sequence[str]) -> list:
    """The layouts of `names` (the optimizer's parameter order) from a plan recording's
    {name: ParamInfo}; a name the recording does not know is an error, not a silent 1."""
    missing = [name for name in names if name not in params]
    if missing:
        raise KeyError(f"no recorded layout for parameter(s) {', '.join(missing[:5])}")
    return [params[name] for name in names]
