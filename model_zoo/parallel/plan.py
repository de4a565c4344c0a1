"""Offline check and cost of a parallel layout: `model-zoo plan CONFIG [--device-num N]`.

MindSpore checks operator strategies only when it compiles on Ascend, so a wrong strategy,
or a layout that does not fit in device memory, shows up after a cluster job has queued
and started. This module finds both on a laptop, for any device count:

1. the layout itself (device number, dp x mp x pp, layers per stage, micro batches, batch);
2. every operator that carries a strategy, against the shapes it really receives, by
   MindSpore's rules as `MINDSPORE_PARALLEL_RULES.md` records them (tags G1-G10 there);
3. memory per device and communication per step (`model_zoo.parallel.cost`).

How shapes are recorded
-----------------------
The model folder's `build_train_network(config, compute_dtype)` is built at the config's
real dimensions under `mindspore.nn.utils.no_init_parameters()`, so no weight is allocated.
Its forward pass then runs once in PyNative mode with every primitive's `__call__`
intercepted (`Recorder`): the interceptor records the primitive, the cell that owns it,
its `in_strategy` and its inputs, and returns outputs of the inferred shape *without
computing anything* (`SHAPE_RULES`, one small function per operator). Large outputs are
lazy `Tensor(shape, dtype, init)` objects that hold no memory; outputs of at most
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

The model folder contract: `build_train_network(config, compute_dtype)`, and optionally
`plan_inputs(config, batch_size) -> [(shape, dtype), ...]`, the network's inputs for one
micro batch. Without it the network must take a single batch of token ids of
`model.seq_length + 1` tokens (a language model's next-token sample).
"""

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer

from model_zoo.errors import ConfigError, UserInputError
from model_zoo.parallel.config import ParallelConfig

SMALL_TENSOR = 1 << 16
MAX_FALLBACK_ELEMENTS = 1 << 24

DEVICES = {
    "ascend910": ("Ascend 910", 32 * 2 ** 30),
    "ascend910b": ("Ascend 910B", 64 * 2 ** 30),
}

_ITEMSIZE = {"Bool": 1, "Int8": 1, "UInt8": 1, "Int16": 2, "UInt16": 2, "Float16": 2,
             "BFloat16": 2, "Int32": 4, "UInt32": 4, "Float32": 4, "Int64": 8, "UInt64": 8,
             "Float64": 8}
_NUMPY = {"Bool": np.bool_, "Int8": np.int8, "UInt8": np.uint8, "Int16": np.int16,
          "Float16": np.float16, "Int32": np.int32, "Float32": np.float32, "Int64": np.int64,
          "Float64": np.float64}


class PlanError(UserInputError):
    """The plan cannot record the model (e.g. an operator without a shape rule)."""


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


def strategy_of(prim, attr: str = "in_strategy") -> Optional[tuple]:
    """The strategy `.shard()` recorded (`attr="out_strategy"`: its output strategy):
    MindSpore 2.10 keeps both in the primitive's attrs."""
    value = prim.attrs.get(attr)
    if value is None:
        return None
    return tuple(tuple(int(v) for v in part) for part in value)


def stage_of(cell) -> Optional[int]:
    """A cell's `pipeline_stage`, or None when it was never set."""
    try:
        return cell.pipeline_stage
    except AttributeError:
        return None


def is_recomputed(cell) -> bool:
    """How MindSpore 2.10 records `Cell.recompute()`: the cell is flagged as configured and
    its scope (and its children's) is prefixed `recompute_`."""
    return bool(cell._has_config_recompute and (cell._scope or "").startswith("recompute_"))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("mindspore.", "")


def itemsize(dtype) -> int:
    return _ITEMSIZE.get(_dtype_name(dtype), 4)


# --- the recording --------------------------------------------------------------------------

@dataclass
class TensorInfo:
    """What the recording knows about one tensor.

    key: identity for de-duplication; a Cast to the same dtype shares its input's key and
        repeated Casts of one tensor to one dtype share a key (MindSpore's graph optimiser
        merges them), so a tensor saved by several operators counts once.
    param: the parameter this tensor is (or is a cast of).
    producer: index of the call that produced it (None for inputs, parameters, constants).
    layout: splits per dimension as the producer leaves it (None when unknown).
    """

    key: int
    shape: tuple
    dtype: str
    needs_grad: bool = False
    param: Optional[str] = None
    producer: Optional[int] = None
    layout: Optional[tuple] = None
    network_input: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass
class OpCall:
    """One primitive call of the recorded forward pass."""

    index: int
    name: str                 # primitive name, e.g. MatMul
    path: str                 # owner cell path + attribute, or enclosing cell + /Name
    cell: str                 # the innermost enclosing cell
    prim: Any
    strategy: Optional[tuple]
    args: list                # TensorInfo for tensors (lists for tuples of tensors), else value
    outputs: List[TensorInfo]
    stage: int
    recompute_root: Optional[str]   # outermost recomputed cell this call runs in
    staged: bool = True       # the stage comes from an enclosing cell's pipeline_stage

    @property
    def out_strategy(self) -> Optional[tuple]:
        """The output strategy given to `.shard()`, or None (rule G6)."""
        return strategy_of(self.prim, "out_strategy")

    @property
    def tensors(self) -> List[TensorInfo]:
        """Tensor inputs in order, tuples of tensors flattened (the strategy's order)."""
        found = []
        for arg in self.args:
            if isinstance(arg, TensorInfo):
                found.append(arg)
            elif isinstance(arg, list):
                found.extend(a for a in arg if isinstance(a, TensorInfo))
        return found

    def attr(self, name, default=None):
        value = self.prim.attrs.get(name, None)
        if value is None:
            value = getattr(self.prim, name, default)
        return value


@dataclass
class ParamInfo:
    name: str
    shape: tuple
    dtype: str
    stage: int
    requires_grad: bool
    split: Optional[tuple] = None            # from its strategy-bearing consumers
    consumers: List[Tuple[str, int, tuple]] = field(default_factory=list)
    used_on_stages: set = field(default_factory=set)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slice_numel(self) -> int:
        return self.numel // math.prod(self.split) if self.split else self.numel

    @property
    def nbytes(self) -> int:
        """Size of the whole parameter in its own dtype."""
        return self.numel * itemsize(self.dtype)


@dataclass
class Recording:
    calls: List[OpCall]
    params: Dict[str, ParamInfo]
    checkpoints: Dict[str, List[TensorInfo]]   # recomputed cell path -> its input tensors
    inputs: List[TensorInfo]
    stages: int
    output: Any = None          # what the network returned (zeros unless compute=True)

    def strategy_calls(self) -> List[OpCall]:
        return [call for call in self.calls if call.strategy is not None]


class _NotComputed(Initializer):
    """Initializer of the recording's lazy tensors: they must never be materialised."""

    def _initialize(self, arr):
        raise PlanError(f"the plan does not compute tensors; something asked for the value of "
                        f"a {arr.shape} tensor")


def _make_tensor(shape, dtype):
    shape = tuple(int(d) for d in shape)
    name = _dtype_name(dtype)
    if math.prod(shape) <= SMALL_TENSOR and name in _NUMPY:
        return Tensor(np.zeros(shape, _NUMPY[name]), dtype=dtype)
    return Tensor(shape=shape, dtype=dtype, init=_NotComputed())


