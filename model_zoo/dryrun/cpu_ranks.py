"""Run the train steps MindSpore compiled for each rank in a dry run on CPU ranks, with
real collectives: the numbers of a partitioned step, on a laptop.

    python -m model_zoo.launch --workers N --output-dir LOGS -- \\
        python -m model_zoo.dryrun.cpu_ranks DIR BATCH.npz [BATCH2.npz ...]

DIR holds `rank_<r>/step.mindir` for every rank r, written by `dryrun.run.run_dryrun(...,
export=True)`: each is rank r's compiled step with its slices of the weights. On CPU rank
r (MindSpore's dynamic cluster, mccl) this loads it, renames the compile's world group (and
any group of every rank) to the CPU one, creates its other groups (`create_group`, with
the ranks the graph lists), feeds the rank's slice of each global batch (a `.npz` of the
network's input columns in order; `data_shard`: the dataset strategy's) and writes
`rank_<r>/cpu_step.npz`: the step's loss, overflow decision and gradient norm, then every
parameter after the step (this rank's slices).

MindSpore 2.10's CPU backend runs AllReduce in any group but AllGather in the world group
only ("AllGather only support mccl_world_group on CPU") and has no ReduceScatter kernel
("Unsupported op [ReduceScatter] on CPU"). Those collectives are rewritten, before the
graph is loaded, as an all-reduce (sum) of the same data in the same group
(`as_all_reduces`): the partitioned graph's arithmetic is MindSpore's, only the
collective's kernel differs.
"""

import json
import math
import os
import sys
from pathlib import Path

WORLD_GROUP = "mccl_world_group"   # MindSpore's world group on CPU
FLOAT32 = 1                        # MindIR TensorProto.FLOAT
# Primitives MindSpore 2.10 exports as PRIMITIVE_FUNCTION (their arguments are inputs)
FUNCTION_PRIMITIVES = ("Cast", "Concat", "Split")


def cpu_graph(path: Path, rank: int, world_size: int):
    """Rank `rank`'s MindIR at `path` made runnable on CPU ranks: its groups made CPU
    groups and the collectives the CPU lacks rewritten (`as_all_reduces`). Returns
    (serialized bytes, {sub-group name: ranks}, collectives rewritten)."""
    from mindspore.train import mind_ir_pb2
    from model_zoo.dryrun.rank import group_ranks
    from model_zoo.parallel.compiled_layouts import WORLD_GROUPS
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
    rewritten = as_all_reduces(model, rank)
    return model.SerializeToString(), groups, rewritten


def as_all_reduces(model, rank: int) -> int:
    """Rewrite, in the MindIR `model` (after `cpu_graph`), each collective the CPU backend
    cannot run as a sum all-reduce over the same group; returns how many were rewritten.
    With k ranks in the group and this rank at position i in it:
        AllGather(x)          -> AllReduce(Concat(0, .., 0, x, 0, .., 0))   x at block i
        ReduceScatter(x, sum) -> Split(AllReduce(x), k)[i]
    The CPU all-reduce sums float32 only: other data is cast to float32 and back (exact
    for the integers a graph gathers, token ids)."""
    primitives = {primitive.name: primitive for primitive in model.primitives}
    edit = GraphEdit(model)
    rewritten = 0
    for graph in [model.graph, *model.functions]:
        nodes = list(graph.node)
        del graph.node[:]
        for node in nodes:
            primitive = primitives.get(node.op_type.removeprefix("REF::"))
            kind = primitive.op_type if primitive is not None else None
            if kind == "AllGather" and text_attribute(primitive, "group") != WORLD_GROUP:
                graph.node.extend(edit.all_gather(node, primitive, rank))
            elif kind == "ReduceScatter":
                graph.node.extend(edit.reduce_scatter(node, primitive, rank))
            else:
                graph.node.append(node)
                continue
            rewritten += 1
    return rewritten


def text_attribute(primitive, name: str):
    """A MindIR primitive's string attribute `name`, or None."""
    return next((a.s.decode() for a in primitive.attribute if a.name == name), None)


