"""Run the train steps MindSpore compiled for each rank in a dry run on CPU ranks, with
real collectives: the numbers of a partitioned step, on a laptop.

    python -m model_zoo.launch --workers N --output-dir LOGS -- \\
        python -m model_zoo.plan.dryrun_cpu DIR BATCH.npy [BATCH2.npy ...]

DIR holds `rank_<r>/step.mindir` for every rank r, written by `dryrun.run_dryrun(...,
export=True)`: each is rank r's compiled step with its slices of the weights. On CPU rank
r (MindSpore's dynamic cluster, mccl) this loads it, renames the compile's world group (and
any group of every rank) to the CPU one, creates its other groups (`create_group`, with
the ranks the graph lists), feeds the rank's slice of each global batch (`data_shard`:
the dataset strategy's) and writes `rank_<r>/cpu_step.npz`: the step's loss, overflow
decision and gradient norm, then every parameter after the step (this rank's slices).

MindSpore 2.10's CPU AllGather works in the world group only ("AllGather only support
mccl_world_group on CPU"), so a layout whose compiled step all-gathers within a sub-group
(dp2 x mp2) does not run here; AllReduce in sub-groups does.
"""

import json
import os
import sys
from pathlib import Path

WORLD_GROUP = "mccl_world_group"   # MindSpore's world group on CPU


def cpu_graph(path: Path, world_size: int):
    """The MindIR at `path` with its groups made CPU groups: (serialized bytes,
    {sub-group name: ranks})."""
    from mindspore.train import mind_ir_pb2
    from model_zoo.plan.dryrun_rank import WORLD_GROUPS, group_ranks
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(path.read_bytes())
    groups = {}
    for primitive in model.primitives:
        for attribute in primitive.attribute:
            if attribute.name != "group":
                continue
            ranks = group_ranks(primitive)
            if attribute.s.decode() in WORLD_GROUPS or sorted(ranks) == list(range(world_size)):
                attribute.s = WORLD_GROUP.encode()
            else:
                groups[attribute.s.decode()] = ranks
    return model.SerializeToString(), groups


def main(folder: str, batch_files) -> int:
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import create_group, get_group_size, get_rank, init
    from model_zoo.parallel.context import data_shard
    from model_zoo.plan.report import load_plan_config

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    rank, size = get_rank(), get_group_size()
    rank_dir = Path(folder).resolve() / f"rank_{rank}"
    request = json.loads((rank_dir / "request.json").read_text())
    os.chdir(request["cwd"])   # the config's own relative paths are those of the dry run
    config = load_plan_config(request["config"], request["overrides"])
    graph, groups = cpu_graph(rank_dir / "step.mindir", size)
    for name, ranks in sorted(groups.items()):
        create_group(name, ranks)
    cpu_path = rank_dir / "cpu_step.mindir"
    cpu_path.write_bytes(graph)
    step = nn.GraphCell(ms.load(str(cpu_path)))
    shard = data_shard(config.parallel, rank, config.train.global_batch_size)
    start = shard.shard_id * shard.batch_size
    outputs = {}
    for index, batch_file in enumerate(batch_files):
        batch = np.load(batch_file)[start:start + shard.batch_size]
        loss, finite, _, norm, _, _ = step(Tensor(batch))
        outputs.update({f"loss_{index}": loss.asnumpy(), f"finite_{index}": finite.asnumpy(),
                        f"grad_norm_{index}": norm.asnumpy()})
        print(f"rank {rank}: step {index}: loss {float(loss.asnumpy()):.6f}, grad norm "
              f"{float(norm.asnumpy()):.6f}, finite {bool(finite.asnumpy())}", flush=True)
    parameters = {name.split(":")[-1]: value.asnumpy()
                  for name, value in step.parameters_dict().items()}
    np.savez(rank_dir / "cpu_step.npz", **outputs, **parameters)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