def _materialise(value):
    """A computable copy of a lazy tensor (zeros), for the fallback path."""
    if isinstance(value, Tensor) and getattr(value, "has_init", False):
        return Tensor(np.zeros(tuple(value.shape), _NUMPY.get(_dtype_name(value.dtype),
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
        info = TensorInfo(self._key(), tuple(value.shape), _dtype_name(value.dtype),
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

    def _recompute_root(self):
        for cell in self.cell_stack:
            name = self.cell_names.get(id(cell))
            if name in self.recompute_roots:
                return name
        return None

    # the interceptors ---------------------------------------------------------------------
    def _on_cell(self, original, cell, args, kwargs):
        name = self.cell_names.get(id(cell))
        if name in self.recompute_roots and name not in self.checkpoints:
            self.checkpoints[name] = [i for i in (self.info(a) for a in args) if i is not None]
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
                      recorded_args, [], 0 if stage is None else stage, self._recompute_root(),
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
        rule = SHAPE_RULES.get(prim.name)
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
                            f"add a rule to model_zoo.parallel.plan.SHAPE_RULES")
        return original(prim, *_materialise(args), **kwargs)

    def _output_info(self, call, position, tensor) -> TensorInfo:
        dtype = _dtype_name(tensor.dtype)
        tensor_inputs = call.tensors
        needs_grad = (call.name not in NO_GRADIENT and dtype.startswith(("Float", "BFloat"))
                      and position not in AUXILIARY_OUTPUTS.get(call.name, ())
                      and any(t.needs_grad for t in tensor_inputs))
        key, param = None, None
        if call.name == "Cast" and tensor_inputs:
            source = tensor_inputs[0]
            param = source.param
            key = source.key if source.dtype == dtype else self.cast_keys.setdefault(
                (source.key, dtype), self._key())
        elif call.name in VIEWS and tensor_inputs:
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
                                       _dtype_name(param.dtype), stage, param.requires_grad)
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


# --- shape rules: output (shape, dtype) of each operator, without computing ------------------

def _shape(value) -> tuple:
    return tuple(value.shape) if isinstance(value, Tensor) else ()


def _dtype(value):
    if isinstance(value, Tensor):
        return value.dtype
    if isinstance(value, bool):
        return ms.bool_
    return ms.int64 if isinstance(value, int) else ms.float32


def broadcast_shapes(*shapes) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _first_tensor_dtype(args):
    for arg in args:
        if isinstance(arg, Tensor):
            return arg.dtype
    return _dtype(args[0])


def _same(call, args):
    return [(_shape(args[0]), _dtype(args[0]))], False


def _elementwise(call, args):
    tensors = [a for a in args if isinstance(a, (Tensor, int, float, bool))]
    return [(broadcast_shapes(*[_shape(a) for a in tensors]), _first_tensor_dtype(args))], False


def _compare(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:2]]), ms.bool_)], False


def _select(call, args):
    return [(broadcast_shapes(*[_shape(a) for a in args[:3]]), _dtype(args[1]))], False


def _cast(call, args):
    return [(_shape(args[0]), args[1])], False


def _reshape(call, args):
    shape, target = _shape(args[0]), list(args[1])
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = math.prod(shape) // known
    if math.prod(target) != math.prod(shape):
        raise ValueError(f"cannot reshape {shape} to {tuple(args[1])}")
    return [(tuple(target), _dtype(args[0]))], False


def _transpose(call, args):
    shape = _shape(args[0])
    return [(tuple(shape[p] for p in args[1]), _dtype(args[0]))], False


def _matmul_shape(call, x, w):
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m = x[-1] if ta else x[-2]
    k_x = x[-2] if ta else x[-1]
    k_w = w[-1] if tb else w[-2]
    n = w[-2] if tb else w[-1]
    if k_x != k_w:
        raise ValueError(f"contracted sizes differ: {k_x} and {k_w}")
    return broadcast_shapes(x[:-2], w[:-2]) + (m, n)


def _matmul(call, args):
    return [(_matmul_shape(call, _shape(args[0]), _shape(args[1])), _dtype(args[0]))], False


