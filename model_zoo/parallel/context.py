"""The parallel context: device, communication, auto-parallel setup, and the data mapping.

One module owns the parallel state of a run. `set_run_context` sets MindSpore's context for
every command that runs a network (training and each verb); `init_parallel` does so for a
training rank, starts communication when the process was launched as one rank of many, and
checks the layout against the devices; `data_shard` says which slice of the data a rank reads;
`wrap_train_step` applies MindSpore's semi-auto parallel settings on Ascend.
"""

import contextlib
import ctypes
import os
from dataclasses import dataclass

import mindspore as ms
from mindspore import lazy_inline, nn

from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig

COMPILE_CALL_DEPTH = 10_000   # function calls MindSpore's graph compiler may nest
CANN_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
PLAN_HINT = "check the layout offline with `model-zoo plan CONFIG --device-num N`"


@dataclass(frozen=True)
class RunContext:
    """What this process is: its device target, rank and the number of ranks, and for a
    dry run the Ascend chip it compiles as (`chip`: "ascend910" or "ascend910b"; empty:
    this machine's own, asked of MindSpore)."""

    device_target: str
    rank: int = 0
    device_num: int = 1
    chip: str = ""

    def ascend_910b(self) -> bool:
        """Whether the step is built for an Atlas A2 (910B)."""
        return self.chip == "ascend910b" if self.chip else is_ascend_910b()

    def ascend_910(self) -> bool:
        """Whether the step is built for an Ascend 910 (saturating float status)."""
        return (self.chip == "ascend910" if self.chip
                else ascend_supports("amp_loss_scale_train_classic_target"))

    @property
    def distributed(self) -> bool:
        return self.device_num > 1

    @property
    def semi_auto(self) -> bool:
        """Whether the train step runs under MindSpore's semi-auto parallel (Ascend, several
        ranks): each device then holds slices, and MindSpore inserts the communication."""
        return self.device_target == "Ascend" and self.distributed


@dataclass(frozen=True)
class MicroBatching:
    """How a step's batch is cut into micro batches, and by whom.

    `wrapper` is MindSpore's cell that cuts it inside the graph ("pipeline": Pipeline,
    "accumulation": GradAccumulation, "" none), summing `micro_batches` losses; the train
    step itself cuts `in_step` slices (stand-alone and CPU data parallel).
    """

    wrapper: str = ""
    micro_batches: int = 1
    in_step: int = 1


@dataclass(frozen=True)
class DataShard:
    """Which part of the data one rank reads, and how many samples per step it feeds."""

    num_shards: int
    shard_id: int
    batch_size: int


def detect_device_target(requested: str = "auto") -> str:
    """Ascend when its backend loads, else CPU; `requested` or $DEVICE_TARGET overrides."""
    requested = os.environ.get("DEVICE_TARGET", requested) if requested == "auto" else requested
    if requested in ("CPU", "Ascend"):
        return requested
    if requested != "auto":
        raise ConfigError(f"device target {requested!r} is not supported (use auto, CPU or Ascend)")
    try:
        return "Ascend" if ms.hal.is_available("Ascend") else "CPU"
    except (RuntimeError, ValueError):
        return "CPU"


def ascend_runtime_problem() -> str:
    """What keeps MindSpore's Ascend backend from loading on this machine, in words ('' when
    it loads): the launch scripts refuse a rank table with it instead of training CPU
    workers."""
    try:
        if ms.hal.is_available("Ascend"):
            return ""
    except (RuntimeError, ValueError):
        pass
    if not any(os.environ.get(name) for name in CANN_VARIABLES):
        return (f"the CANN environment is not set up in this shell (none of "
                f"{', '.join(CANN_VARIABLES)} is set): source CANN's set_env.sh, by default "
                f"{CANN_SET_ENV}")
    try:
        ctypes.CDLL("libascendcl.so")
    except OSError as err:
        return (f"CANN's runtime library does not load ({err}): check LD_LIBRARY_PATH, which "
                f"CANN's set_env.sh sets")
    return ("MindSpore's Ascend backend does not load though CANN's runtime does "
            "(mindspore.hal.is_available('Ascend') is False): check the devices with "
            "`npu-smi info` and that this MindSpore matches the CANN version")