class GraphEdit:
    """New MindIR nodes and primitives for `as_all_reduces`, named after the node they
    replace; the last node of each replacement takes over the replaced node's name."""

    def __init__(self, model):
        from mindspore.train import mind_ir_pb2
        self.pb = mind_ir_pb2
        self.model = model
        self.count = 0

    def primitive(self, op_type: str, like=None, **strings):
        """A new primitive `op_type` with `like`'s attributes (a collective's group) and
        the given string attributes."""
        self.count += 1
        kind = self.pb.PrimitiveProto
        primitive = self.model.primitives.add(
            name=f"{op_type}:cpu_{self.count}", op_type=op_type,
            prim_type=kind.PRIMITIVE_FUNCTION if op_type in FUNCTION_PRIMITIVES
            else kind.PRIMITIVE)
        for attribute in (like.attribute if like is not None else []):
            if attribute.name not in strings and attribute.name != "fusion":
                primitive.attribute.add().CopyFrom(attribute)
        for name, value in strings.items():
            primitive.attribute.add(name=name, s=value.encode(),
                                    type=self.pb.AttributeProto.STRING)
        return primitive

    def constant(self, name: str, value: int):
        node = self.pb.NodeProto(name=name, output=[name], op_type="Constant")
        node.attribute.add(name="value", i=value, type=self.pb.AttributeProto.INT64)
        return node

    def zeros(self, name: str, dims, data_type: int):
        node = self.pb.NodeProto(name=name, output=[name], op_type="Constant")
        tensor = node.attribute.add(name="value", type=self.pb.AttributeProto.TENSORS) \
            .tensors.add(dims=dims, data_type=data_type)
        tensor.raw_data = bytes(4 * math.prod(dims))   # float32 zeros
        return node

    def apply(self, like, name: str, primitive, inputs, dims, data_type: int, outputs=0):
        """A node `name` = primitive(inputs), with `like`'s scope; its abstract is one tensor
        (dims, data_type), or a tuple of `outputs` of them."""
        node = self.pb.NodeProto(name=name, output=[name], input=inputs, domain=like.domain,
                                 op_type=f"REF::{primitive.name}")
        shape = node.attribute.add(name="shape")
        if outputs:
            shape.type = self.pb.AttributeProto.TUPLE
            shape.seq_info.is_dyn_len = False
            for _ in range(outputs):
                shape.values.add(type=self.pb.AttributeProto.TENSORS) \
                    .tensors.add(dims=dims, data_type=data_type)
        else:
            shape.type = self.pb.AttributeProto.TENSORS
            shape.tensors.add(dims=dims, data_type=data_type)
        return node

    def cast(self, like, name, source, dims, to):
        """Nodes casting `source` to the MindIR type `to`."""
        import mindspore as ms
        from mindspore._c_expression import typing
        dtypes = {FLOAT32: ms.float32, 6: ms.int32, 7: ms.int64}   # MindIR type -> ms
        if to not in dtypes:
            raise NotImplementedError(f"{name}: an all-gather of MindIR type {to} on CPU "
                                      f"(float32, int32 and int64 only)")
        type_id = int(typing.type_to_type_id(dtypes[to]))
        return [self.constant(f"{name}_type", type_id),
                self.apply(like, name, self.primitive("Cast"), [source, f"{name}_type"],
                           dims, to)]

    def all_gather(self, node, collective, rank: int):
        from model_zoo.dryrun.rank import group_ranks
        ranks = group_ranks(collective)
        (out,) = node.attribute[0].tensors       # the gathered tensor: (k x rows, ...)
        dims, data_type = list(out.dims), out.data_type
        piece = [dims[0] // len(ranks), *dims[1:]]
        name, source, nodes = node.name, node.input[0], []
        if data_type != FLOAT32:
            nodes += self.cast(node, f"{name}_in", source, piece, FLOAT32)
            source = f"{name}_in"
        nodes.append(self.zeros(f"{name}_zeros", piece, FLOAT32))
        blocks = [source if index == ranks.index(rank) else f"{name}_zeros"
                  for index in range(len(ranks))]
        nodes += [
            self.apply(node, f"{name}_blocks", self.primitive("MakeTuple"), blocks, piece,
                       FLOAT32, outputs=len(ranks)),
            self.constant(f"{name}_axis", 0),
            self.apply(node, f"{name}_padded", self.primitive("Concat"),
                       [f"{name}_blocks", f"{name}_axis"], dims, FLOAT32)]
        summed = name if data_type == FLOAT32 else f"{name}_sum"
        nodes.append(self.apply(node, summed, self.primitive("AllReduce", collective, op="sum"),
                                [f"{name}_padded"], dims, FLOAT32))
        if data_type != FLOAT32:
            nodes += self.cast(node, name, summed, dims, data_type)
        return nodes

    def reduce_scatter(self, node, collective, rank: int):
        from model_zoo.dryrun.rank import group_ranks
        ranks = group_ranks(collective)
        reduce = text_attribute(collective, "op")
        (out,) = node.attribute[0].tensors       # this rank's rows: (rows / k, ...)
        dims, data_type = list(out.dims), out.data_type
        if reduce != "sum" or data_type != FLOAT32:
            raise NotImplementedError(f"{node.name}: ReduceScatter({reduce}) of MindIR type "
                                      f"{data_type} on CPU")
        whole = [dims[0] * len(ranks), *dims[1:]]
        name = node.name
        return [
            self.apply(node, f"{name}_sum", self.primitive("AllReduce", collective, op="sum"),
                       [node.input[0]], whole, FLOAT32),
            self.constant(f"{name}_axis", 0),
            self.constant(f"{name}_parts", len(ranks)),
            self.apply(node, f"{name}_split", self.primitive("Split"),
                       [f"{name}_sum", f"{name}_axis", f"{name}_parts"], dims, FLOAT32,
                       outputs=len(ranks)),
            self.constant(f"{name}_index", ranks.index(rank)),
            self.apply(node, name, self.primitive("TupleGetItem"),
                       [f"{name}_split", f"{name}_index"], dims, FLOAT32)]


def main(folder: str, batch_files) -> int:
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import create_group, get_group_size, get_rank, init
    from model_zoo.parallel.context import data_shard
    from model_zoo.config import load_config

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    rank, size = get_rank(), get_group_size()
    rank_dir = Path(folder).resolve() / f"rank_{rank}"
    request = json.loads((rank_dir / "request.json").read_text())
    os.chdir(request["cwd"])   # the config's own relative paths are those of the dry run
    config = load_config(request["config"], request["overrides"], layout_checked=False)
    graph, groups, rewritten = cpu_graph(rank_dir / "step.mindir", rank, size)
    print(f"rank {rank}: {rewritten} collectives run as all-reduces", flush=True)
    for name, ranks in sorted(groups.items()):
        create_group(name, ranks)
    cpu_path = rank_dir / "cpu_step.mindir"
    cpu_path.write_bytes(graph)
    step = nn.GraphCell(ms.load(str(cpu_path)))
    shard = data_shard(config.parallel, rank, config.train.global_batch_size)
    start = shard.shard_id * shard.batch_size
    outputs = {}
    for index, batch_file in enumerate(batch_files):
        columns = np.load(batch_file)
        loss, finite, _, norm, _, _, _ = step(*[
            Tensor(columns[f"arr_{column}"][start:start + shard.batch_size])
            for column in range(len(columns.files))])
        outputs.update({f"loss_{index}": loss.asnumpy(), f"finite_{index}": finite.asnumpy(),
                        f"grad_norm_{index}": norm.asnumpy()})
        print(f"rank {rank}: step {index}: loss {float(loss.asnumpy()):.6f}, grad norm "
              f"{float(norm.asnumpy()):.6f}, finite {bool(finite.asnumpy())}", flush=True)
    parameters = {name.split(":")[-1]: value.asnumpy()
                  for name, value in step.parameters_dict().items()}
    np.savez(rank_dir / "cpu_step.npz", **outputs, **parameters,
             collectives_as_all_reduces=rewritten)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
