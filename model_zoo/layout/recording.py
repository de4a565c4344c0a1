"""What a recording holds: each tensor, primitive call and parameter of a network's forward
pass at real shapes (`trace.record` makes it; `rules` and the cost model read it)."""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from model_zoo.errors import UserInputError

_ITEMSIZE = {"Bool": 1, "Int8": 1, "UInt8": 1, "Int16": 2, "UInt16": 2, "Float16": 2,
             "BFloat16": 2, "Int32": 4, "UInt32": 4, "Float32": 4, "Int64": 8, "UInt64": 8,
             "Float64": 8}


class PlanError(UserInputError):
    """The plan cannot record the model (e.g. an operator without a shape rule)."""


def strategy_of(prim, attr: str = "in_strategy") -> Optional[tuple]:
    """The strategy `.shard()` recorded (`attr="out_strategy"`: its output strategy):
    MindSpore 2.10 keeps both in the primitive's attrs."""
    value = prim.attrs.get(attr)
    if value is None:
        return None
    return tuple(tuple(int(v) for v in part) for part in value)


def dtype_name(dtype) -> str:
    return str(dtype).replace("mindspore.", "")


def itemsize(dtype) -> int:
    return _ITEMSIZE.get(dtype_name(dtype), 4)


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
    parallel_optimizer: bool = True   # False: the parallel optimizer leaves it whole

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
