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

MindSpore 2.10's CPU backend lacks some collectives (sub-group AllGather, ReduceScatter,
AlltoAll): they are rewritten, before the graph is loaded, as all-reduces of the same data
in the same group (`cpu_collectives.as_all_reduces`): the partitioned graph's arithmetic
is MindSpore's, only the collective's kernel differs.

Nor has it Send/Receive kernels ("Unsupported op [Send] on CPU"), which pipeline stages
exchange activations and gradients with. Each Send and Receive is rewritten as a Python
operator of MindSpore's (a `pyfunc` Custom primitive, registered in this process before
the graph loads: `as_mailbox_operators`) that carries the tensor through a folder shared
by the ranks: a Send writes it under (source rank, destination rank, `sr_tag`, how many
times this pair and tag have sent before) and returns at once, the matching Receive waits
for that file. MindSpore pairs a Send with the Receive of the same tag between the same
two ranks, in each rank's graph order; so does the mailbox. An all-reduce could not stand
in for them: in a 1F1B schedule the stages send and receive in different orders, and
paired collectives would match the wrong tensors or wait on each other.

And a step whose micro batches call one shared subgraph (accumulation and pipelines:
`lazy_inline`) has each call expanded into a copy of the called graph (`inline_calls`):
the CPU runtime ran the gradient-buffer additions inside such calls out of order with
the step's reads of them.
"""

import json
import os
import sys
import time
from pathlib import Path

from model_zoo.dryrun.cpu_collectives import WORLD_GROUP, as_all_reduces
MAILBOX_FN_IDS = 1 << 40   # the Python operators' ids in MindSpore's pyfunc registry
RECEIVE_TIMEOUT = 600      # seconds a Receive waits for its Send
MAILBOX = "mailbox"        # the folder, in the job's, the tensors pass through
CLOSURE_LEFTOVERS = ("Partial", "MakeTuple", "TupleGetItem", "Constant")


def cpu_graph(path: Path, rank: int, world_size: int, mailbox: Path):
    """Rank `rank`'s MindIR at `path` made runnable on CPU ranks: its Send and Receive
    operators carried through `mailbox` (`as_mailbox_operators`), its groups made CPU
    groups and the collectives the CPU lacks rewritten (`as_all_reduces`). Returns
    (serialized bytes, {sub-group name: ranks}, collectives rewritten, {pyfunc id: the
    function to register before loading}, the Sends moved ahead of a blocking operator
    and the graph's communication in order: `in_graph_order`)."""
    from mindspore.train import mind_ir_pb2
    from model_zoo.dryrun.rank import group_ranks
    from model_zoo.parallel.compiled_layouts import WORLD_GROUPS
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(path.read_bytes())
    inline_calls(model)
    functions, communication = as_mailbox_operators(model, rank, mailbox)
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
    rewritten = as_all_reduces(model, rank) + len(functions)
    return model.SerializeToString(), groups, rewritten, functions, communication


def inline_calls(model):
    """Expand, in the MindIR `model`, every call of one of its function graphs into a copy
    of that graph's nodes, so that the main graph holds the whole step.

    A step whose micro batches share one subgraph (`ReusedPerMicroBatch`, MindSpore's
    `lazy_inline`) calls the forward graph once per micro batch; it returns the loss and a
    closure (a `Partial` of the backward graph over the values it saved), which the step
    then calls. The backward graph adds each gradient into its `accu_grads` buffer; the
    step reads the buffers after the calls, ordered only through the calls' outputs, and
    MindSpore's CPU runtime runs such calls out of order with those reads (mp2 x 4 micro
    steps lost one micro batch's gradient). Inlined, every addition and every read is an
    operator of one graph with its data and monad edges, the graph an Ascend run compiles
    otherwise unchanged (docs/ascend.md, "The partitioned step's numbers")."""
    from mindspore.train import mind_ir_pb2
    functions = {graph.name: graph for graph in model.functions}
    if not functions:
        return
    kinds = {primitive.name: primitive.op_type for primitive in model.primitives}
    main = model.graph
    kept, made, replaced = [], {}, {}
    copies = [0]

    def kind_of(node):
        return kinds.get(node.op_type.removeprefix("REF::"), node.op_type.removeprefix("REF::"))

    def callee(name):
        """(function graph, captured arguments) that calling `name` runs, or None."""
        if name in functions:
            return functions[name], []
        node = made.get(name)
        if node is None:
            return None
        if kind_of(node) == "Partial" and node.input[0] in functions:
            return functions[node.input[0]], list(node.input[1:])
        return None

    def expand(graph, arguments):
        """Copy `graph`'s nodes in, its inputs bound to `arguments`; its output's name."""
        copies[0] += 1
        prefix = f"inlined_{copies[0]}_"
        if len(arguments) != len(graph.input):
            raise ValueError(f"a call of {graph.name} with {len(arguments)} argument(s) for "
                             f"{len(graph.input)} input(s)")
        bound = {value.name: argument for value, argument in zip(graph.input, arguments)}
        for node in graph.node:
            copy = mind_ir_pb2.NodeProto()
            copy.CopyFrom(node)
            copy.name = bound[node.name] = prefix + node.name
            del copy.output[:]
            copy.output.append(copy.name)
            copy.input[:] = [bound.get(source, source) for source in node.input]
            called = node.op_type.removeprefix("REF::")
            if called in bound:   # a call of a closure this graph received or made
                copy.op_type = f"REF::{bound[called]}"
            visit(copy)
        return replaced.get(bound[graph.output[0].name], bound[graph.output[0].name])

    def visit(node):
        node.input[:] = [replaced.get(source, source) for source in node.input]
        target = callee(replaced.get(node.op_type.removeprefix("REF::"),
                                     node.op_type.removeprefix("REF::")))
        if target is not None:
            graph, captured = target
            replaced[node.name] = expand(graph, captured + list(node.input))
            return
        element = picked(node)
        if element is not None:   # an item of a tuple built here: the item itself
            replaced[node.name] = element
            return
        if kind_of(node) in ("Depend", "UpdateState") and any(
                waited_for(source) != [source] for source in node.input[1:]):
            node = waiting_for_values(node)
            if node is None:
                return
        kept.append(node)
        made[node.name] = node

    def waited_for(name):
        """The values a wait on `name` waits for: a tuple holding a closure (a forward
        call's result) stands for its other items and the values the closure saved."""
        whole = made.get(name)
        if whole is None or kind_of(whole) != "MakeTuple" or not any(
                kind_of(made[item]) == "Partial" for item in whole.input if item in made):
            return [name]
        return [value for item in whole.input for value in (
            made[item].input[1:] if item in made and kind_of(made[item]) == "Partial"
            else [item])]

    def waiting_for_values(node):
        """Depend / UpdateState `node` as a chain of the same operator, one value each
        (None, the node replaced by its first input, when there is nothing to wait for)."""
        first, rest = node.input[0], [value for source in node.input[1:]
                                      for value in waited_for(source)]
        if not rest:
            replaced[node.name] = first
            return None
        for count, value in enumerate(rest[:-1]):
            link = mind_ir_pb2.NodeProto()
            link.CopyFrom(node)
            link.name = f"{node.name}_waits_{count}"
            link.output[:] = [link.name]
            link.input[:] = [first, value]
            kept.append(link)
            made[link.name] = link
            first = link.name
        node.input[:] = [first, rest[-1]]
        return node

    def picked(node):
        """What TupleGetItem `node` takes, when it takes it from a MakeTuple node."""
        if kind_of(node) != "TupleGetItem":
            return None
        whole, index = made.get(node.input[0]), made.get(node.input[1])
        if whole is None or kind_of(whole) != "MakeTuple" or index is None:
            return None
        return whole.input[index.attribute[0].i]

    for node in list(main.node):
        visit(node)
    for node in kept:
        called = node.op_type.removeprefix("REF::")
        if node.op_type.startswith("REF::") and called not in kinds:
            raise ValueError(f"inlining the calls left node {node.name} calling {called}")
    output = replaced.get(main.output[0].name, main.output[0].name)
    main.output[0].name = output
    del main.node[:]
    main.node.extend(reachable(kept, output, kind_of))
    del model.functions[:]


def reachable(nodes: list, output: str, kind_of) -> list:
    """`nodes` the output `output` takes, in their order. What is left are the closures'
    leftovers (Partial, MakeTuple, TupleGetItem, constants); any other operator left out
    (one with a side effect reaches the output through its monad chain) is an error."""
    producers = {node.name: node for node in nodes}
    needed, stack = set(), [output]
    while stack:
        node = producers.get(stack.pop())
        if node is None or node.name in needed:
            continue
        needed.add(node.name)
        stack.extend(node.input)
    for node in nodes:
        if node.name not in needed and kind_of(node) not in CLOSURE_LEFTOVERS:
            raise ValueError(f"inlining the calls left {kind_of(node)} node {node.name} "
                             f"out of the step")
    return [node for node in nodes if node.name in needed]


def as_mailbox_operators(model, rank: int, mailbox: Path) -> dict:
    """Rewrite, in the MindIR `model`, each Send and Receive primitive as a pyfunc Custom
    primitive of its own (module docstring); returns ({pyfunc id: function}, what
    `in_graph_order` reports)."""
    from mindspore.train import mind_ir_pb2
    functions, boxes, names, receives = {}, {}, set(), set()
    for index, primitive in enumerate(model.primitives):
        if primitive.op_type not in ("Send", "Receive"):
            continue
        names.add(primitive.name)
        values = {a.name: a.i for a in primitive.attribute}
        tag = values.get("sr_tag", 0)
        if primitive.op_type == "Send":
            pair = (rank, values.get("dst_global_rank", values.get("dest_rank", 0)))
        else:
            receives.add(primitive.name)
            pair = (values.get("src_global_rank", values.get("src_rank", 0)), rank)
        # one count per (source, destination, tag), whichever primitives carry it
        box = boxes.setdefault((*pair, tag), Mailbox(mailbox, *pair, tag))
        fn_id = MAILBOX_FN_IDS + index
        functions[fn_id] = box.send if primitive.op_type == "Send" else box.receive
        name = f"{primitive.op_type.lower()}_{pair[0]}_to_{pair[1]}_tag_{tag}"
        kind = mind_ir_pb2.AttributeProto
        del primitive.attribute[:]
        primitive.op_type = "Custom"
        primitive.prim_type = mind_ir_pb2.PrimitiveProto.PRIMITIVE
        for key, text in (("func_type", "pyfunc"), ("func_name", name),
                          ("uniq_name", f"Custom_{name}"), ("primitive_target", "CPU"),
                          ("imply_path", __file__)):
            primitive.attribute.add(name=key, s=text.encode(), type=kind.STRING)
        for key in ("multi_output", "single_scalar_output", "fake_output"):
            primitive.attribute.add(name=key, i=0, type=kind.BOOL)
        primitive.attribute.add(name="fn_id", i=fn_id, type=kind.INT64)
        primitive.attribute.add(name="inputs_num", i=1, type=kind.INT64)
        primitive.attribute.add(name="side_effect_io", i=1, type=kind.BOOL)
    report = (in_graph_order(model, names, receives) if names
              else {"moved": [], "order": []})
    return functions, report


def in_graph_order(model, names: set, receives: set):
    """Order the communication the way an asynchronous one needs no order. MindSpore's CPU
    runtime runs an operator as soon as its inputs are ready, and here a Receive blocks
    until its tensor comes and an all-reduce until every rank joins it; HCCL's sends do
    not wait. So (1) each Receive (`receives`) starts only after the mailbox operator
    (`names`) before it in its graph's node order, the order MindSpore's pipeline pass
    emitted them in: its input, a placeholder its function ignores, becomes the earlier
    operator's output, made to wait for the placeholder too; and (2) each of MindSpore's
    collectives and each Receive waits (a Depend on its first input) for every Send of the
    graph that does not itself wait for it: a rank never blocks before sending what its
    peers need. Returns {"moved": the Sends (2) ran before a blocking operator the graph
    had first, each {"send", "ahead_of"}; "order": the graph's communication events
    (`communication_events`)}: an Ascend run keeps the compiled order, and such a Send may
    wait there for a peer that waits for it (`numbers.reordered_sends`)."""
    from mindspore.train import mind_ir_pb2
    from model_zoo.dryrun.rank import COLLECTIVES
    report = {"moved": [], "order": []}
    depend = next(p for p in model.primitives if p.op_type == "Depend")
    blocking = receives | {p.name for p in model.primitives if p.op_type in COLLECTIVES}
    sends = names - receives
    for graph in [model.graph, *model.functions]:
        abstracts = {node.name: attribute for node in graph.node
                     for attribute in node.attribute if attribute.name == "shape"}
        for parameter in graph.parameter:
            attribute = mind_ir_pb2.AttributeProto(name="shape",
                                                   type=mind_ir_pb2.AttributeProto.TENSORS)
            attribute.tensors.add(dims=parameter.dims, data_type=parameter.data_type)
            abstracts[parameter.name] = attribute

        def waiting(node, first, carried):
            name = f"{node.name}_after_{sum(map(len, added.values()))}"
            after = mind_ir_pb2.NodeProto(
                name=name, output=[name],
                input=[first, carried], domain=node.domain, op_type=f"REF::{depend.name}")
            after.attribute.add().CopyFrom(abstracts[first])
            abstracts[after.name] = after.attribute[0]
            added.setdefault(node.name, []).append(after)
            producers[after.name] = after
            return after.name

        added, previous = {}, None
        producers = {node.name: node for node in graph.node}
        for node in graph.node:
            kind = node.op_type.removeprefix("REF::")
            if kind in receives and previous is not None:
                node.input[0] = waiting(node, previous, node.input[0])
            if kind in names:
                previous = node.name
        send_nodes = [node for node in graph.node if node.op_type.removeprefix("REF::") in sends]
        events = communication_events(graph, model.primitives, names)
        report["order"] += list(events.values())
        position = {node.name: index for index, node in enumerate(graph.node)}
        for node in graph.node:
            if node.op_type.removeprefix("REF::") not in blocking or not node.input:
                continue
            for send in send_nodes:
                if send.name != node.name and not depends_on(producers, send.name, node.name) \
                        and node.input[0] in abstracts:
                    node.input[0] = waiting(node, node.input[0], send.name)
                    if position[send.name] > position[node.name]:   # the graph had it later
                        report["moved"].append({"send": events[send.name],
                                                "ahead_of": events[node.name]})
        nodes = []
        for node in graph.node:
            nodes += added.get(node.name, []) + [node]
        del graph.node[:]
        graph.node.extend(topological(nodes))
    return report


def communication_events(graph, primitives, mailbox_names: set) -> dict:
    """{node name: event} of the graph's communication in its node order: a mailbox Send or
    Receive {"op", "source", "destination", "tag", "index"} (index: the how-manyth of that
    pair and tag), a collective {"op", "group" (its ranks; [] for the world), "index" (the
    how-manyth of that operator and group)}: the keys that match one rank's event with its
    peers'."""
    from model_zoo.dryrun.rank import COLLECTIVES, group_ranks
    by_name = {primitive.name: primitive for primitive in primitives}
    counts, events = {}, {}
    for node in graph.node:
        primitive = by_name.get(node.op_type.removeprefix("REF::"))
        if primitive is None:
            continue
        if primitive.name in mailbox_names:
            name = next(a.s.decode() for a in primitive.attribute if a.name == "func_name")
            op, source, _, destination, _, tag = name.split("_")
            event = {"op": op.capitalize(), "source": int(source),
                     "destination": int(destination), "tag": int(tag)}
            key = (source, destination, tag)
        elif primitive.op_type in COLLECTIVES:
            event = {"op": COLLECTIVES[primitive.op_type], "group": group_ranks(primitive)}
            key = (event["op"], tuple(event["group"]))
        else:
            continue
        event["index"] = counts[key] = counts.get(key, -1) + 1
        events[node.name] = event
    return events


def describe_event(event: dict) -> str:
    """An event of `communication_events` in words."""
    if "tag" in event:
        return (f"{event['op']} {event['source']} -> {event['destination']} (sr_tag "
                f"{event['tag']}, #{event['index'] + 1})")
    return (f"{event['op']} over ranks {event['group'] or 'all'} "
            f"(#{event['index'] + 1} of that group)")


def topological(nodes: list) -> list:
    """`nodes` reordered so that each comes after the nodes it takes as inputs (MindSpore's
    MindIR loader reads them in that order), keeping their order otherwise."""
    names = {node.name for node in nodes}
    done, ordered, pending = set(), [], list(nodes)
    while pending:
        waiting = []
        for node in pending:
            if all(source in done or source not in names for source in node.input):
                done.add(node.name)
                ordered.append(node)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            raise ValueError(f"a cycle through {waiting[0].name}")
        pending = waiting
    return ordered


def depends_on(producers: dict, name: str, other: str) -> bool:
    """Whether node `name` waits, through its inputs, for node `other` ({node name: node}
    of the graph in `producers`)."""
    seen, stack = set(), [name]
    while stack:
        current = producers.get(stack.pop())
        if current is None:
            continue
        for source in current.input:
            if source == other:
                return True
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return False


class Mailbox:
    """Tensors from rank `source` to rank `destination` under one `sr_tag`, in order: the
    n-th send is the file the n-th receive waits for."""

    def __init__(self, folder: Path, source: int, destination: int, tag: int):
        self.folder, self.key = folder, f"{source}_to_{destination}_tag_{tag}"
        self.sent = self.received = 0

    def send(self, x):
        import numpy as np
        path = self.folder / f"{self.key}_{self.sent}.npy"
        np.save(self.folder / f".{path.name}", x)
        os.replace(self.folder / f".{path.name}", path)
        self.sent += 1
        return x

    def receive(self, _):
        import numpy as np
        path = self.folder / f"{self.key}_{self.received}.npy"
        waited = time.monotonic()
        while not path.exists():
            if time.monotonic() - waited > RECEIVE_TIMEOUT:
                raise TimeoutError(f"no tensor {path.name} from the sending rank within "
                                   f"{RECEIVE_TIMEOUT} s")
            time.sleep(0.001)
        value = np.load(path)
        path.unlink()
        self.received += 1
        return value


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
    mailbox = Path(folder).resolve() / MAILBOX
    mailbox.mkdir(exist_ok=True)
    graph, groups, rewritten, functions, communication = cpu_graph(
        rank_dir / "step.mindir", rank, size, mailbox)
    (rank_dir / "communication.json").write_text(json.dumps(communication))
    for move in communication["moved"]:
        print(f"rank {rank}: moved {describe_event(move['send'])} ahead of "
              f"{describe_event(move['ahead_of'])}, which the compiled graph had first",
              flush=True)
    from mindspore.ops.operations._pyfunc_registry import add_pyfunc
    for fn_id, function in functions.items():
        add_pyfunc(fn_id, function)
    print(f"rank {rank}: {rewritten} collectives run as all-reduces or through the mailbox "
          f"({len(functions)} Send/Receive)", flush=True)
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
        loss, applied, scale, norm, _, _, _ = step(*[
            Tensor(columns[f"arr_{column}"][start:start + shard.batch_size])
            for column in range(len(columns.files))])
        outputs.update({f"loss_{index}": loss.asnumpy(), f"finite_{index}": applied.asnumpy(),
                        f"grad_norm_{index}": norm.asnumpy(), f"scale_{index}": scale.asnumpy()})
        print(f"rank {rank}: step {index}: loss {float(loss.asnumpy()):.6f}, grad norm "
              f"{float(norm.asnumpy()):.6f}, applied {bool(applied.asnumpy())}, loss scale "
              f"{float(scale.asnumpy()):g}", flush=True)
    parameters = {name.split(":")[-1]: value.asnumpy()
                  for name, value in step.parameters_dict().items()}
    np.savez(rank_dir / "cpu_step.npz", **outputs, **parameters,
             collectives_as_all_reduces=rewritten)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