def _strided_slice(call, args):
    shape = _shape(args[0])
    begin, end, strides = args[1], args[2], args[3]
    for mask in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"):
        if call.attr(mask, 0):
            raise ValueError(f"{mask} is not supported by the plan's shape rule")
    out = list(shape)
    for d, (b, e, s) in enumerate(zip(begin, end, strides)):
        size = shape[d]
        b = min(max(b + size if b < 0 else b, 0), size)
        e = min(max(e + size if e < 0 else e, 0), size)
        out[d] = max(0, -(-(e - b) // s))
    return [(tuple(out), _dtype(args[0]))], False


def _gather(call, args):
    param, indices, axis = _shape(args[0]), _shape(args[1]), int(args[2])
    axis = axis % len(param)
    return [(param[:axis] + indices + param[axis + 1:], _dtype(args[0]))], False


def _one_hot(call, args):
    axis = call.attr("axis", -1)
    shape = list(_shape(args[0]))
    shape.insert(len(shape) if axis == -1 else axis, int(args[1]))
    return [(tuple(shape), _dtype(args[2]))], False


def _softmax_cross_entropy(call, args):
    logits = _shape(args[0])
    return [(logits[:1], _dtype(args[0])), (logits, _dtype(args[0]))], True


def _layer_norm(call, args):
    shape = _shape(args[0])
    axis = call.attr("begin_norm_axis", -1) % len(shape)
    stats = shape[:axis] + (1,) * (len(shape) - axis)
    return [(shape, _dtype(args[0])), (stats, ms.float32), (stats, ms.float32)], True


def _reduce(call, args):
    shape = _shape(args[0])
    axis = args[1] if len(args) > 1 else ()
    axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
    axes = {a % len(shape) for a in axis} if axis else set(range(len(shape)))
    if call.attr("keep_dims", False):
        out = tuple(1 if d in axes else s for d, s in enumerate(shape))
    else:
        out = tuple(s for d, s in enumerate(shape) if d not in axes)
    return [(out, _dtype(args[0]))], False


def _fill_like_shape(call, args):
    shape = args[0]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = args[1] if len(args) > 1 and args[1] is not None else ms.float32
    return [(shape, dtype)], False


def _dropout(call, args):
    return [(_shape(args[0]), _dtype(args[0])), (_shape(args[0]), _dtype(args[0]))], True


def _expand_dims(call, args):
    shape = list(_shape(args[0]))
    axis = int(args[1])
    shape.insert(axis % (len(shape) + 1), 1)
    return [(tuple(shape), _dtype(args[0]))], False


def _squeeze(call, args):
    shape = _shape(args[0])
    axis = call.attr("axis", ())
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = {a % len(shape) for a in axis} if axis else {d for d, s in enumerate(shape) if s == 1}
    return [(tuple(s for d, s in enumerate(shape) if d not in axes), _dtype(args[0]))], False


def _tile(call, args):
    shape, multiples = _shape(args[0]), tuple(args[1])
    shape = (1,) * (len(multiples) - len(shape)) + shape
    return [(tuple(s * m for s, m in zip(shape, multiples)), _dtype(args[0]))], False


def _concat(call, args):
    tensors = list(args[0])
    axis = int(args[1]) if len(args) > 1 else int(call.attr("axis", 0))
    shape = list(_shape(tensors[0]))
    axis %= len(shape)
    shape[axis] = sum(_shape(t)[axis] for t in tensors)
    return [(tuple(shape), _dtype(tensors[0]))], False


def _flash_attention(call, args):
    """FlashAttentionScore (BNSD): softmax max and sum (B, N, S1, 8) float32, an unused
    output, and the attention output shaped like the query."""
    query = _shape(args[0])
    stats = (query[:3] + (8,), ms.float32)
    return [stats, stats, ((), _dtype(args[0])), (query, _dtype(args[0]))], True


SHAPE_RULES = {
    "Cast": _cast, "Reshape": _reshape, "Transpose": _transpose, "MatMul": _matmul,
    "BatchMatMul": _matmul, "StridedSlice": _strided_slice, "Gather": _gather,
    "OneHot": _one_hot, "SoftmaxCrossEntropyWithLogits": _softmax_cross_entropy,
    "LayerNorm": _layer_norm, "ReduceSum": _reduce, "ReduceMean": _reduce,
    "ReduceMax": _reduce, "ReduceMin": _reduce, "Ones": _fill_like_shape,
    "Zeros": _fill_like_shape, "Dropout": _dropout, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "Tile": _tile, "Concat": _concat, "Select": _select,
    "FlashAttentionScore": _flash_attention,
}
for _name in ("Add", "Sub", "Mul", "Div", "RealDiv", "Maximum", "Minimum", "Pow", "BiasAdd",
              "FloorDiv", "AddExt", "SubExt", "Muls", "Divs"):
    SHAPE_RULES[_name] = _elementwise
for _name in ("Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
              "LogicalAnd", "LogicalOr"):
    SHAPE_RULES[_name] = _compare
for _name in ("GeLU", "FastGeLU", "ReLU", "Tanh", "Sigmoid", "Erf", "Exp", "Log", "Neg", "Sqrt",
              "Rsqrt", "Square", "Abs", "Softmax", "LogSoftmax", "ZerosLike", "OnesLike",
              "Identity", "LogicalNot", "Reciprocal", "SiLU"):
    SHAPE_RULES[_name] = _same

VIEWS = {"Reshape", "ExpandDims", "Squeeze"}

# outputs that only serve the operator's own backward pass (statistics, masks, gradients)
AUXILIARY_OUTPUTS = {"LayerNorm": (1, 2), "Dropout": (1,), "SoftmaxCrossEntropyWithLogits": (1,)}

NO_GRADIENT = {"OneHot", "Ones", "Zeros", "ZerosLike", "OnesLike", "Equal", "NotEqual", "Less",
               "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr",
               "LogicalNot", "StopGradient"}


# --- output layouts (for redistribution and memory) -----------------------------------------

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "RealDiv", "Maximum", "Minimum", "Pow", "BiasAdd",
               "FloorDiv", "Select", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
               "GreaterEqual", "LogicalAnd", "LogicalOr"}


def _right_aligned_max(parts, rank):
    out = [1] * rank
    for part in parts:
        for d, value in enumerate(part):
            position = rank - len(part) + d
            if position >= 0:
                out[position] = max(out[position], value)
    return tuple(out)


def output_layout(call: OpCall, position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` (see `_output_layout`), or None."""
    layout = _output_layout(call, position, shape)
    if layout is None or len(layout) != len(shape):
        return None
    return tuple(layout)


def _output_layout(call: OpCall, position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` as the operator leaves it, or None.

    Operators with a strategy follow MindSpore's output tensor layouts (a contracted or
    reduced dimension is summed away, so it is not split afterwards); Cast and Reshape pass
    their input's layout on; other operators without a strategy are unknown.
    """
    strategy, rank = call.strategy, len(shape)
    tensors = call.tensors
    if strategy is None:
        if not tensors or tensors[0].layout is None:
            return None
        if call.name == "Cast":
            return tensors[0].layout
        if call.name == "Reshape":
            return reshape_layout(tensors[0].shape, tensors[0].layout, shape)
        return None
    if len(strategy) != len(tensors) and call.name != "OneHot":
        return None
    name = call.name
    try:
        if name == "MatMul" and call.out_strategy:   # checked by rule G6
            return call.out_strategy[0]
        if name in ("MatMul", "BatchMatMul"):
            x, w = strategy[0], strategy[1]
            ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
            m = x[-1] if ta else x[-2]
            n = w[-2] if tb else w[-1]
            return _right_aligned_max([x[:-2], w[:-2]], rank - 2) + (m, n)
        if name == "Gather":
            axis = int(call.args[2]) % len(strategy[0])
            return strategy[0][:axis] + strategy[1] + strategy[0][axis + 1:]
        if name == "OneHot":
            return strategy[0]
        if name == "SoftmaxCrossEntropyWithLogits":
            return strategy[0][:1] if position == 0 else strategy[0]
        if name == "LayerNorm":
            axis = call.attr("begin_norm_axis", -1) % len(strategy[0])
            return strategy[0] if position == 0 else strategy[0][:axis] + (1,) * (rank - axis)
        if name in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"):
            axis = call.args[1] if len(call.args) > 1 else ()
            axis = (axis,) if isinstance(axis, int) else tuple(axis or ())
            axes = ({a % len(strategy[0]) for a in axis} if axis
                    else set(range(len(strategy[0]))))
            if call.attr("keep_dims", False):
                return tuple(1 if d in axes else s for d, s in enumerate(strategy[0]))
            return tuple(s for d, s in enumerate(strategy[0]) if d not in axes)
        if name == "Transpose":
            return tuple(strategy[0][p] for p in call.args[1])
        if name in ELEMENTWISE:
            return _right_aligned_max(strategy, rank)
        if len(strategy[0]) == rank:
            return strategy[0]
    except (IndexError, TypeError):
        return None
    return None


def reshape_layout(in_shape, in_layout, out_shape) -> Optional[tuple]:
    """The layout a Reshape leaves, when MindSpore can keep the slices where they are.

    Dimensions are matched in groups of equal products. A group's slices must be contiguous
    chunks of its row-major order: every dimension before its innermost split one is split
    into single indices (e.g. (batch, seq) split (batch, k): each device holds one sequence's
    k-th part) or has size 1. The group's split P then goes to its output dimensions from
    the outermost on: a dimension of size n takes all of P if P divides n, else n (one index
    per device) when n divides P, leaving P / n for the next. This is how (tokens, hidden)
    split (dp*mp, 1) reads as (batch, seq, hidden). Anything else needs a redistribution
    whose cost is not modelled: None (unknown).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if len(in_layout) != len(in_shape) or math.prod(in_shape) != math.prod(out_shape):
        return None
    out_layout = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        group_in, group_out = [], []
        product_in = product_out = 1
        while True:
            if product_in <= product_out and i < len(in_shape) and (
                    not group_in or product_in < product_out):
                group_in.append(i)
                product_in *= in_shape[i]
                i += 1
            elif product_out < product_in and j < len(out_shape) or (
                    not group_out and j < len(out_shape)):
                group_out.append(j)
                product_out *= out_shape[j]
                j += 1
            else:
                break
            if product_in == product_out and group_in and group_out:
                break
        if product_in != product_out:
            return None
        split_dims = [d for d in group_in if in_layout[d] != 1]
        if split_dims and any(in_layout[d] != in_shape[d] for d in group_in
                              if d < split_dims[-1] and in_shape[d] > 1):
            return None
        split = math.prod(in_layout[d] for d in group_in)
        layout = [1] * len(group_out)
        for position, d in enumerate(group_out):
            if split == 1:
                break
            if out_shape[d] % split == 0:
                layout[position], split = split, 1
            elif out_shape[d] > 1 and split % out_shape[d] == 0:
                layout[position], split = out_shape[d], split // out_shape[d]
            elif out_shape[d] > 1:
                return None
        if split != 1:
            return None
        out_layout.extend(layout)
    return tuple(out_layout) if len(out_layout) == len(out_shape) else None


# --- the rules --------------------------------------------------------------------------------

@dataclass
class Violation:
    """A broken rule: where (cell path, operator, input, dimension) and why."""

    rule: str
    message: str
    path: str = ""
    op: str = ""
    input: Optional[int] = None
    dim: Optional[int] = None

    def __str__(self):
        where = f"{self.path} ({self.op})" if self.path else "layout"
        if self.input is not None:
            where += f" input {self.input}"
        if self.dim is not None:
            where += f" dimension {self.dim}"
        return f"{where}: {self.message} [{self.rule}]"

    def to_dict(self):
        return {"rule": self.rule, "path": self.path, "op": self.op, "input": self.input,
                "dim": self.dim, "message": self.message, "text": str(self)}


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def matmul_dims(call: OpCall, strategy=None):
    """(batch splits, m, k of x, k of w, n) of a MatMul/BatchMatMul strategy."""
    x, w = strategy or call.strategy
    ta, tb = bool(call.attr("transpose_a", False)), bool(call.attr("transpose_b", False))
    m, k_x = (x[-1], x[-2]) if ta else (x[-2], x[-1])
    k_w, n = (w[-1], w[-2]) if tb else (w[-2], w[-1])
    batch = _right_aligned_max([x[:-2], w[:-2]], max(len(x), len(w)) - 2)
    return batch, m, k_x, k_w, n


def device_matrix(call: OpCall) -> tuple:
    """The operator's device matrix as MindSpore forms it (rule G4).

    MatMul/BatchMatMul: batch splits then [m, k, n]; Gather: the indices' strategy then the
    table's; OneHot: its (output) strategy; element-wise and the others: the inputs'
    strategies right-aligned, the largest split of each dimension.
    """
    strategy = call.strategy
    if call.name in ("MatMul", "BatchMatMul"):
        batch, m, k_x, _, n = matmul_dims(call)
        return batch + (m, k_x, n)
    if call.name == "Gather":
        return strategy[1] + strategy[0]
    if call.name == "OneHot":
        return strategy[0]
    return _right_aligned_max(strategy, max(len(part) for part in strategy))


def _input_shapes(call: OpCall) -> List[tuple]:
    shapes = [t.shape for t in call.tensors]
    if call.name == "OneHot" and shapes:
        axis = call.attr("axis", -1)
        shape = list(shapes[0])
        shape.insert(len(shape) if axis == -1 else axis, int(call.args[1]))
        shapes[0] = tuple(shape)
    return shapes


def check_call(call: OpCall, devices_per_stage: int, device_num: int) -> List[Violation]:
    """Every rule one strategy-bearing call must satisfy."""
    found = []
    strategy, name = call.strategy, call.name

    def violation(rule, message, index=None, dim=None):
        found.append(Violation(rule, message, call.path, name, index, dim))

    shapes = _input_shapes(call)
    described = f"strategy {strategy} for input shapes {tuple(shapes)}"
    if len(strategy) != len(shapes):
        violation("G1", f"{len(strategy)} strategy tuples for {len(shapes)} tensor inputs "
                        f"({described})")
        return found
    for index, (part, shape) in enumerate(zip(strategy, shapes)):
        if len(part) != len(shape):
            violation("G1", f"strategy {part} has {len(part)} values but the input {shape} "
                            f"has rank {len(shape)}", index)
            continue
        for dim, (split, size) in enumerate(zip(part, shape)):
            if split < 1 or size % split:
                violation("G2", f"split {split} does not divide size {size} of input shape "
                                f"{shape} (strategy {part})", index, dim)
            elif is_power_of_two(device_num) and not is_power_of_two(split):
                violation("G3", f"split {split} is not a power of 2 (device number "
                                f"{device_num})", index, dim)
    if found:
        return found
    matrix = device_matrix(call)
    product = math.prod(matrix)
    if devices_per_stage % product:
        violation("G4", f"device matrix {matrix} (product {product}) does not divide the "
                        f"{devices_per_stage} devices of a pipeline stage ({described})")
    check = OPERATOR_RULES.get(name)
    if check is None and name in ELEMENTWISE:
        check = _check_broadcast
    if check is not None:
        check(call, shapes, violation, devices_per_stage)
    if call.out_strategy is not None:
        _check_output_strategy(call, shapes, violation)
    return found


def _check_output_strategy(call, shapes, violation):
    """Rule G6: only a 2-D MatMul takes an output strategy here (MindSpore accepts one for
    a few other operators, e.g. an axis-0 Gather, which no layer uses and the plan does not
    model). For x (a, b) and
    a weight split c ways on n, it is (a, c) (all-reduce of the partial sums) or (a*b, c)
    (reduce-scatter over the b group, the rows split a*b ways) [matmul_info.cc
    CheckOutputStrategy]."""
    out = call.out_strategy
    if call.name != "MatMul":
        violation("G6", f"output strategy {out}: the plan models output strategies only for "
                        f"a 2-D MatMul (MindSpore rejects them for most operators)")
        return
    if any(len(shape) != 2 for shape in shapes):
        violation("G6", f"output strategy {out} needs 2-D MatMul inputs, got shapes "
                        f"{tuple(shapes)}")
        return
    if len(out) != 1 or len(out[0]) != 2:
        violation("G6", f"output strategy {out} must be one tuple of 2 values")
        return
    _, m, k, _, n = matmul_dims(call)
    rows, columns = out[0]
    out_shape = call.outputs[0].shape if call.outputs else None
    if columns != n:
        violation("G6", f"output strategy {out}: the columns must be split {n} like the "
                        f"weight's output features (strategy {call.strategy})", dim=1)
    if rows not in (m, m * k):
        violation("G6", f"output strategy {out}: the rows must be split {m} (all-reduce) or "
                        f"{m * k} (reduce-scatter) for input strategy {call.strategy}", dim=0)
    elif out_shape is not None and out_shape[0] % rows:
        violation("G6", f"output strategy {out}: split {rows} does not divide the output's "
                        f"{out_shape[0]} rows", dim=0)


def _check_broadcast(call, shapes, violation, devices_per_stage):
    """Broadcast operands agree on every dimension they share (size > 1 on both)."""
    rank = max(len(s) for s in shapes)
    for dim in range(rank):
        present = [(i, s[len(s) - rank + dim], call.strategy[i][len(s) - rank + dim])
                   for i, s in enumerate(shapes) if len(s) - rank + dim >= 0]
        shared = [(i, size, split) for i, size, split in present if size > 1]
        splits = {split for _, _, split in shared}
        if len(splits) > 1:
            first = shared[0]
            for i, size, split in shared[1:]:
                if split != first[2]:
                    violation("broadcast", f"split {split} differs from input {first[0]}'s "
                                           f"split {first[2]} of the same dimension (shapes "
                                           f"{shapes[first[0]]} and {shapes[i]}, strategy "
                                           f"{call.strategy})", i, len(shapes[i]) - rank + dim)


def _check_matmul(call, shapes, violation, devices_per_stage):
    batch, m, k_x, k_w, n = matmul_dims(call)
    x, w = call.strategy
    tb = bool(call.attr("transpose_b", False))
    # Conservative (rules: "MatMul extras", marked [?]): MatMul's PCL exception (2-D, equal
    # strategies, product S, unequal K shards) is not used, and transpose_a is refused as
    # matmul_info.cc@4a7a9e4b does.
    if call.name == "MatMul" and call.attr("transpose_a", False):
        violation("MatMul", "transpose_a with a strategy is rejected by some MindSpore "
                            "versions; transpose the input instead", 0)
    if k_x != k_w:
        violation("MatMul", f"the contracted dimension is split {k_x} in input 0 but {k_w} in "
                            f"input 1 (strategy {call.strategy}, transpose_b={tb}); MatMul "
                            f"needs equal splits", 1, len(w) - 1 if tb else len(w) - 2)
    for offset in range(1, min(len(x), len(w)) - 1):
        dx, dw = len(x) - 2 - offset, len(w) - 2 - offset
        size_x, size_w = shapes[0][dx], shapes[1][dw]
        if size_x > 1 and size_w > 1 and x[dx] != w[dw]:
            violation("BatchMatMul", f"batch dimension split {x[dx]} in input 0 but {w[dw]} in "
                                     f"input 1 (strategy {call.strategy})", 1, dw)


def _check_softmax(call, shapes, violation, devices_per_stage):
    axes = call.attr("axis", -1)
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for axis in axes:
        dim = axis % len(shapes[0])
        if call.strategy[0][dim] != 1:
            violation("Softmax", f"the softmax axis is split {call.strategy[0][dim]} (strategy "
                                 f"{call.strategy[0]}, shape {shapes[0]}); it must be whole",
                      0, dim)


def _check_layer_norm(call, shapes, violation, devices_per_stage):
    rank = len(shapes[0])
    norm_axis = call.attr("begin_norm_axis", -1) % rank
    params_axis = call.attr("begin_params_axis", -1) % rank
    x = call.strategy[0]
    for dim in range(norm_axis, rank):
        if x[dim] != 1:
            violation("LayerNorm", f"normalised axis split {x[dim]} (strategy {x}, shape "
                                   f"{shapes[0]}); normalised axes must be whole", 0, dim)
    for index in (1, 2):
        if index < len(call.strategy) and call.strategy[index] != x[params_axis:]:
            violation("LayerNorm", f"gamma/beta strategy {call.strategy[index]} must equal the "
                                   f"input's strategy from begin_params_axis, {x[params_axis:]}",
                      index)


def _check_gather(call, shapes, violation, devices_per_stage):
    param, indices = call.strategy[0], call.strategy[1]
    axis = int(call.args[2]) % len(param)
    if param[axis] == 1:
        return
    # MindSpore's "batch and axis" mode: table (p, 1) on axis 0, ids split on dimension 0
    # only, p x i the whole stage (gather_info.cc)
    batch_and_axis = (axis == 0 and len(param) == 2 and param[1] == 1 and indices[0] > 1
                      and all(split == 1 for split in indices[1:])
                      and param[0] * indices[0] == devices_per_stage)
    if any(split != 1 for split in indices) and not batch_and_axis:
        dim = next(d for d, split in enumerate(indices) if split != 1)
        violation("Gather", f"the table is split {param[axis]} along the gathered axis "
                            f"(vocabulary split) so the indices must be whole, or split on "
                            f"dimension 0 only with table split x index split = the stage's "
                            f"{devices_per_stage} devices, but their strategy is {indices}",
                  1, dim)
    if len(param) > 2:
        violation("Gather", f"a vocabulary split needs a 1-D or 2-D table, got rank "
                            f"{len(param)}", 0)


def _check_flash_attention(call, shapes, violation, devices_per_stage):
    """BNSD q, k, v split alike on batch and heads only; the mask split like the batch."""
    query = call.strategy[0]
    for index in (1, 2):
        if call.strategy[index] != query:
            violation("FlashAttentionScore", f"query, key and value must be split alike, got "
                                             f"{query} and {call.strategy[index]}", index)
    for dim in (2, 3):
        if query[dim] != 1:
            violation("FlashAttentionScore", f"the sequence and head-size axes of BNSD inputs "
                                             f"must be whole (strategy {query})", 0, dim)
    if shapes[0][3] % 16 or shapes[0][3] > 512:
        violation("FlashAttentionScore", f"the head size must be a multiple of 16 up to 512, "
                                         f"got {shapes[0][3]}", 0, 3)
    if len(call.strategy) > 3:
        mask = call.strategy[-1]
        wanted = (1, 1) if len(mask) == 2 else (query[0], 1, 1, 1)
        if mask != wanted:
            violation("FlashAttentionScore", f"the attention mask must be split {wanted} "
                                             f"(got {mask})", len(call.strategy) - 1)


def _check_one_hot(call, shapes, violation, devices_per_stage):
    out = call.strategy[0]
    if len(shapes[0]) > 2 and any(split != 1 for split in out[1:]):
        violation("OneHot", f"with indices of rank > 1 only dimension 0 may be split "
                            f"(strategy {out})", 0)


def _check_cross_entropy(call, shapes, violation, devices_per_stage):
    logits, labels = call.strategy[0], call.strategy[1]
    if logits != labels:
        violation("loss", f"logits strategy {logits} and labels strategy {labels} must be "
                          f"identical", 1)
    if logits[-1] != 1:
        violation("loss", f"the class dimension is split {logits[-1]} (strategy {logits}); "
                          f"it must be whole", 0, len(logits) - 1)


def _check_strided_slice(call, shapes, violation, devices_per_stage):
    begin, end, strides = call.args[1], call.args[2], call.args[3]
    for dim, split in enumerate(call.strategy[0]):
        if split == 1 or dim >= len(begin):
            continue
        size = shapes[0][dim]
        if begin[dim] != 0 or end[dim] < size or strides[dim] != 1:
            violation("StridedSlice", f"split dimension {dim} must be taken whole with stride 1 "
                                      f"(begin {begin[dim]}, end {end[dim]}, stride "
                                      f"{strides[dim]})", 0, dim)


def _check_concat(call, shapes, violation, devices_per_stage):
    axis = int(call.args[1]) % len(shapes[0]) if len(call.args) > 1 else 0
    first = call.strategy[0]
    for index, part in enumerate(call.strategy):
        if part != first:
            violation("Concat", f"every input needs the same strategy ({first} vs {part})", index)
    if first[axis] != 1:
        violation("Concat", "the concatenated axis must not be split", 0, axis)


OPERATOR_RULES = {
    "MatMul": _check_matmul, "BatchMatMul": _check_matmul, "Softmax": _check_softmax,
    "LogSoftmax": _check_softmax, "LayerNorm": _check_layer_norm, "Gather": _check_gather,
    "OneHot": _check_one_hot, "SoftmaxCrossEntropyWithLogits": _check_cross_entropy,
    "StridedSlice": _check_strided_slice, "Concat": _check_concat,
    "FlashAttentionScore": _check_flash_attention,
}


def check_recording(rec: Recording, parallel: ParallelConfig, device_num: int) -> List[Violation]:
    """Every strategy-bearing call, parameter layouts and the order of pipeline stages."""
    found, seen = [], set()
    per_stage = parallel.devices_per_stage
    for call in rec.strategy_calls():
        key = (id(call.prim), tuple(t.shape for t in call.tensors))
        if key in seen:
            continue
        seen.add(key)
        found.extend(check_call(call, per_stage, device_num))
    for param in rec.params.values():
        splits = {split for _, _, split in param.consumers}
        if len(splits) > 1:
            (path_a, _, a), (path_b, index, b) = param.consumers[0], next(
                c for c in param.consumers if c[2] != param.consumers[0][2])
            found.append(Violation(
                "parameter", f"parameter {param.name} is split {a} by {path_a} but {b} here; "
                             f"every user of a parameter must split it alike",
                path_b, "", index))
    last = 0
    for call in rec.calls:
        if not call.staged:
            continue
        if call.stage < last:
            found.append(Violation("pipeline", f"runs on stage {call.stage} after an operator "
                                               f"of stage {last}; stages must not decrease in "
                                               f"execution order", call.path, call.name))
            break
        last = max(last, call.stage)
    return found


def check_layout(parallel: ParallelConfig, device_num: int, num_layers: int,
                 global_batch_size: int, accumulation: int,
                 seq_length: int) -> List[Violation]:
    """The layout's own rules: device number (G10), product, stages, micro batches, batch."""
    found = []

    def violation(rule, message):
        found.append(Violation(rule, message))

    for key in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num"):
        if getattr(parallel, key) < 1:
            violation("layout", f"parallel.{key} must be >= 1, got {getattr(parallel, key)}")
    if found:
        return found
    if not (device_num in (1, 2, 4) or device_num % 8 == 0) or device_num > 4096:
        violation("G10", f"device number {device_num} must be 1, 2, 4 or a multiple of 8 "
                         f"(at most 4096)")
    product = parallel.device_num
    if product != device_num:
        violation("layout", f"data_parallel {parallel.dp} x model_parallel {parallel.mp} x "
                            f"pipeline_stage {parallel.pipeline_stage} = {product} differs from "
                            f"the device number {device_num}")
    if num_layers % parallel.pipeline_stage:
        violation("pipeline", f"model.num_layers={num_layers} is not divisible by "
                              f"parallel.pipeline_stage={parallel.pipeline_stage}")
    if parallel.pipeline_stage > 1 and parallel.micro_batch_num < parallel.pipeline_stage:
        violation("pipeline", f"parallel.micro_batch_num={parallel.micro_batch_num} must be at "
                              f"least parallel.pipeline_stage={parallel.pipeline_stage}: each "
                              f"stage needs a micro batch in flight")
    try:
        parallel.check_batch(global_batch_size, accumulation)
    except ConfigError as err:
        violation("batch", str(err))
    try:
        parallel.check_sequence_parallel()
        parallel.check_sequence_split(parallel.micro_batch_size(global_batch_size, accumulation),
                                      seq_length)
    except ConfigError as err:
        violation("layout", str(err))
    return found


# --- a whole plan ---------------------------------------------------------------------------

@dataclass
class Plan:
    """The result of `build_plan`: violations, recording, memory and communication."""

    config: Any
    config_path: str
    device_num: int
    device: str
    micro_batch: int
    violations: List[Violation]
    recording: Optional[Recording] = None
    memory: list = field(default_factory=list)
    communication: list = field(default_factory=list)
    compute: list = field(default_factory=list)
    bubble: float = 0.0

    @property
    def device_name(self) -> str:
        return DEVICES[self.device][0]

    @property
    def device_memory(self) -> int:
        return DEVICES[self.device][1]

    @property
    def worst_stage(self):
        return max(self.memory, key=lambda m: m.total) if self.memory else None

    @property
    def fits(self) -> bool:
        return bool(self.memory) and self.worst_stage.total <= self.device_memory

    @property
    def ok(self) -> bool:
        return not self.violations and self.fits

    @property
    def parameter_count(self) -> int:
        return sum(p.numel for p in self.recording.params.values()) if self.recording else 0

    @property
    def checked_calls(self) -> int:
        return len(self.recording.strategy_calls()) if self.recording else 0

    def to_dict(self) -> dict:
        parallel, train, model = self.config.parallel, self.config.train, self.config.model
        worst = self.worst_stage
        comm_worst = max(self.communication, key=lambda c: c.total) if self.communication else None
        worst_compute = max(self.compute, key=lambda c: c.total) if self.compute else None
        return {
            "config": self.config_path, "model": model.name, "ok": self.ok,
            "parameters": self.parameter_count,
            "layout": {"device_num": self.device_num, "data_parallel": parallel.dp,
                       "model_parallel": parallel.mp, "pipeline_stage": parallel.pipeline_stage,
                       "devices_per_stage": parallel.devices_per_stage,
                       "micro_batch_num": parallel.micro_batch_num,
                       "optimizer_shard": parallel.optimizer_shard,
                       "recompute": parallel.recompute, "vocab_emb_dp": parallel.vocab_emb_dp,
                       "full_batch": parallel.full_batch},
            "batch": {"global": train.global_batch_size, "grad_accumulation": train.grad_accumulation,
                      "micro_batch": self.micro_batch, "precision": train.precision},
            "checked_operator_calls": self.checked_calls,
            "violations": [v.to_dict() for v in self.violations],
            "device": {"name": self.device_name, "memory": self.device_memory},
            "memory": {"stages": [m.to_dict() for m in self.memory],
                       "worst_stage": worst.stage if worst else None,
                       "total": worst.total if worst else None, "fits": self.fits},
            "communication": {"stages": [c.to_dict() for c in self.communication],
                              "worst_stage": comm_worst.stage if comm_worst else None,
                              **({kind: comm_worst.bytes[kind] for kind in comm_worst.bytes}
                                 if comm_worst else {})},
            "compute": {"stages": [c.to_dict() for c in self.compute],
                        "worst_stage": worst_compute.stage if worst_compute else None,
                        "flops": worst_compute.total if worst_compute else None},
            "pipeline_bubble": self.bubble,
        }


def load_plan_config(path: str, overrides=None):
    """The config as `load_config` reads it, but with the layout left unchecked.

    The model and train sections are validated (a bad value there is a user error, exit 2);
    the parallel layout and batch divisibility become plan violations instead, so that one
    run reports all of them.
    """
    from model_zoo.config import apply_override, read_yaml
    raw = read_yaml(path)
    for override in overrides or []:
        apply_override(raw, override)
    return plan_config_from_dict(raw, path)


def plan_config_from_dict(raw: dict, path: str = "<dict>"):
    """`load_plan_config` for a config already read into a dict."""
    from model_zoo.config import typed_config
    config = typed_config(raw, path)
    config.model.validate()
    config.train.validate()
    return config


def network_inputs(module, config, network, batch_size: int):
    """The network's inputs for one micro batch, from the model folder's `plan_inputs`."""
    hook = getattr(module, "plan_inputs", None)
    if hook is None:
        raise PlanError(f"model {config.model.name!r}: the model folder must define "
                        f"plan_inputs(config, batch_size) returning its training network's "
                        f"inputs as (shape, dtype)")
    return list(hook(config, batch_size))


def micro_batch_size(config) -> int:
    """Sequences of the global batch in one micro batch: what every operator sees."""
    return config.parallel.micro_batch_size(config.train.global_batch_size,
                                            config.train.grad_accumulation)


def record_training_network(config, network) -> Recording:
    """The recorded forward pass of `config`'s training network at one micro batch."""
    from model_zoo.config import import_model
    parallel = config.parallel
    inputs = network_inputs(import_model(config.model.name), config, network,
                            micro_batch_size(config))
    dataset_layout = None if parallel.full_batch else parallel.devices_per_stage
    return record(network, inputs, stages=parallel.pipeline_stage, dataset_layout=dataset_layout)


def parameter_layouts(config, network) -> Dict[str, ParamInfo]:
    """{parameter name: its shape, split and stage} for `config`'s layout, as the plan sees
    it; `network` is built with the Ascend operators (weights need not be allocated)."""
    return record_training_network(config, network).params


def build_plan(config, config_path: str = "", device_num: Optional[int] = None,
               device: str = "ascend910", customize=None) -> Plan:
    """Check `config`'s layout and operators and estimate its cost (see the module doc).

    Args:
        config: a Config (from `load_plan_config`).
        config_path: shown in the report.
        device_num: the devices the job will have (default: dp x mp x pp).
        device: a key of DEVICES, whose memory the estimate is held against.
        customize: optional function called with the built network before the recording
            (the tests use it to break strategies on purpose).
    """
    from mindspore.nn.utils import no_init_parameters
    from model_zoo.config import import_model
    from model_zoo.parallel import cost
    from model_zoo.parallel.layers import dtype_of, kernels_for

    if device not in DEVICES:
        raise UserInputError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    parallel, train = config.parallel, config.train
    device_num = device_num or parallel.device_num
    if device_num < 1:
        raise UserInputError(f"--device-num must be >= 1, got {device_num}")
    violations = check_layout(parallel, device_num, config.model.num_layers,
                              train.global_batch_size, train.grad_accumulation,
                              config.model.seq_length)
    micro_batch = micro_batch_size(config)
    if getattr(config.model, "flash_attention", False) and device != "ascend910b":
        violations.append(Violation(
            "flash_attention", f"model.flash_attention: FlashAttentionScore runs on Ascend "
                               f"910B (Atlas A2) only, not on {DEVICES[device][0]}; plan with "
                               f"--device ascend910b"))
    plan = Plan(config, config_path, device_num, device, micro_batch, violations)
    if any(v.rule == "layout" and "must be >= 1" in v.message for v in violations):
        return plan
    module = import_model(config.model.name)
    try:
        with no_init_parameters(), kernels_for("Ascend"):
            network = module.build_train_network(config, dtype_of(train.precision))
    except ConfigError as err:
        violations.append(Violation("build", str(err)))
        return plan
    if customize is not None:
        customize(network)
    plan.recording = record_training_network(config, network)
    violations.extend(check_recording(plan.recording, parallel, device_num))
    plan.memory = cost.estimate_memory(plan.recording, parallel, train.grad_accumulation)
    plan.communication = cost.estimate_communication(plan.recording, parallel,
                                                     train.grad_accumulation)
    plan.compute = cost.estimate_compute(plan.recording, parallel, train.grad_accumulation)
    plan.bubble = cost.pipeline_bubble(parallel, train.grad_accumulation)
    return plan


# --- the report -------------------------------------------------------------------------------

def _gib(value: float) -> str:
    return f"{value / 2 ** 30:.2f}"


def _count(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(int(value))


def format_report(plan: Plan, max_violations: int = 20) -> str:
    config, lines = plan.config, []
    parallel, train, model = config.parallel, config.train, config.model
    on = {True: "on", False: "off"}
    lines.append(f"plan: {plan.config_path or model.name}")
    lines.append(f"  model {model.name}: {_count(plan.parameter_count)} parameters "
                 f"({model.num_layers} layers, hidden {model.hidden_size}, heads "
                 f"{model.num_heads}, sequence {model.seq_length}, vocabulary {model.vocab_size})")
    lines.append(f"  layout: {plan.device_num} devices; data_parallel {parallel.dp} x "
                 f"model_parallel {parallel.mp} x pipeline_stage {parallel.pipeline_stage} "
                 f"({parallel.devices_per_stage} devices per stage)")
    lines.append(f"          micro batches {parallel.micro_batch_num}, optimizer shard "
                 f"{on[parallel.optimizer_shard]}, recompute {on[parallel.recompute]}, "
                 f"vocab_emb_dp {on[parallel.vocab_emb_dp]}, sequence parallel "
                 f"{on[parallel.sequence_parallel]}, precision {train.precision}")
    lines.append(f"  batch: global {train.global_batch_size} = {train.grad_accumulation} "
                 f"accumulation x {parallel.micro_batch_num} micro batches x "
                 f"{plan.micro_batch} sequences; each operator sees {plan.micro_batch}")
    lines.append(f"  checked: {plan.checked_calls} operator calls with a strategy, "
                 f"{len(plan.violations)} violation(s)")
    if plan.memory:
        lines.append("")
        lines.append(f"memory per device, GiB ({plan.device_name}: {_gib(plan.device_memory)})")
        lines.append(f"  {'stage':>5} {'weights':>8} {'copies':>8} {'grads':>8} "
                     f"{'optimizer':>9} {'activ.':>8} {'= micro x n + recomp. + bwd':>26} "
                     f"{'total':>8}")
        for m in plan.memory:
            detail = (f"{_gib(m.activations_per_micro_batch)} x {m.micro_batches_in_flight}"
                      f" + {_gib(m.recompute_peak)} + {_gib(m.backward_working)}")
            lines.append(f"  {m.stage:>5} {_gib(m.weights):>8} {_gib(m.working_copy):>8} "
                         f"{_gib(m.gradients):>8} {_gib(m.optimizer):>9} "
                         f"{_gib(m.activations):>8} {detail:>26} {_gib(m.total):>8}")
        worst = plan.worst_stage
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"  worst stage {worst.stage}: {_gib(worst.total)} of "
                     f"{_gib(plan.device_memory)} GiB "
                     f"({100 * worst.total / plan.device_memory:.0f}%): {verdict}")
    if plan.communication:
        lines.append("")
        lines.append("communication per device per step, GiB")
        lines.append(f"  {'stage':>5} {'all-reduce':>11} {'all-gather':>11} "
                     f"{'reduce-scatter':>15} {'send/receive':>13} {'total':>8}")
        for c in plan.communication:
            lines.append(f"  {c.stage:>5} {_gib(c.bytes['all_reduce']):>11} "
                         f"{_gib(c.bytes['all_gather']):>11} "
                         f"{_gib(c.bytes['reduce_scatter']):>15} "
                         f"{_gib(c.bytes['send_receive']):>13} {_gib(c.total):>8}")
        worst = max(plan.communication, key=lambda c: c.total)
        largest = sorted(worst.details.items(), key=lambda item: -item[1][0])[:5]
        if largest:
            lines.append(f"  largest on stage {worst.stage}:")
            for (kind, reason), (amount, count) in largest:
                times = f" ({count} ops)" if count > 1 else ""
                lines.append(f"    {_gib(amount):>8}  {kind.replace('_', '-')}: {reason}{times}")
        pp = parallel.pipeline_stage
        micro = parallel.micro_batch_num * train.grad_accumulation
        lines.append(f"  pipeline bubble: {100 * plan.bubble:.1f}% "
                     f"((pp - 1) / (micro x accumulation + pp - 1) = {pp - 1}/{micro + pp - 1})")
    if plan.compute:
        lines.append("")
        lines.append("compute per device per step, MatMul TFLOP")
        lines.append(f"  {'stage':>5} {'forward':>9} {'backward':>9} {'recompute':>10} "
                     f"{'total':>9}")
        for c in plan.compute:
            lines.append(f"  {c.stage:>5} {c.forward / 1e12:>9.2f} {c.backward / 1e12:>9.2f} "
                         f"{c.recompute / 1e12:>10.2f} {c.total / 1e12:>9.2f}")
    lines.append("")
    if plan.violations:
        lines.append(f"violations ({len(plan.violations)}):")
        for violation in plan.violations[:max_violations]:
            lines.append(f"  {violation}")
        if len(plan.violations) > max_violations:
            lines.append(f"  ... and {len(plan.violations) - max_violations} more (--json lists all)")
    verdict = "OK" if plan.ok else "FAILED"
    reasons = []
    if plan.violations:
        reasons.append(f"{len(plan.violations)} violation(s)")
    if plan.memory and not plan.fits:
        reasons.append(f"needs {_gib(plan.worst_stage.total)} GiB per device, "
                       f"{plan.device_name} has {_gib(plan.device_memory)}")
    lines.append(f"{verdict}" + (": " + "; ".join(reasons) if reasons else ""))
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------

def add_plan_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("config", help="YAML config, e.g. "
                                       "model_zoo/gpt2/configs/plan/gpt2-1024-d2m2p4.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    parser.add_argument("--device-num", type=int, default=None,
                        help="devices the job will have (default: dp x mp x pp of the config)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="ascend910",
                        help="device whose memory the estimate is held against "
                             "(ascend910: 32 GiB, ascend910b: 64 GiB)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.epilog = ("Exit status: 0 when every rule holds and the worst stage fits in the "
                     "device's memory, 1 otherwise, 2 for a bad config or argument.")


def run_plan_command(args) -> int:
    config = load_plan_config(args.config, args.overrides)
    plan = build_plan(config, args.config, args.device_num, args.device)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_report(plan))
    return 0 if plan.ok else 1


