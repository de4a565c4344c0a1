"""Recording a network's primitive calls at real shapes without computing them.

MindSpore checks operator strategies only when it compiles on Ascend; the plan instead
builds the model folder's `build_train_network(config, compute_dtype)` at the config's
real dimensions under `mindspore.nn.utils.no_init_parameters()`, so no weight is allocated,
and runs its forward pass once in PyNative mode with every primitive's `__call__`
intercepted (`Recorder`). The interceptor records the primitive, the cell that owns it,
its `in_strategy` and its inputs, and returns outputs of the inferred shape *without
computing anything* (each operator's `shape` in `layout.operators.OPERATORS`). Large outputs
are lazy `Tensor(shape, dtype, init)` objects that hold no memory; outputs of at most
`SMALL_TENSOR` elements are real zero tensors, so that the Python-level arithmetic a model
may do on scalars (`total / count`) still runs.

Why this choice: a 100B model cannot be computed on a laptop, and computing at a reduced
hidden or vocabulary size could change a divisibility result. MindSpore 2.10 does not
expose its C++ shape inference to Python, and compiling the graph (which infers every shape)
needs Ascend for semi-auto parallel and takes minutes for deep models. Intercepting the
calls costs only Python time (about a second for 24 layers), sees exactly the operators and
shapes the model's `construct` produces, and needs no reduction at all: batch (the micro
batch each operator receives) and sequence stay at their real values, because nothing is
computed. An operator without a shape rule falls back to really running it on zero inputs
when they are small, and otherwise stops the plan with a message naming the operator.
`record(..., compute=True)` runs the real kernels instead (for tiny models): the tests use
it to check that the shape rules agree with MindSpore.
"""

import math
from contextlib import contextmanager
from typing import Dict, List, Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer

from model_zoo.layout.operators import operator, output_layout
from model_zoo.layout.recording import (OpCall, ParamInfo, PlanError, Recording, TensorInfo,
                                        dtype_name, strategy_of)

SMALL_TENSOR = 1 << 16
MAX_FALLBACK_ELEMENTS = 1 << 24

_NUMPY = {"Bool": np.bool_, "Int8": np.int8, "UInt8": np.uint8, "Int16": np.int16,
          "Float16": np.float16, "Int32": np.int32, "Float32": np.float32, "Int64": np.int64,
          "Float64": np.float64}


# --- walking a network's primitives ---------------------------------------------------------

def primitives(net: nn.Cell):
    """(cell name, cell, attribute, primitive) for every primitive held by every cell."""
    found = []
    for name, cell in net.cells_and_names():
        seen = set()
        candidates = list(cell._primitives.items()) + list(vars(cell).items())
        for attr, value in candidates:
            if isinstance(value, ops.Primitive) and id(value) not in seen:
                seen.add(id(value))
                found.append((name, cell, attr, value))
    return found


def stage_of(cell) -> Optional[int]:
    """A cell's `pipeline_stage`, or None when it was never set."""
    try:
        return cell.pipeline_stage
    except AttributeError:
        return None


# the recompute root of a cell's primitives marked `recompute()` (selective recompute)
RECOMPUTED_SEGMENT = "/recomputed"


def is_recomputed(cell) -> bool:
    """How MindSpore 2.10 records `Cell.recompute()`: the cell is flagged as configured and
    its scope (and its children's) is prefixed `recompute_`."""
    return bool(cell._has_config_recompute and (cell._scope or "").startswith("recompute_"))


# --- the recording --------------------------------------------------------------------------

class _NotComputed(Initializer):
    """Initializer of the recording's lazy tensors: they must never be materialised."""

    def _initialize(self, arr):
        raise PlanError(f"the plan does not compute tensors; something asked for the value of "
                        f"a {arr.shape} tensor")


def _make_tensor(shape, dtype):
    shape = tuple(int(d) for d in shape)
    name = dtype_name(dtype)
    if math.prod(shape) <= SMALL_TENSOR and name in _NUMPY:
        return Tensor(np.zeros(shape, _NUMPY[name]), dtype=dtype)
    return Tensor(shape=shape, dtype=dtype, init=_NotComputed())


def _materialise(value):
    """A computable copy of a lazy tensor (zeros), for the fallback path."""
    if isinstance(value, Tensor) and getattr(value, "has_init", False):
        return Tensor(np.zeros(tuple(value.shape), _NUMPY.get(dtype_name(value.dtype),
                                                               np.float32)), dtype=value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_materialise(v) for v in value)
    return value


