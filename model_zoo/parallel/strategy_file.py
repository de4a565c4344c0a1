"""Strategy files in MindSpore's own format, written offline from the plan's layouts.

A strategy file (the protobuf `ParallelStrategyMap` of `mindspore/train/node_strategy.proto`,
what `AutoParallel.save_param_strategy_file` writes on a cluster and `build_searched_strategy`
and `transform_checkpoints` read) describes, per parameter, how it is cut over the devices of
its pipeline stage:

- `dev_matrix`: the stage's devices as a grid, here [copies, s_a, s_b, ...]: the devices that
  hold the same slice first, then the parameter's split dimensions (`replication.py` orders
  the ranks of a stage the same way: rank-in-stage = copy x prod(s) + the slice's row-major
  index);
- `tensor_map`: for each tensor dimension, the grid axis that cuts it, counted from the
  right, or -1;
- `opt_weight_shard_size` / `opt_weight_shard_step`: with the parallel optimizer, the slice's
  dimension 0 is further cut over its copies (`optimizer_shard_size`), which sit
  prod(s) ranks apart.

With pipeline stages the file is in the merged form MindSpore's `merge_pipeline_strategys`
produces: each entry is named "<stage>-<parameter>". The optimizer's moments (and the
gradient accumulation buffers, without the optimizer shard) are laid out like their
parameters; scalars (step counters, loss scale) are not listed, and every rank keeps them
whole.
"""

import math
from typing import Dict, Iterable, List, Tuple

from model_zoo.parallel.config import ParallelConfig
from model_zoo.parallel.replication import mirror_group_size, optimizer_shard_size, split_of

STRATEGY_FILE = "strategy.ckpt"   # its name in a sliced checkpoint directory

# Train-step state named "<prefix>.<parameter>", laid out like the parameter
STATE_PREFIXES = ("adam_m", "adam_v", "accu_grads")


def parameter_layout(param, parallel: ParallelConfig) -> Tuple[List[int], List[int], int, int]:
    """(dev_matrix, tensor_map, opt_weight_shard_step, opt_weight_shard_size) of a plan
    ParamInfo in `parallel`'s layout."""
    split = split_of(param)
    sharded = [size for size in split if size > 1]
    dev_matrix = [mirror_group_size(param, parallel)] + sharded
    tensor_map, axis = [], len(sharded)
    for size in split:
        if size > 1:
            axis -= 1
            tensor_map.append(axis)
        else:
            tensor_map.append(-1)
    shard = optimizer_shard_size(param, parallel)
    return (dev_matrix, tensor_map, math.prod(sharded) if shard > 1 else 0,
            shard if shard > 1 else 0)


def entry_layout(name: str, param, parallel: ParallelConfig):
    """`parameter_layout` of checkpoint entry `name`, laid out like the plan ParamInfo
    `param` (the parameter itself or its training state)."""
    dev_matrix, tensor_map, shard_step, shard_size = parameter_layout(param, parallel)
    if name.startswith("accu_grads."):
        # AutoParallel.hsdp's default level1 shards weights and optimizer state, not the
        # accumulated gradients
        shard_step = shard_size = 0
    return dev_matrix, tensor_map, shard_step, shard_size


def laid_out_names(params: Dict[str, object], names: Iterable[str]) -> Dict[str, str]:
    """{checkpoint name: the parameter whose layout it has} for the names that are a
    parameter of `params` or its training state (`adam_m.<parameter>`)."""
    found = {}
    for name in names:
        prefix, _, rest = name.partition(".")
        if name in params:
            found[name] = name
        elif prefix in STATE_PREFIXES and rest in params:
            found[name] = rest
    return found


def training_state_names(params: Dict[str, object], parallel: ParallelConfig,
                         grad_accumulation: int = 1) -> List[str]:
    """The names a semi-auto train step's checkpoint holds for `params`: each parameter,
    the AdamW moments of the trainable ones and, with pipeline stages or accumulation, their
    gradient buffers (as `TrainStep` names them)."""
    buffers = parallel.pipeline_stage > 1 or grad_accumulation > 1
    names = []
    for name, param in params.items():
        names.append(name)
        if param.requires_grad:
            names += [f"adam_m.{name}", f"adam_v.{name}"]
            names += [f"accu_grads.{name}"] if buffers else []
    return names


def strategy_map(params: Dict[str, object], parallel: ParallelConfig, names: Iterable[str]):
    """The ParallelStrategyMap protobuf of `names` (checkpoint names) in `parallel`'s layout;
    `params` are the plan's ParamInfo by name."""
    from mindspore.train import node_strategy_pb2
    strategy = node_strategy_pb2.ParallelStrategyMap()
    strategy.current_stage = 1 if parallel.pipeline_stage > 1 else 0
    for stage in range(parallel.pipeline_stage):
        item = strategy.parallel_strategy_item.add()
        item.node_name = f"stage_{stage}"
        item.parallel_strategys.stage = stage
    for name, base in laid_out_names(params, names).items():
        param = params[base]
        dev_matrix, tensor_map, shard_step, shard_size = entry_layout(name, param, parallel)
        stages = sorted({param.stage} | set(param.used_on_stages))
        for stage in stages:
            item = strategy.parallel_layout_item.add()
            item.param_name = f"{stage}-{name}" if parallel.pipeline_stage > 1 else name
            layout = item.parallel_layouts
            layout.dev_matrix.add().dim.extend(dev_matrix)
            layout.tensor_map.add().dim.extend(tensor_map)
            layout.param_split_shape.add()
            layout.indices_offset.add()
            layout.field = 0
            layout.opt_weight_shard_step = shard_step
            layout.opt_weight_shard_size = shard_size
    return strategy


def write_strategy_file(path: str, params: Dict[str, object], parallel: ParallelConfig,
                        names: Iterable[str]) -> str:
    """Write the strategy file of `names` in `parallel`'s layout to `path` (atomically)."""
    from model_zoo.files import write_atomically
    write_atomically(path, strategy_map(params, parallel, names).SerializeToString())
    return path
