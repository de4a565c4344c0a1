"""Collectives the CPU backend lacks, rewritten in a rank's MindIR as all-reduces of the
same data in the same group (for `cpu_ranks`).

MindSpore 2.10's CPU backend runs AllReduce in any group but AllGather in the world group
only ("AllGather only support mccl_world_group on CPU") and has no ReduceScatter or
AlltoAll kernel ("Unsupported op [ReduceScatter] on CPU"; the AlltoAll of expert
parallelism likewise). Those collectives are rewritten, before the graph is loaded, as an
all-reduce (sum) of the same data in the same group (`as_all_reduces`): the partitioned
graph's arithmetic is MindSpore's, only the collective's kernel differs.
"""

import math

WORLD_GROUP = "mccl_world_group"   # MindSpore's world group on CPU
FLOAT32 = 1                        # MindIR TensorProto.FLOAT
# Primitives MindSpore 2.10 exports as PRIMITIVE_FUNCTION (their arguments are inputs)
FUNCTION_PRIMITIVES = ("Cast", "Concat", "Split")


def as_all_reduces(model, rank: int) -> int:
    """Rewrite, in the MindIR `model` (after `cpu_graph`), each collective the CPU backend
    cannot run as a sum all-reduce over the same group; returns how many were rewritten.
    With k ranks in the group and this rank at position i in it:
        AllGather(x)          -> AllReduce(Concat(0, .., 0, x, 0, .., 0))   x at block i
        ReduceScatter(x, sum) -> Split(AllReduce(x), k)[i]
        AlltoAll(x)           -> Concat(blocks s k + i of Split(G, k k) for s < k, concat_dim),
                                 G = AllReduce(Concat(0, .., x, .., 0, split_dim)): piece i
                                 of every rank's x, in rank order
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
            elif kind == "AlltoAll":
                graph.node.extend(edit.all_to_all(node, primitive, rank))
            else:
                graph.node.append(node)
                continue
            rewritten += 1
    return rewritten


def text_attribute(primitive, name: str):
    """A MindIR primitive's string attribute `name`, or None."""
    return next((a.s.decode() for a in primitive.attribute if a.name == name), None)


def int_attribute(primitive, name: str) -> int:
    """A MindIR primitive's integer attribute `name`."""
    return next(a.i for a in primitive.attribute if a.name == name)


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
        summed = name if data_type == FLOAT32 else f"{name}_sum"
        nodes += self.padded_sum(node, collective, rank, source, piece, 0, summed)
        if data_type != FLOAT32:
            nodes += self.cast(node, name, summed, dims, data_type)
        return nodes

    def padded_sum(self, node, collective, rank: int, source, piece, axis: int, result: str):
        """Nodes ending in `result`: every rank's `source` (dims `piece`, float32) side by
        side along `axis` in rank order, by an all-reduce of this rank's zero-padded block."""
        from model_zoo.dryrun.rank import group_ranks
        ranks = group_ranks(collective)
        name = node.name
        whole = list(piece)
        whole[axis] *= len(ranks)
        blocks = [source if index == ranks.index(rank) else f"{name}_zeros"
                  for index in range(len(ranks))]
        return [
            self.zeros(f"{name}_zeros", piece, FLOAT32),
            self.apply(node, f"{name}_blocks", self.primitive("MakeTuple"), blocks, piece,
                       FLOAT32, outputs=len(ranks)),
            self.constant(f"{name}_axis", axis),
            self.apply(node, f"{name}_padded", self.primitive("Concat"),
                       [f"{name}_blocks", f"{name}_axis"], whole, FLOAT32),
            self.apply(node, result, self.primitive("AllReduce", collective, op="sum"),
                       [f"{name}_padded"], whole, FLOAT32)]

    def all_to_all(self, node, collective, rank: int):
        from model_zoo.dryrun.rank import group_ranks
        ranks = group_ranks(collective)
        k, i = len(ranks), ranks.index(rank)
        split, concat = (int_attribute(collective, "split_dim"),
                         int_attribute(collective, "concat_dim"))
        (out,) = node.attribute[0].tensors
        dims, data_type = list(out.dims), out.data_type
        if data_type != FLOAT32:
            raise NotImplementedError(f"{node.name}: AlltoAll of MindIR type {data_type} on "
                                      f"CPU (float32 only)")
        piece = list(dims)                 # this rank's input: split_dim k-fold, concat_dim
        piece[concat] //= k                # a k-th
        piece[split] *= k
        block = list(piece)                # piece j of one rank's input
        block[split] //= k
        name = node.name
        nodes = self.padded_sum(node, collective, rank, node.input[0], piece, split,
                                f"{name}_sum")
        nodes += [self.constant(f"{name}_blocks_axis", split),
                  self.constant(f"{name}_parts", k * k),
                  self.apply(node, f"{name}_split", self.primitive("Split"),
                             [f"{name}_sum", f"{name}_blocks_axis", f"{name}_parts"], block,
                             FLOAT32, outputs=k * k)]
        mine = []
        for source in range(k):
            nodes += [self.constant(f"{name}_index_{source}", source * k + i),
                      self.apply(node, f"{name}_from_{source}", self.primitive("TupleGetItem"),
                                 [f"{name}_split", f"{name}_index_{source}"], block, FLOAT32)]
            mine.append(f"{name}_from_{source}")
        return nodes + [
            self.apply(node, f"{name}_mine", self.primitive("MakeTuple"), mine, block, FLOAT32,
                       outputs=k),
            self.constant(f"{name}_concat_axis", concat),
            self.apply(node, name, self.primitive("Concat"),
                       [f"{name}_mine", f"{name}_concat_axis"], dims, FLOAT32)]

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