def set_run_context(requested_target: str = "auto") -> str:
    """MindSpore's context for a command that runs a network, the one place it is set: the
    device (`detect_device_target`; the layers choose their kernels by it, the fused CPU
    kernels on CPU), and graph mode, so that networks run compiled (a GPT-2 small decoding
    step op by op in PyNative took 10 times as long). Returns the device target."""
    target = detect_device_target(requested_target)
    ms.set_context(mode=ms.GRAPH_MODE, device_target=target)
    if target == "Ascend" and os.environ.get("DEVICE_ID"):
        ms.set_device("Ascend", int(os.environ["DEVICE_ID"]))
    return target


def ascend_supports(feature: str) -> bool:
    """Whether this process's Ascend chip has `feature`, by MindSpore's own table (the test
    TrainOneStepWithLossScaleCell makes); False off Ascend."""
    from mindspore._c_expression import MSContext
    return bool(MSContext.get_instance().ascend_soc_supports_feature(feature))


def is_ascend_910b() -> bool:
    """Whether this process runs on an Atlas A2 (910B) device."""
    return ascend_supports("train_hq_dtype_line")


@dataclass(frozen=True)
class ServerChip:
    """An Ascend chip as CANN names it, the plan's device profile for it and its memory."""
    name: str
    profile: str
    memory: int      # bytes


def chip_of(soc_name: str):
    """The ServerChip of CANN's SoC name, or None for a chip the plan has no profile for:
    Ascend910A / 910ProA / 910PremiumA / 910ProB (Atlas 800 training, 32 GB), Ascend910B1 to
    B3 (64 GB) and B4 (32 GB), Ascend910_93xx (Atlas A3, 64 GB a die)."""
    gib = 2 ** 30
    if soc_name.startswith("Ascend910B") and soc_name[10:11].isdigit():
        return ServerChip(soc_name, "ascend910b", (32 if soc_name[10] == "4" else 64) * gib)
    if soc_name.startswith("Ascend910_93"):
        return ServerChip(soc_name, "ascend910b", 64 * gib)
    if soc_name in ("Ascend910A", "Ascend910ProA", "Ascend910PremiumA", "Ascend910ProB",
                    "Ascend910B"):
        return ServerChip(soc_name, "ascend910", 32 * gib)
    return None


def server_chip():
    """This server's Ascend chip (`chip_of` CANN's name for it, which pyACL's
    acl.get_soc_name() reads without starting a device), or None off Ascend."""
    # what CANN may print (ASCEND_SLOG_PRINT_TO_STDOUT) goes to stderr: the launch reads
    # this process's stdout as arguments
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        import acl   # CANN's pyACL, on the path once CANN's set_env.sh ran
        return chip_of(acl.get_soc_name() or "")
    except Exception:   # noqa: BLE001 - no CANN, or a pyACL without the call
        return None
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def launched_ranks() -> int:
    """Number of ranks the launcher started (1 for a stand-alone process).

    msrun and MindSpore's dynamic cluster set MS_WORKER_NUM; HCCL rank-table launches set
    RANK_SIZE.
    """
    for variable in ("MS_WORKER_NUM", "RANK_SIZE"):
        value = os.environ.get(variable)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {variable}={value!r} is not a number")
    return 1


def gathered_rows(row, device_num: int):
    """Every rank's `row` (a 1-D numpy array of the same length on each), rank by rank: one
    all-gather over the whole job, run at once (not in a graph). Every rank must call it at
    the same point. Float32 on the wire, which CPU ranks' collectives take: integers up to
    2**24 pass exactly."""
    import numpy as np
    from mindspore import Tensor, ops
    sent = np.asarray(row, np.float32)
    return ops.AllGather()(Tensor(sent)).asnumpy().reshape(device_num, sent.size)


def wait_for_every_rank(device_num: int):
    """Return once every rank has called it: ranks that stop together (a signal, too many bad
    steps) leave together, each with its checkpoint saved. msrun kills every worker as soon
    as one exits with another status than 0, which would cut a slower rank's save short."""
    gathered_rows([0.0], device_num)