def _all_primitive_classes():
    found, stack = set(), [ops.Primitive]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return [ops.Primitive] + sorted((c for c in found if "__call__" in vars(c)),
                                    key=lambda c: (c.__module__, c.__qualname__))


# Tensor operators implemented in C++ would bypass the primitive interceptor; during the
# recording they are routed through the functional ops (which call primitives).
_TENSOR_OPERATORS = {
    "__add__": lambda a, b: ops.add(a, b), "__radd__": lambda a, b: ops.add(b, a),
    "__sub__": lambda a, b: ops.sub(a, b), "__rsub__": lambda a, b: ops.sub(b, a),
    "__mul__": lambda a, b: ops.mul(a, b), "__rmul__": lambda a, b: ops.mul(b, a),
    "__truediv__": lambda a, b: ops.div(a, b), "__rtruediv__": lambda a, b: ops.div(b, a),
    "__neg__": lambda a: ops.neg(a),
}


class Recorder:
    """Records every outermost primitive call of a network's forward pass (see module doc)."""

    def __init__(self, net: nn.Cell, compute: bool = False, dataset_layout=None):
        self.net = net
        self.compute = compute
        self.dataset_layout = dataset_layout
        self.calls: List[OpCall] = []
        self.infos: Dict[int, TensorInfo] = {}
        self.keep_alive = []
        self.depth = 0
        self.cell_stack = []
        self.cell_names = {id(cell): name for name, cell in net.cells_and_names()}
        self.cells = dict(net.cells_and_names())
        self.owners = {id(prim): (f"{name}.{attr}" if name else attr)
                       for name, _, attr, prim in primitives(net)}
        recomputed = {name for name, cell in self.cells.items() if is_recomputed(cell)}
        self.recompute_roots = {name for name in recomputed
                                if _parent(name) not in recomputed or not name}
        self.checkpoints: Dict[str, List[TensorInfo]] = {}
        self.next_key = 0
        self.cast_keys = {}

    # tensors ----------------------------------------------------------------------------
    def _key(self):
        self.next_key += 1
        return self.next_key

    def info(self, value) -> Optional[TensorInfo]:
        """The TensorInfo of a tensor argument, registering unseen ones (params, constants)."""
        if not isinstance(value, Tensor):
            return None
        known = self.infos.get(id(value))
        if known is not None:
            return known
        param = value.name if isinstance(value, Parameter) else None
        info = TensorInfo(self._key(), tuple(value.shape), dtype_name(value.dtype),
                          needs_grad=bool(param and value.requires_grad), param=param)
        self._register(value, info)
        return info

    def _register(self, tensor, info):
        self.infos[id(tensor)] = info
        self.keep_alive.append(tensor)

    def register_input(self, tensor):
        info = self.info(tensor)
        info.network_input = True
        if self.dataset_layout and info.shape:
            info.layout = (self.dataset_layout,) + (1,) * (len(info.shape) - 1)
        return info

    # cells ------------------------------------------------------------------------------
    def _cell_path(self):
        for cell in reversed(self.cell_stack):
            name = self.cell_names.get(id(cell))
            if name is not None:
                return name
        return ""

    def _stage(self):
        """The pipeline stage of the innermost enclosing cell that has one, else None."""
        for cell in reversed(self.cell_stack):
            stage = stage_of(cell)
            if stage is not None:
                return stage
        return None

    def place_unstaged(self):
        """Operators outside every staged cell run where their users are (MindSpore places
        them with their consumers), else with their producers, else on stage 0."""
        consumers = {}
        for call in self.calls:
            for info in call.tensors:
                consumers.setdefault(id(info), []).append(call)
        for call in reversed(self.calls):
            if call.staged:
                continue
            users = [c.stage for out in call.outputs for c in consumers.get(id(out), [])]
            if users:
                call.stage = min(users)
        for call in self.calls:
            if not call.staged and not any(c for out in call.outputs
                                           for c in consumers.get(id(out), [])):
                producers = [self.calls[t.producer].stage for t in call.tensors
                             if t.producer is not None]
                call.stage = max(producers) if producers else 0

    def _recompute_root(self, prim):
        """The outermost recomputed cell the call runs in; else, for a primitive marked
        `recompute()` (selective recompute), its cell's recomputed operators as a segment
        of their own, `<cell path>/recomputed`."""
        for cell in self.cell_stack:
            name = self.cell_names.get(id(cell))
            if name in self.recompute_roots:
                return name
        if prim.attrs.get("recompute"):
            return f"{self._cell_path()}{RECOMPUTED_SEGMENT}"
        return None

    def segment_checkpoints(self):
        """The inputs each segment of recomputed primitives recomputes from: the tensors its
        calls read that no call of the segment made (the cell-level roots record their
        cell's inputs as it is entered)."""
        made = {}
        for call in self.calls:
            root = call.recompute_root
            if root and root.endswith(RECOMPUTED_SEGMENT):
                made.setdefault(root, set()).update(out.key for out in call.outputs)
        for call in self.calls:
            root = call.recompute_root
            if root in made:
                kept = self.checkpoints.setdefault(root, [])
                for info in call.tensors:
                    if info.key not in made[root]:
                        made[root].add(info.key)   # kept once
                        kept.append(info)

    # the interceptors ---------------------------------------------------------------------
    def _on_cell(self, original, cell, args, kwargs):
        name = self.cell_names.get(id(cell))
        if name in self.recompute_roots and name not in self.checkpoints:
            self.checkpoints[name] = [i for i in (self.info(a) for a in _flat(args))
                                      if i is not None]
        self.cell_stack.append(cell)
        try:
            return original(cell, *args, **kwargs)
        finally:
            self.cell_stack.pop()

    def _on_primitive(self, original, prim, args, kwargs):
        if self.depth:
            return original(prim, *args, **kwargs)
        self.depth += 1
        try:
            return self._record(original, prim, args, kwargs)
        finally:
            self.depth -= 1

    def _record(self, original, prim, args, kwargs):
        recorded_args = []
        for arg in args:
            if isinstance(arg, Tensor):
                recorded_args.append(self.info(arg))
            elif isinstance(arg, (tuple, list)) and any(isinstance(a, Tensor) for a in arg):
                recorded_args.append([self.info(a) if isinstance(a, Tensor) else a for a in arg])
            else:
                recorded_args.append(arg)
        name = prim.name
        path = self.owners.get(id(prim)) or f"{self._cell_path() or '<network>'}/{name}"
        stage = self._stage()
        call = OpCall(len(self.calls), name, path, self._cell_path(), prim, strategy_of(prim),
                      recorded_args, [], 0 if stage is None else stage, self._recompute_root(prim),
                      staged=stage is not None)
        if self.compute:
            result = original(prim, *args, **kwargs)
        else:
            result = self._infer(original, prim, call, args, kwargs)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        for position, out in enumerate(outputs):
            if isinstance(out, Tensor):
                call.outputs.append(self._output_info(call, position, out))
        self.calls.append(call)
        return result

    def _infer(self, original, prim, call, args, kwargs):
        rule = operator(prim.name).shape
        if rule is not None and not kwargs:
            try:
                specs, as_tuple = rule(call, args)
            except (KeyError, IndexError, TypeError, ValueError) as err:
                raise PlanError(f"{call.path} ({prim.name}): cannot infer its output shape "
                                f"from inputs {_describe(call)}: {err}") from None
            outputs = [_make_tensor(shape, dtype) for shape, dtype in specs]
            return tuple(outputs) if as_tuple else outputs[0]
        size = sum(t.numel for t in call.tensors)
        if size > MAX_FALLBACK_ELEMENTS:
            raise PlanError(f"{call.path} ({prim.name}): the plan has no shape rule for "
                            f"{prim.name} and its inputs are too large to compute on a laptop; "
                            f"add its entry to model_zoo.layout.operators.OPERATORS")
        return original(prim, *_materialise(args), **kwargs)

    def _output_info(self, call, position, tensor) -> TensorInfo:
        dtype = dtype_name(tensor.dtype)
        tensor_inputs = call.tensors
        entry = operator(call.name)
        needs_grad = (entry.gradient and dtype.startswith(("Float", "BFloat"))
                      and position not in entry.auxiliary_outputs
                      and any(t.needs_grad for t in tensor_inputs))
        key, param = None, None
        if call.name == "Cast" and tensor_inputs:
            source = tensor_inputs[0]
            param = source.param
            key = source.key if source.dtype == dtype else self.cast_keys.setdefault(
                (source.key, dtype), self._key())
        elif entry.view and tensor_inputs:
            # a view shares its input's memory: the same tensor for the memory model
            key, param = tensor_inputs[0].key, tensor_inputs[0].param
        info = TensorInfo(key or self._key(), tuple(tensor.shape), dtype, needs_grad=needs_grad,
                          param=param, producer=call.index,
                          layout=output_layout(call, position, tuple(tensor.shape)))
        self._register(tensor, info)
        return info

    @contextmanager
    def active(self):
        """Patch Cell and Primitive calls (and Tensor operators) for the duration."""
        recorder = self
        saved = []

        def patch(owner, attr, function):
            saved.append((owner, attr, vars(owner).get(attr, _MISSING)))
            setattr(owner, attr, function)

        original_cell_call = nn.Cell.__call__

        def cell_call(cell, *args, **kwargs):
            return recorder._on_cell(original_cell_call, cell, args, kwargs)

        patch(nn.Cell, "__call__", cell_call)
        if not self.compute:
            # PyNative initialises a cell's parameters on its first call (Cell._init_check);
            # the shape-only recording must leave them unallocated.
            for cell in self.cells.values():
                saved.append((cell, "_init_flag", cell._init_flag))
                object.__setattr__(cell, "_init_flag", True)
        for cls in _all_primitive_classes():
            original = vars(cls)["__call__"]

            def call(prim, *args, _original=original, **kwargs):
                return recorder._on_primitive(_original, prim, args, kwargs)

            patch(cls, "__call__", call)
        for attr, function in _TENSOR_OPERATORS.items():
            patch(Tensor, attr, function)
        try:
            yield self
        finally:
            for owner, attr, value in reversed(saved):
                if value is _MISSING:
                    delattr(owner, attr)
                elif isinstance(owner, nn.Cell):
                    object.__setattr__(owner, attr, value)
                else:
                    setattr(owner, attr, value)


