"""Every operator the plan knows (`OPERATORS`), and what a recorded call's strategy makes
of its outputs: their layouts (`output_layout`) and its device matrix (`device_matrix`).

Adding an operator is adding its entry to `elementwise.ENTRIES` or `contracting.ENTRIES`
(`operator_entry.Operator` says what an entry holds); nothing here changes.
"""

from typing import TYPE_CHECKING, Optional

from model_zoo.layout import contracting, elementwise
from model_zoo.layout.elementwise import reshape_layout
from model_zoo.layout.operator_entry import Operator, right_aligned_max

if TYPE_CHECKING:
    from model_zoo.layout.recording import OpCall

OPERATORS = {**elementwise.ENTRIES, **contracting.ENTRIES}

UNKNOWN = Operator()   # an operator without an entry: computed when recorded, no rules


def operator(name: str) -> Operator:
    """The entry of operator `name` (UNKNOWN when it has none)."""
    return OPERATORS.get(name, UNKNOWN)


def output_layout(call: "OpCall", position: int, shape: tuple) -> Optional[tuple]:
    """Splits per dimension of output `position` as the operator leaves it, or None
    (unknown). Operators with a strategy follow their entry's `layout`; Cast and Reshape
    pass their input's layout on; other operators without a strategy are unknown."""
    layout = _output_layout(call, position, shape)
    if layout is None or len(layout) != len(shape):
        return None
    return tuple(layout)


def _output_layout(call, position, shape):
    strategy, rank, tensors = call.strategy, len(shape), call.tensors
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
    rule = operator(call.name).layout
    try:
        if rule is not None:
            return rule(call, strategy, position, rank)
        return strategy[0] if len(strategy[0]) == rank else None
    except (IndexError, TypeError):
        return None


def device_matrix(call: "OpCall") -> tuple:
    """The operator's device matrix as MindSpore forms it (rule G4; the entry's
    `device_matrix`, else the inputs' strategies right-aligned)."""
    rule = operator(call.name).device_matrix
    if rule is not None:
        return rule(call)
    return right_aligned_max(call.strategy, max(len(part) for part in call.strategy))