def check_fits_launch(parallel: ParallelConfig, device_target: str, device_num: int):
    """Refuse a layout the launched run cannot execute, before anything is built: model or
    pipeline parallel on CPU, or another device count than the ranks launched."""
    if device_target == "CPU" and (parallel.model_parallel > 1 or parallel.pipeline_stage > 1):
        raise ConfigError(
            f"parallel.model_parallel={parallel.model_parallel} and parallel.pipeline_stage="
            f"{parallel.pipeline_stage}: MindSpore has no CPU backend for operator-level or "
            f"pipeline parallelism (it needs Ascend); on CPU use data_parallel only, and "
            f"{PLAN_HINT}")
    if parallel.device_num != device_num:
        raise ConfigError(
            f"the layout needs {parallel.device_num} devices (data_parallel "
            f"{parallel.data_parallel} x model_parallel {parallel.model_parallel} x "
            f"pipeline_stage {parallel.pipeline_stage}) but {device_num} were launched; "
            f"set parallel.data_parallel to match, or {PLAN_HINT}")


def init_parallel(parallel: ParallelConfig, requested_target: str = "auto") -> RunContext:
    """Set MindSpore's context for this process and start communication when launched as a rank.

    Stand-alone runs need no communication. On CPU several ranks train data-parallel over
    MindSpore's mccl backend; on Ascend they use hccl and the semi-auto parallel settings
    that `wrap_train_step` applies.
    """
    target = detect_device_target(requested_target)
    ranks = launched_ranks()
    check_fits_launch(parallel, target, ranks)
    set_run_context(target)
    if ranks == 1:
        return RunContext(target)
    from mindspore.communication import get_group_size, get_rank, init
    init()
    context = RunContext(target, rank=get_rank(), device_num=get_group_size())
    if target == "CPU":
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL,
                                     gradients_mean=True, device_num=context.device_num)
    return context


def data_shard(parallel: ParallelConfig, rank: int, global_batch_size: int) -> DataShard:
    """Which slice of each global batch `rank` reads, matching the dataset strategy.

    Default ("data_parallel" dataset strategy): MindSpore splits dimension 0 of every input
    over the devices_per_stage ranks of a pipeline stage, whatever model_parallel is, so each
    of them must read its own slice: num_shards = devices per stage, shard_id = rank within
    the stage. Feeding one slice to a whole model-parallel group would duplicate samples.
    With full_batch every rank reads the whole global batch.
    """
    if parallel.full_batch:
        return DataShard(num_shards=1, shard_id=0, batch_size=global_batch_size)
    per_stage = parallel.devices_per_stage
    return DataShard(num_shards=per_stage, shard_id=rank % per_stage,
                     batch_size=global_batch_size // per_stage)


def micro_batching(parallel: ParallelConfig, context: RunContext,
                   accumulation: int) -> MicroBatching:
    """Where the micro batches of a step are made.

    Semi-auto parallel: on a pipeline, accumulation is more micro batches (Pipeline with
    micro_batch_num x accumulation, as MindSpore's pipeline tutorial advises); without one,
    MindSpore's GradAccumulation cell. Either way the compiler sums the gradients and
    reduces them across devices once per step (slicing the batch in Python would unroll the
    graph and all-reduce every micro step's gradients). Elsewhere the train step slices the
    batch itself and reduces once after the loop.
    """
    if context.semi_auto and parallel.pipeline_stage > 1:
        return MicroBatching("pipeline", parallel.micro_batch_num * accumulation)
    if context.semi_auto and accumulation > 1:
        return MicroBatching("accumulation", accumulation)
    return MicroBatching(in_step=accumulation)


def micro_batch_network(loss_network, batching: MicroBatching):
    """The loss network wrapped in the MindSpore cell that makes the micro batches, if any.

    Inside such a cell the network is compiled once and called per micro batch
    (`ReusedPerMicroBatch`), not inlined once per micro batch; not on CPU, whose backend
    refuses a reused subgraph ("Input[0] must be a Primitive ValueNode": MindSpore
    documents lazy_inline for Ascend) and where these cells only run stand-alone, in tests.
    """
    if not batching.wrapper:
        return loss_network
    if ms.get_context("device_target") != "CPU":
        loss_network = ReusedPerMicroBatch(loss_network)
    if batching.wrapper == "pipeline":
        from mindspore.parallel.nn import Pipeline
        return Pipeline(loss_network, batching.micro_batches)
    from mindspore.parallel.nn import GradAccumulation
    return GradAccumulation(loss_network, batching.micro_batches)


class ReusedPerMicroBatch(nn.Cell):
    """`network` as one subgraph that every micro batch calls (MindSpore's `lazy_inline`).

    Pipeline and GradAccumulation call their network once per micro batch; by default
    MindSpore inlines each call, so the graph holds one copy of the model per micro step
    (GPT-2 1024 at 32 micro batches did not compile in 600 s). `lazy_inline` on the cell the
    micro-batch cell wraps is what MindSpore documents for gradient accumulation, and what
    MindFormers puts on its models' `__init__`; here it marks a wrapper, so the model
    folders stay free of it and CPU runs (no micro-batch cells) never see it. Parameter
    names are unchanged (no prefix).

    Inputs:
        *inputs: the network's.
    Outputs:
        the network's.
    """

    @lazy_inline
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, *inputs):
        return self.network(*inputs)


