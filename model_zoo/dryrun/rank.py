"""One rank of `model-zoo dryrun`, in a process of its own:
`python -m model_zoo.dryrun.rank REQUEST.json` (the driver, `dryrun.run`, writes the
request and sets the environment: stand-in CUDA, `MS_SIMULATION_LEVEL=0`, `RANK_SIZE`,
`RANK_ID`).

It builds the train step exactly as `model-zoo train` does on a distributed Ascend run
(`trainer.build_model`: the model folder's network, the optimizer, loss scale, micro-batch
cells and gradient norm, no weights allocated; `wrap_train_step`: AutoParallel with the
layout's pipeline, optimizer shard, dataset strategy and strategy file), then lets
MindSpore compile it for this rank, and then the held-out evaluation network the trainer
evaluates through (`wrap_eval_network`, on the same parameters). A dry-run process runs no
operator (level 0 stops before any kernel launch), so it only compiles; that is why each
rank has its own process.
MindSpore compiles for its GPU target here (its parallel pass refuses CPU); the model is
built as for Ascend (`RunContext("Ascend")`: the operators and strategies an Ascend run
uses).

It writes `result.json` beside the request: whether the step compiled, MindSpore's error,
compile seconds, peak memory, the collectives in the compiled graph, every parameter's
layout and the trainer's check of the layouts its gradient-norm weights assume
(`norm_weights_error`), then the same of the evaluation network (its refusal in
`eval_error`; not compiled when the request says `"evaluation": false`). A config that
sinks its data on Ascend (`train.dataset_sink`, `loop.sink_size_of`) compiles the
sunk step the trainer runs there (`sink_size` steps a call: `GetNext` from MindSpore's data
queue, then the step), unless the step is exported for CPU ranks.
"""

import json
import os
import re
import resource
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

from model_zoo.errors import UserInputError
from model_zoo.parallel.compiled_layouts import (check_compiled_layouts, layout_of,
                                                 named_group_size)

# the Ascend 910's overflow check (`step.GradientNorm` with float_status)
FLOAT_STATUS = ("NPUClearFloatStatusV2", "NPUGetFloatStatusV2")
# MindSpore's names of the communication primitives it inserts -> the kind reported
COLLECTIVES = {"AllReduce": "AllReduce", "AllGather": "AllGather",
               "ReduceScatter": "ReduceScatter", "Send": "Send", "Receive": "Receive",
               "AlltoAll": "AllToAll", "AllToAll": "AllToAll", "AlltoAllV": "AllToAll",
               "NeighborExchange": "AllToAll", "Broadcast": "Broadcast"}


def main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    folder = Path(request_path).parent
    from model_zoo.dryrun import cuda_stubs
    cuda_stubs.load(Path(os.environ["CUDA_HOME"]))   # before MindSpore loads its GPU plugin
    result = {"rank": request["rank"], "compiled": False, "compile_s": None, "sink_size": 0,
              "eval_compile_s": None, "eval_collectives": {}, "eval_error": None,
              "peak_rss_mb": None, "collectives": {}, "collective_groups": {},
              "layouts": {}, "float_status_ops": 0, "constant_mb": None,
              "norm_weights_error": None,
              "error": None}
    try:
        compile_rank(request, folder, result)
    except Exception as err:  # noqa: BLE001 - MindSpore's refusal is the result
        result["error"] = one_line(err)
        (folder / "error.txt").write_text(traceback.format_exc())
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    (folder / "result.json").write_text(json.dumps(result))
    return 0