# --- the strategy table of docs/parallelism.md (generated, so it cannot drift) ---------------

SYMBOL_DP, SYMBOL_MP = 3, 5     # distinct primes: every strategy value decodes to dp/mp


def _layer_examples():
    """(layer, variant, factory(parallel_config)) for every sharded layer in layers.py.

    Sizes are multiples of SYMBOL_MP so that every layer builds with mp = 5; the table shows
    the layers as Ascend builds them (`layers.kernels_for`).
    """
    from model_zoo.parallel import layers as L
    h, heads, ffn, vocab, seq = 60, 5, 120, 60, 8
    return [
        ("Linear", 'split="column"', lambda pc: L.Linear(h, ffn, split="column",
                                                           parallel_config=pc)),
        ("Linear", 'split="column", activation="gelu"',
         lambda pc: L.Linear(h, ffn, split="column", activation="gelu", parallel_config=pc)),
        ("Linear", 'split="row"', lambda pc: L.Linear(ffn, h, split="row", parallel_config=pc)),
        ("Linear", 'split="row", sequence_parallel', lambda pc: L.Linear(
            ffn, h, split="row", parallel_config=_with(pc, sequence_parallel=True))),
        ("Linear", 'split="none"', lambda pc: L.Linear(h, h, parallel_config=pc)),
        ("ExactGELU", "strategy (dp, mp)", lambda pc: L.ExactGELU((pc.dp, pc.mp))),
        ("Dropout", "strategy (dp, 1, 1)", lambda pc: L.Dropout(0.1, (pc.dp, 1, 1))),
        ("Dropout", "stream_dropout, sequence_parallel", lambda pc: L.stream_dropout(
            0.1, _with(pc, sequence_parallel=True))),
        ("LayerNorm", "", lambda pc: L.LayerNorm(h, parallel_config=pc)),
        ("LayerNorm", "sequence_parallel", lambda pc: L.LayerNorm(
            h, parallel_config=_with(pc, sequence_parallel=True))),
        ("VocabEmbedding", "vocab_emb_dp: true", lambda pc: L.VocabEmbedding(
            vocab, h, parallel_config=_with(pc, vocab_emb_dp=True))),
        ("VocabEmbedding", "vocab_emb_dp: false", lambda pc: L.VocabEmbedding(
            vocab, h, parallel_config=_with(pc, vocab_emb_dp=False))),
        ("PositionEmbedding", "", lambda pc: L.PositionEmbedding(seq, h, parallel_config=pc)),
        ("SinusoidalPositionEncoding", "",
         lambda pc: L.SinusoidalPositionEncoding(seq, h, parallel_config=pc)),
        ("MultiHeadAttention", "causal=True", lambda pc: L.MultiHeadAttention(
            h, heads, parallel_config=pc, causal=True, max_seq_length=seq,
            attention_dropout=0.1, hidden_dropout=0.1)),
        ("MultiHeadAttention", "causal=True, flash=True (910B)",
         lambda pc: L.MultiHeadAttention(80, heads, parallel_config=pc, causal=True,
                                         max_seq_length=seq, compute_dtype=ms.float16,
                                         flash=True)),
        ("FeedForward", 'activation="gelu"', lambda pc: L.FeedForward(
            h, ffn, parallel_config=pc, hidden_dropout=0.1)),
        ("ResidualAdd", "", lambda pc: L.ResidualAdd(parallel_config=pc)),
        ("ResidualAdd", "sequence_parallel", lambda pc: L.ResidualAdd(
            parallel_config=_with(pc, sequence_parallel=True))),
        ("VocabProjection", "vocab_emb_dp: true", lambda pc: L.VocabProjection(
            h, parallel_config=_with(pc, vocab_emb_dp=True))),
        ("VocabProjection", "vocab_emb_dp: false", lambda pc: L.VocabProjection(
            h, parallel_config=_with(pc, vocab_emb_dp=False))),
        ("CrossEntropy", "class_split=1", lambda pc: L.CrossEntropy(parallel_config=pc)),
        ("CrossEntropy", "class_split=mp (vocabulary-split head)",
         lambda pc: L.CrossEntropy(parallel_config=pc, class_split=pc.mp)),
    ]