def parameter_init(context: RunContext):
    """Context manager to build the network and optimizer under.

    Semi-auto parallel: `mindspore.nn.utils.no_init_parameters()`, so that no rank allocates
    the whole model; each rank initialises only its slices when the graph is compiled. This
    is what MindSpore 2.10's parallel tutorials and AutoParallel's own example use (the
    function's docstring marks it deprecated after 2.9, but 2.10 documents no replacement:
    `AutoParallel.no_init_parameters_in_compile` is experimental and only skips the
    initialisation during compilation). Elsewhere parameters are allocated as they are made.
    """
    if context.semi_auto:
        from mindspore.nn.utils import no_init_parameters
        return no_init_parameters()
    return contextlib.nullcontext()


def wrap_train_step(train_step, parallel: ParallelConfig, context: RunContext,
                    strategy_file: str):
    """Apply semi-auto parallel to the outermost cell on Ascend; other runs return it as is.

    Sets the pipeline stages, the dataset strategy, the parallel optimizer when
    optimizer_shard is on, and saves the parameter strategy file that distributed
    checkpoints need.
    """
    if not context.semi_auto:
        return train_step
    # every micro batch is a call of the model's graph: a pipeline of 64 micro batches
    # and 8 accumulation steps passes MindSpore's default depth of 1,000 calls (seen with
    # `model-zoo dryrun` on gpt-100b); MindFormers' configs raise it the same way
    # (`max_call_depth: 10000`)
    ms.set_recursion_limit(COMPILE_CALL_DEPTH)
    from mindspore.parallel.auto_parallel import AutoParallel
    parallel_step = AutoParallel(train_step, parallel_mode="semi_auto")
    parallel_step.dataset_strategy("full_batch" if parallel.full_batch else "data_parallel")
    # gradients_mean stays off and loss_repeated_mean on (AutoParallel's defaults, and
    # PanGu-alpha's settings): every loss is a mean over the global batch (its reductions
    # carry dp strategies, so MindSpore all-reduces them), so each device's gradient is
    # already its share of the global gradient and the mirror all-reduce must sum, not
    # average. Averaging would divide each parameter by its own mirror group: dp for
    # model-parallel weights, dp x mp for replicated ones (layer norms, biases), shrinking
    # all gradients by dp and the replicated ones by mp more.
    if parallel.pipeline_stage > 1:
        parallel_step.pipeline(stages=parallel.pipeline_stage,
                               interleave=parallel.pipeline_interleave > 1,
                               scheduler=parallel.pipeline_scheduler)
    if parallel.optimizer_shard:
        parallel_step.hsdp()
    os.makedirs(os.path.dirname(strategy_file), exist_ok=True)
    parallel_step.save_param_strategy_file(strategy_file)
    # list every parameter, not only those that require gradients (AutoParallel's
    # default): a resume on another layout cuts every entry with this file, and
    # `transform_checkpoint_by_rank` copies an unlisted entry unchanged from another rank.
    # AdamW's moments and the gradient buffers are clones of the weights (requires_grad
    # too) and are listed either way; this keeps any other state listed, as MindFormers
    # does (`only_trainable_params: False`)
    parallel_step.disable_strategy_file_only_for_trainable_params()
    return parallel_step