def compile_rank(request: dict, folder: Path, result: dict):
    import numpy as np
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init
    from model_zoo.config import import_model
    from model_zoo.parallel.context import (RunContext, data_shard, eval_network_compiles,
                                            sync_shared_parameters,
                                            wrap_eval_network, wrap_train_step)
    from model_zoo.config import load_config
    from model_zoo.train.loop import sink_size_of
    from model_zoo.train.trainer import build_model

    here = os.getcwd()
    os.chdir(request["cwd"])   # the config's own relative paths are the user's
    try:
        config = load_config(request["config"], request["overrides"], layout_checked=False)
    finally:
        os.chdir(here)         # MindSpore writes its failure reports beside the result
    module = import_model(config.model.name)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("GPU")   # MindSpore's parallel pass refuses the CPU target
    allow_ascend_collective_dtypes()
    init()                 # dummy collectives of RANK_SIZE ranks (MS_SIMULATION_LEVEL=0)
    context = RunContext("Ascend", rank=get_rank(), device_num=get_group_size(),
                         chip=request.get("as_device") or "")
    ms.set_seed(config.train.seed)
    network, step_cell = build_model(module, config, context)
    if request.get("load"):   # whole values, cut into this rank's slices by the compile
        missing, _ = ms.load_param_into_net(step_cell, ms.load_checkpoint(request["load"]))
        trainable = {param.name for param in step_cell.trainable_params()}
        if trainable & set(missing):
            raise ValueError(f"{request['load']} lacks {sorted(trainable & set(missing))[:3]}")
    runnable = wrap_train_step(step_cell, config.parallel, context,
                               str(folder / "strategy.ckpt"))
    shard = data_shard(config.parallel, context.rank, config.train.global_batch_size)
    inputs = [ms.Tensor(np.zeros(shape, ms.dtype_to_nptype(dtype)))
              for shape, dtype in module.plan_inputs(config, shard.batch_size)]
    runnable.set_train(True)
    # the step as an Ascend run compiles it: sunk (its batches from MindSpore's data queue)
    # when the config sinks, unless exported for the CPU ranks, which take the plain one
    sink_size = 0 if request.get("export") else sink_size_of(config.train, "Ascend", 0)
    started = time.perf_counter()
    compiled = runnable
    if sink_size:
        compiled, layouts = compile_sunk(runnable, inputs, sink_size, context.semi_auto)
    else:
        runnable.compile(*inputs)
        layouts = runnable.parameter_layout_dict
    result["compile_s"] = round(time.perf_counter() - started, 2)
    result["sink_size"] = sink_size
    graph = compiled_graph(compiled)
    result["collectives"], result["collective_groups"] = collectives(graph,
                                                                     context.device_num)
    result["float_status_ops"] = sum(1 for primitive in called_primitives(graph)
                                     if primitive.op_type in FLOAT_STATUS)
    result["constant_mb"] = round(constant_bytes(graph) / 2**20, 1)
    if context.semi_auto:   # the trainer's check before step 1, on what MindSpore compiled
        try:
            check_compiled_layouts(layouts, step_cell.gradient_norm.planned_layouts,
                                   config.parallel, context.rank)
        except UserInputError as err:
            result["norm_weights_error"] = str(err)
    names = set(step_cell.parameters_dict())
    result["layouts"] = {name: layout_of(value, context.device_num) for name, value
                         in layouts.items() if name in names}
    if request.get("export"):   # this rank's compiled step, to run on CPU ranks
        ms.export(runnable, *inputs, file_name=str(folder / "step"), file_format="MINDIR")
    result["compiled"] = True   # the step, and its collectives, layouts and export read
    if not request.get("evaluation", True) or not eval_network_compiles(config.parallel):
        return
    held_out = wrap_eval_network(network, config.parallel, context,   # as the trainer does
                                 config.train.grad_accumulation)
    started = time.perf_counter()
    try:
        held_out.compile(*inputs)
        sync_shared_parameters(held_out, config.parallel, inputs)
    except Exception as err:  # noqa: BLE001 - MindSpore's refusal is the result
        result["eval_error"] = one_line(err)
        return
    result["eval_compile_s"] = round(time.perf_counter() - started, 2)
    result["eval_collectives"], _ = collectives(compiled_graph(held_out), context.device_num)


def allow_ascend_collective_dtypes():
    """MindSpore's collectives check their input dtype against the context target's list
    (`comm_ops.check_collective_target_dtype`): the GPU target's here, which lacks the
    bfloat16 Ascend's has, so a bf16 run's optimizer-shard gathers inside a pipeline
    (`_MicroStepAllGather`) would be refused as no Ascend run refuses them. Accept Ascend's
    dtypes too."""
    from mindspore import _checkparam as validator
    from mindspore.common import dtype as mstype
    from mindspore.ops.operations import comm_ops
    allowed = (mstype.bool_, mstype.int8, mstype.int32, mstype.int64, mstype.uint32,
               mstype.uint64, mstype.float16, mstype.float32, mstype.float64, mstype.bfloat16)
    comm_ops.check_collective_target_dtype = lambda name, dtype, primitive: \
        validator.check_tensor_dtype_valid(name, dtype, allowed, primitive)