def _with(parallel: ParallelConfig, **changes) -> ParallelConfig:
    import dataclasses
    return dataclasses.replace(parallel, **changes)


def sharded_layer_names() -> List[str]:
    """Every nn.Cell subclass defined in model_zoo/parallel/layers.py."""
    from model_zoo.parallel import layers as L
    return sorted(name for name, value in vars(L).items()
                  if isinstance(value, type) and issubclass(value, nn.Cell)
                  and value.__module__ == L.__name__)


def _symbol(value: int) -> str:
    names = []
    for prime, name in ((SYMBOL_DP, "dp"), (SYMBOL_MP, "mp")):
        while value % prime == 0:
            names.append(name)
            value //= prime
    if value != 1:
        names.append(str(value))
    return "·".join(names) or "1"


def _symbolic(strategy) -> str:
    parts = ["(" + ", ".join(_symbol(v) for v in part) + ("," if len(part) == 1 else "") + ")"
             for part in strategy]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _communication_note(prim, strategy) -> str:
    name = prim.name
    try:
        if name in ("MatMul", "BatchMatMul"):
            notes = []
            x, w = strategy
            tb = bool(prim.attrs.get("transpose_b", False))
            ta = bool(prim.attrs.get("transpose_a", False))
            k = x[-2] if ta else x[-1]
            n = w[-2] if tb else w[-1]
            m = x[-1] if ta else x[-2]
            out = strategy_of(prim, "out_strategy")
            if k != 1 and out and out[0][0] == m * k:
                notes.append(f"forward reduce-scatter over {_symbol(k)} (output "
                             f"`{_symbolic(out)}`), backward all-gather of its gradient")
            elif k != 1:
                notes.append(f"forward all-reduce over {_symbol(k)}")
            if n != 1:
                notes.append(f"backward all-reduce of the input gradient over {_symbol(n)} "
                             f"(with sequence parallel: the reduce-scatter of its gathered "
                             f"input)")
            return "; ".join(notes) or "none"
        if name == "Gather" and strategy[0][0] != 1:
            return f"vocabulary split: masked lookup, all-reduce over {_symbol(strategy[0][0])}"
        if name in ("ReduceSum", "ReduceMean") and any(v != 1 for v in strategy[0]):
            return "all-reduce of the partial sums when a reduced axis is split"
        if name in ("ReduceMax", "ReduceMin") and any(v != 1 for v in strategy[0]):
            return "all-reduce (max / min) when a reduced axis is split"
    except (IndexError, TypeError, ValueError):
        pass
    return "none"