class HeldoutLoss(nn.Cell):
    """The training network's loss without a backward pass, as the mean over `micro_batches`
    slices of the batch (pipeline stages take their input micro batch by micro batch, as
    MindSpore's pipeline inference tutorial cuts it, `PipelineCellInference`).

    Inputs:
        *batch: the training network's inputs, batch along dimension 0.
    Outputs:
        the mean loss, a scalar.
    """

    def __init__(self, network, micro_batches: int = 1):
        super().__init__(auto_prefix=False)
        self.network = network
        self.micro_batches = micro_batches

    def construct(self, *batch):
        if self.micro_batches == 1:
            return self.network(*batch)
        size = batch[0].shape[0] // self.micro_batches
        total = 0.0
        for index in range(self.micro_batches):
            total = total + self.network(*[column[index * size:(index + 1) * size]
                                           for column in batch])
        return total / self.micro_batches


def eval_network_compiles(parallel: ParallelConfig) -> bool:
    """Whether MindSpore 2.10 compiles `wrap_eval_network` for the layout: not with
    interleaved pipeline stages, whose stage order goes back to 0 between chunks (its
    pipeline inference refuses that order, "PreNode's stage:1 is larger than NextNode's
    stage:0", and with `interleave=True` its compiler crashes). Such runs train without the
    in-run held-out evaluation, and say so."""
    return parallel.pipeline_interleave == 1


def wrap_eval_network(network, parallel: ParallelConfig, context: RunContext,
                      accumulation: int = 1):
    """The held-out loss of `network` (HeldoutLoss), compiled on Ascend under the same
    semi-auto settings and dataset strategy as the train step, so that every rank runs on
    its slices of the weights and its shard of the batch, as PanGu-alpha evaluates through
    an eval network compiled in the parallel context. With pipeline stages the batch goes
    through in the train step's micro batches (`accumulation`: train.grad_accumulation)
    and the last stage's loss is broadcast to the others (`pipeline(output_broadcast=True)`,
    MindSpore's pipeline inference); parameters shared across stages must then be synced
    before each evaluation (`sync_shared_parameters`). Elsewhere the loss network as it is."""
    if not context.semi_auto:
        return network
    from mindspore.parallel.auto_parallel import AutoParallel
    # the train step's micro batches (and, as there, one subgraph that each of them calls)
    micro_batches = micro_batching(parallel, context, accumulation).micro_batches \
        if parallel.pipeline_stage > 1 else 1
    held_out = HeldoutLoss(ReusedPerMicroBatch(network) if micro_batches > 1 else network,
                           micro_batches)
    held_out.set_train(False)
    parallel_eval = AutoParallel(held_out, parallel_mode="semi_auto")
    parallel_eval.dataset_strategy("full_batch" if parallel.full_batch else "data_parallel")
    if parallel.pipeline_stage > 1:
        parallel_eval.pipeline(stages=parallel.pipeline_stage, output_broadcast=True)
    if parallel.optimizer_shard:
        parallel_eval.hsdp()
    return parallel_eval


def sync_shared_parameters(eval_network, parallel: ParallelConfig, first_batch):
    """Before a pipelined eval network runs: compile it (on `first_batch`) and copy the
    parameters that stages share (GPT-2's tied embedding, which only the train step keeps
    in step across stages) from the stage that trains them, as MindSpore's pipeline
    inference tutorial does after compiling (`sync_pipeline_shared_parameters`). Every
    rank must call it at the same point: it communicates."""
    if parallel.pipeline_stage == 1:
        return
    from mindspore.parallel import sync_pipeline_shared_parameters
    eval_network.compile(*first_batch)
    sync_pipeline_shared_parameters(eval_network)


def gradient_reducer(parameters, context: RunContext):
    """The cell that combines gradients across ranks inside a hand-written train step.

    CPU data parallel: all-reduce (mean) over all ranks, without which the ranks drift apart
    (each rank's loss is the mean of its own slice). Semi-auto parallel and stand-alone
    runs: None (MindSpore inserts the mirror all-reduce; pipelines and accumulation go
    through the train step's `accumulated_by_compiler` buffers, not MindSpore's
    PipelineGradReducer, whose non-optimizer-shard branch does not compile in 2.10: its
    `construct` names an undefined `grads`).
    """
    if not context.distributed or context.semi_auto:
        return None
    from mindspore import nn
    return nn.DistributedGradReducer(parameters, mean=True, degree=context.device_num)