def compile_sunk(runnable, inputs, sink_size: int, semi_auto: bool):
    """Compile the train step behind MindSpore's data queue, `sink_size` steps a call, as
    the trainer's Model.build does on Ascend (which refuses other targets): the same
    preprocess (`connect_network_with_dataset`) and compile, on a dataset repeating the
    batch `inputs`, nothing sent. Returns (the compiled cell, its parameter layouts)."""
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.train import Model
    rows = tuple(tensor.asnumpy() for tensor in inputs)
    dataset = ds.NumpySlicesDataset(rows, shuffle=False).batch(len(rows[0])).repeat()
    if semi_auto:   # Model sets AutoParallel's context around the compile
        layouts = Model(runnable).infer_train_layout(dataset, dataset_sink_mode=True,
                                                     sink_size=sink_size)
        return runnable, layouts
    dataset.__no_send__ = True
    sunk = ms.connect_network_with_dataset(
        runnable, ms.DatasetHelper(dataset, dataset_sink_mode=True, sink_size=sink_size))
    sunk.set_train(True)
    sunk.compile()
    return sunk, {}


def compiled_graph(cell):
    """The MindIR of `cell`'s compiled graph (the main graph and every function it calls),
    parsed once for every count taken of it."""
    import mindspore as ms
    from mindspore.train import mind_ir_pb2
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(ms.common.api._cell_graph_executor._get_func_graph_proto(  # pylint: disable=W0212
        cell, cell.compile_phase, "mind_ir"))
    return model


def called_primitives(model):
    """The primitive each node of a parsed MindIR calls, node by node (nodes that call a
    function or hold a constant left out)."""
    primitives = {primitive.name: primitive for primitive in model.primitives}
    for graph in [model.graph, *model.functions]:
        for node in graph.node:
            reference = node.op_type.removeprefix("REF::")
            if node.op_type.startswith("REF::") and reference in primitives:
                yield primitives[reference]


def constant_bytes(model) -> int:
    """Bytes of the tensors a parsed compiled graph holds as constants: device memory on
    top of the parameters, optimizer states and activations the plan counts (a masks or a
    rotary table: a few MB; a constant as large as a weight slice is a defect, such as a
    zeros_like of a gradient MindSpore folds into a constant)."""
    return sum(len(tensor.raw_data) for graph in [model.graph, *model.functions]
               for node in graph.node if node.op_type == "Constant"
               for attribute in node.attribute for tensor in attribute.tensors)


def collectives(model, device_num: int):
    """({kind: count}, {kind: {group size: count}}) of the communication operators in a
    parsed compiled graph (`compiled_graph`)."""
    counts, by_size = Counter(), defaultdict(Counter)
    for primitive in called_primitives(model):
        kind = COLLECTIVES.get(primitive.op_type)
        if kind:
            counts[kind] += 1
            by_size[kind][str(group_size(primitive, device_num))] += 1
    return dict(counts), {kind: dict(sizes) for kind, sizes in by_size.items()}


def group_size(primitive, device_num: int) -> int:
    """Ranks of a collective's group: its rank list, else the world, else the size MindSpore
    puts in front of a sub-group's name ("<size>-<hash>"); Send/Receive pairs are 2."""
    attributes = {attribute.name: attribute for attribute in primitive.attribute}
    ranks = group_ranks(primitive)
    if ranks:
        return len(ranks)
    group = attributes["group"].s.decode() if "group" in attributes else ""
    size = named_group_size(group, device_num)
    if size:
        return size
    return 2 if primitive.op_type in ("Send", "Receive") else 0


def group_ranks(primitive) -> list:
    """The global ranks of a MindIR collective's group (its `group_rank_ids` tuple), or []
    when it does not list them."""
    for attribute in primitive.attribute:
        if attribute.name == "group_rank_ids":
            return [int(value.ints[0]) for value in attribute.values if len(value.ints)]
    return []


def one_line(err: BaseException) -> str:
    """MindSpore's error reduced to the line that says what was refused (its messages carry
    C++ call stacks and advice paragraphs)."""
    text = str(err)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("- C++ Call Stack") or line.startswith("- The Traceback"):
            break
        if not line or set(line) <= set("-") or line.startswith("- "):
            continue
        lines.append(line)
    message = " ".join(lines) or type(err).__name__
    message = re.sub(r"\s+", " ", message)
    return f"{type(err).__name__}: {message[:600]}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