def strategy_table() -> str:
    """Markdown: every sharded layer's operators and strategies in terms of dp and mp."""
    from model_zoo.parallel.layers import kernels_for
    parallel = ParallelConfig(data_parallel=SYMBOL_DP, model_parallel=SYMBOL_MP,
                              vocab_emb_dp=False)
    lines = ["| layer | variant | operator (attribute) | strategy | communication |",
             "|---|---|---|---|---|"]
    for layer, variant, factory in _layer_examples():
        with kernels_for("Ascend"):
            cell = factory(parallel)
        for name, _, attr, prim in primitives(cell):
            strategy = strategy_of(prim)
            if strategy is None:
                continue
            where = f"{name}.{attr}" if name else attr
            lines.append(f"| `{layer}` | {variant} | {prim.name} (`{where}`) | "
                         f"`{_symbolic(strategy)}` | {_communication_note(prim, strategy)} |")
    return "\n".join(lines)


def plan_config_files(root: Optional[str] = None) -> List[str]:
    """Every shipped layout config: model_zoo/<model>/configs/plan/*.yaml, sorted."""
    import glob
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return sorted(glob.glob(os.path.join(root, "*", "configs", "plan", "*.yaml")))


def layout_table(plans: Optional[Dict[str, Plan]] = None) -> str:
    """Markdown: every shipped layout config with its devices and estimated memory."""
    lines = ["| config | parameters | dp x mp x pp | devices | micro batches x accumulation | "
             "memory per device (worst stage, Ascend 910) | fits 32 GiB | pipeline bubble |",
             "|---|---|---|---|---|---|---|---|"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in plan_config_files():
        relative = os.path.relpath(path, root)
        plan = (plans or {}).get(relative)
        if plan is None:
            plan = build_plan(load_plan_config(path), relative)
        p, accumulation = plan.config.parallel, plan.config.train.grad_accumulation
        lines.append(f"| `{relative}` | {_count(plan.parameter_count)} | "
                     f"{p.dp} x {p.mp} x {p.pipeline_stage} | {plan.device_num} | "
                     f"{p.micro_batch_num} x {accumulation} | "
                     f"{_gib(plan.worst_stage.total)} GiB (stage {plan.worst_stage.stage}) | "
                     f"{'yes' if plan.fits else 'NO'} | {100 * plan.bubble:.0f}% |")
    return "\n".join(lines)


DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "parallelism.md")