_MISSING = object()


def _flat(values):
    """The values of a call's arguments, those inside tuples and lists (a block's rotary
    (cos, sin), a decoding cache) included."""
    for value in values:
        if isinstance(value, (tuple, list)):
            yield from _flat(value)
        else:
            yield value


def _parent(path: str) -> Optional[str]:
    return path.rsplit(".", 1)[0] if "." in path else ("" if path else None)


def record(net: nn.Cell, inputs, *, compute: bool = False, stages: int = 1,
           dataset_layout: Optional[int] = None) -> Recording:
    """Run `net`'s forward pass once in PyNative mode and record every primitive call.

    Args:
        net: the network (built under `no_init_parameters()` unless compute is True).
        inputs: its input tensors, or (shape, dtype) pairs.
        compute: run the real kernels (tiny models) instead of the shape rules.
        stages: pipeline stages, to check parameters' stages.
        dataset_layout: the split of dimension 0 of every network input as the dataset
            strategy feeds it (devices per stage for "data_parallel", None for full batch).
    """
    tensors = [value if isinstance(value, Tensor) else _make_tensor(*value) for value in inputs]
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    training = net.training
    net.set_train(True)
    recorder = Recorder(net, compute=compute, dataset_layout=dataset_layout)
    try:
        with recorder.active():
            input_infos = [recorder.register_input(t) for t in tensors]
            try:
                output = net(*tensors)
            except RuntimeError as err:
                last = recorder.calls[-1].path if recorder.calls else "the first operator"
                raise PlanError(f"the forward pass could not be recorded after {last}: "
                                f"{str(err).splitlines()[0]}") from None
    finally:
        net.set_train(training)
        ms.set_context(mode=mode)
    recorder.place_unstaged()
    recorder.segment_checkpoints()
    return Recording(recorder.calls, _parameters(net, recorder), recorder.checkpoints,
                     input_infos, stages, output)


def _parameters(net, recorder) -> Dict[str, ParamInfo]:
    """Every parameter with its stage and the split its strategy-bearing users give it."""
    cells = recorder.cells
    params = {}
    for name, param in net.parameters_and_names():
        path = name.split(".")[:-1]
        stage = 0
        for depth in range(len(path), -1, -1):
            cell = cells.get(".".join(path[:depth]))
            if cell is not None and stage_of(cell) is not None:
                stage = stage_of(cell)
                break
        params[param.name] = ParamInfo(param.name, tuple(param.shape),
                                       dtype_name(param.dtype), stage, param.requires_grad,
                                       parallel_optimizer=param.parallel_optimizer)
    for call in recorder.calls:
        for index, tensor in enumerate(call.tensors):
            if tensor.param in params:
                params[tensor.param].used_on_stages.add(call.stage)
                if call.strategy is not None and index < len(call.strategy):
                    split = call.strategy[index]
                    if len(split) == len(params[tensor.param].shape):
                        params[tensor.param].consumers.append((call.path, index, split))
                        if params[tensor.param].split is None:
                            params[tensor.param].split = split
    return params


def _describe(call) -> str:
    return ", ".join(str(t.shape) if isinstance(t, TensorInfo) else repr(t) for t in call.args)
