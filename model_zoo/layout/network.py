"""A config's training network, built without weights and recorded: the layout every
parameter gets under the config's parallel section, and the rules it breaks.

The trainer (norm weights), checkpoints (slices) and the cost model all start here. The
model folder contract used: `build_train_network(config, compute_dtype)` and
`plan_inputs(config, batch_size) -> [(shape, dtype), ...]`, the network's inputs for one
micro batch (model_zoo/models/base.py).
"""

from typing import Dict, List, Optional

from model_zoo.errors import ConfigError, UserInputError
from model_zoo.layout.recording import ParamInfo, PlanError, Recording
from model_zoo.layout.rules import Violation, check_parallel_section, check_recording
from model_zoo.layout.trace import record


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


def ascend_training_network(config):
    """`config`'s training network as Ascend builds it (its operators and strategies), with
    no weight allocated; ConfigError when a layer refuses the layout."""
    from mindspore.nn.utils import no_init_parameters
    from model_zoo.config import import_model
    from model_zoo.nn.backend import kernels_for
    from model_zoo.nn.layers import dtype_of
    with no_init_parameters(), kernels_for("Ascend", described_only=True):
        return import_model(config.model.name).build_train_network(
            config, dtype_of(config.train.precision))


def record_training_network(config, network) -> Recording:
    """The recorded forward pass of `config`'s training network at one micro batch."""
    from model_zoo.config import import_model
    parallel = config.parallel
    inputs = network_inputs(import_model(config.model.name), config, network,
                            micro_batch_size(config))
    dataset_layout = None if parallel.full_batch else parallel.devices_per_stage
    return record(network, inputs, stages=parallel.pipeline_stage, dataset_layout=dataset_layout)


def parameter_layouts(config, network) -> Dict[str, ParamInfo]:
    """{parameter name: its shape, split and stage} for `config`'s layout; `network` is
    built with the Ascend operators (weights need not be allocated)."""
    return record_training_network(config, network).params


def layout_violations(config, device_num: Optional[int] = None) -> List[Violation]:
    """The rules the parallel section itself breaks for `device_num` devices (default
    dp x mp x pp): sizes, device number, stages, micro batches, batch, sequence split."""
    parallel, train = config.parallel, config.train
    return check_parallel_section(parallel, device_num or parallel.device_num,
                                  config.model.pipeline_blocks, train.global_batch_size,
                                  train.grad_accumulation, config.model.seq_length)


def has_bad_sizes(violations: List[Violation]) -> bool:
    """Whether a parallel size is below 1: nothing can be built for such a layout."""
    return any(v.rule == "layout" and "must be >= 1" in v.message for v in violations)


def checked_recording(config, violations: List[Violation], device_num: Optional[int] = None,
                     customize=None) -> Optional[Recording]:
    """The recording of `config`'s training network, adding to `violations` the rules its
    strategies break; None (a "build" violation added) when a layer refuses the layout, or
    when `violations` already has a parallel size below 1. `customize`, when given, is
    called with the built network first (the tests break strategies with it)."""
    if has_bad_sizes(violations):
        return None
    try:
        network = ascend_training_network(config)
    except ConfigError as err:
        violations.append(Violation("build", str(err)))
        return None
    if customize is not None:
        customize(network)
    recording = record_training_network(config, network)
    violations.extend(check_recording(recording, config.parallel,
                                      device_num or config.parallel.device_num))
    return recording


def usable_parameters(config, purpose: str) -> Dict[str, ParamInfo]:
    """The recorded parameters of `config`'s layout, for `purpose` (e.g. "model-zoo
    checkpoint"); UserInputError naming the first rule the layout or a strategy breaks
    (memory is the cost model's concern, not checked here)."""
    violations = layout_violations(config)
    recording = checked_recording(config, violations)
    return usable_recording(recording, violations, purpose).params


def usable_recording(recording: Optional[Recording], violations: List[Violation],
                     purpose: str) -> Recording:
    """`recording` when no rule is broken; UserInputError naming the first broken one."""
    if violations or recording is None:
        first = violations[0].message if violations else "nothing was recorded"
        raise UserInputError(f"{purpose}: the layout cannot be used for this model: {first}")
    return recording