def _marker(name: str, end: bool = False) -> str:
    if end:
        return f"<!-- END GENERATED {name} -->"
    return (f"<!-- BEGIN GENERATED {name}: `python3 -m model_zoo.parallel.plan --update-docs` "
            f"writes this section; do not edit it by hand -->")


def generated_sections(plans=None) -> Dict[str, str]:
    return {"strategies": strategy_table(), "layouts": layout_table(plans)}


def render_doc(text: str, sections: Dict[str, str]) -> str:
    """`text` with every generated section replaced by its current content."""
    for name, body in sections.items():
        begin, end = _marker(name), _marker(name, end=True)
        if begin not in text or end not in text:
            raise PlanError(f"{DOC_PATH} lacks the markers of the generated section {name!r}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m model_zoo.parallel.plan",
        description="The generated parts of docs/parallelism.md (for a plan of one config, "
                    "use `model-zoo plan CONFIG`).")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--strategy-table", action="store_true",
                       help="print every sharded layer's operators and strategies (markdown)")
    group.add_argument("--layout-table", action="store_true",
                       help="print the shipped layout configs with their memory (markdown)")
    group.add_argument("--update-docs", action="store_true",
                       help=f"rewrite the generated sections of {DOC_PATH}")
    args = parser.parse_args(argv)
    if args.strategy_table:
        print(strategy_table())
    elif args.layout_table:
        print(layout_table())
    else:
        with open(DOC_PATH, encoding="utf-8") as handle:
            text = handle.read()
        with open(DOC_PATH, "w", encoding="utf-8") as handle:
            handle.write(render_doc(text, generated_sections()))
        print(f"updated {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
