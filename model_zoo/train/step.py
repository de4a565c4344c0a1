"""The train step: forward, backward, gradient reduction, loss scaling, clipping, update.

One cell holds everything a step changes (model, optimizer moments, loss scale, step
counter), so one checkpoint of it is enough to resume exactly.
"""

import os

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer

from model_zoo.checkpoint.contents import (GRADIENT_BUFFERS, LOSS_AVERAGE, STEP_COUNTER,
                                           STEP_TALLY, STOP_FLAG)
from model_zoo.nn.backend import cpu_kernel, use_cpu_kernels
from model_zoo.nn.layers import DROPOUT_STEP


class StopVote(nn.Cell):
    """What all ranks decide together in each step: whether any rank was asked to stop (a
    signal), and the step's loss, the same on every rank. One all-reduce over all ranks
    sums each rank's stop flag (0 or 1) and its loss times `loss_weight`:
    - CPU data parallel: each rank's loss is the mean over its own slice of the batch, and
      weight 1 / ranks gives the global batch's mean;
    - semi-auto parallel: every rank of the last pipeline stage holds the global batch's
      loss (MindSpore all-reduces the loss's reductions over dp), earlier stages hold none:
      weight 1 / devices per stage on the last stage, 0 elsewhere (`loss_weight_of`).
    So all ranks stop after the same step and save the same state, log the same loss and
    take the same bad-step decisions. MindSpore's own graceful exit reduces its flag inside
    TrainOneStepCell the same way (`mindspore/utils/utils.py` ExitByRequest); a collective
    outside the step would add a launch per step. Stand-alone runs return their own.

    Inputs:
        loss: the rank's loss, a scalar.
    Outputs:
        (stop, loss): float32 (1,), > 0 if some rank asked to stop (a float sum: MindSpore's
        CPU AllReduce takes neither integers nor MAX); the float32 scalar loss.
    """

    def __init__(self, distributed: bool = False, loss_weight: float = 1.0):
        super().__init__()
        self.flag = Parameter(Tensor([0.0], ms.float32), name=STOP_FLAG, requires_grad=False)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM) if distributed else None
        self.loss_weight = float(loss_weight)

    def request(self):
        """Ask to stop after the next step (the flag is read when that step runs)."""
        self.flag.set_data(Tensor([1.0], ms.float32))

    def construct(self, loss):
        loss = ops.cast(loss, ms.float32)
        if self.all_reduce is None:
            return self.flag * 1, loss
        if self.loss_weight > 0:
            weighted = ops.reshape(loss * self.loss_weight, (1,))
        else:   # an earlier pipeline stage: its loss output is not the model's loss
            weighted = ops.zeros((1,), ms.float32)
        # the flag's read waits for `loss` even where the loss is weighted out: the caller
        # orders this all-reduce after the gradient norm's through `loss`, and two
        # collectives over one group in different orders on different stages would pair
        # the wrong tensors (seen on CPU ranks: pipeline with the optimizer shard)
        flag = ops.depend(self.flag, loss)
        both = self.all_reduce(ops.concat((flag, weighted)))
        return both[0:1], both[1]


# why StepTally counts a step as bad (0: it is not)
BAD_STEP_REASONS = {1: "the loss is not finite", 2: "the gradients are not finite",
                    3: "the loss is a spike",
                    4: "the gradients overflow at the loss scale's floor (1)"}
LOSS_SCALE_FLOOR = 1.0   # the dynamic loss scale is never halved below it


class StepTally(nn.Cell):
    """What the training loop learns about the steps run since its last read, kept on the
    device: the loop reads it once per log interval, or per sink of steps (dataset sink
    mode, where only a sink's last step's outputs come back to the host), and still sees
    every step. One float32 vector, `FIELDS`: the sum and count of the applied steps'
    losses in the current log interval (restarted by the step counter every `log_steps`
    steps), and over the run so far the bad steps, the bad steps in a row now and at most,
    and the last bad step's reason (a key of BAD_STEP_REASONS). The host only reads it: a
    write from the host between steps cost GPT-2 tiny's CPU step 1.7 ms.

    A step is bad when its update was not applied (a non-finite loss or gradients, or a
    loss spike), except an fp16 overflow with a finite loss (`overflow_expected`): the
    dynamic loss scale absorbs those by design, unless the scale the step used was already
    at its floor (LOSS_SCALE_FLOOR), where it can absorb nothing more: a run overflowing
    there would skip every step for ever, so those count, and `train.max_bad_steps` stops
    it. Every rank holds the same loss (StopVote), decision (GradientNorm) and scale, so
    every rank counts alike.

    Inputs:
        loss: float32 scalar; applied, finite: bool scalars (TrainStep's); steps_before:
        the int32 count of steps run before this one; scale: the float32 loss scale the
        step used.
    Outputs:
        the loss, made to wait for the tally's update.
    """

    FIELDS = ("loss_sum", "applied", "bad", "bad_in_row", "most_bad_in_row", "last_bad")

    def __init__(self, log_steps: int = 1, overflow_expected: bool = False):
        super().__init__()
        # an initializer, as the weights have: a sharded run allocates none of them before
        # the compile (`parameter_init`)
        self.tally = Parameter(initializer(Zero(), (len(self.FIELDS),), ms.float32),
                               name=STEP_TALLY, requires_grad=False)
        self.log_steps = log_steps
        self.overflow_expected = overflow_expected

    def construct(self, loss, applied, finite, steps_before, scale):
        zero, one = ops.zeros((), ms.float32), ops.ones((), ms.float32)
        gradients_bad = one * 2.0
        if self.overflow_expected:
            gradients_bad = ops.select(scale <= LOSS_SCALE_FLOOR, one * 4.0, zero)
        reason = ops.select(ops.isfinite(loss),
                            ops.select(finite, one * 3.0, gradients_bad), one)
        reason = ops.select(applied, zero, reason)
        bad = reason > 0.0
        tally = self.tally * 1.0
        restart = steps_before % self.log_steps == 0    # a log interval starts
        in_row = ops.select(bad, tally[3] + 1.0, zero)
        updated = ops.stack((ops.select(restart, zero, tally[0])
                             + ops.select(applied, loss, zero),
                             ops.select(restart, zero, tally[1]) + ops.cast(applied, ms.float32),
                             tally[2] + ops.cast(bad, ms.float32),
                             in_row, ops.maximum(tally[4], in_row),
                             ops.select(bad, reason, tally[5])))
        return ops.depend(loss, ops.assign(self.tally, updated))

    def read(self) -> dict:
        """The tally as a dict of FIELDS (waits for the steps queued so far)."""
        return {name: float(value) for name, value in zip(self.FIELDS, self.tally.asnumpy())}


def loss_weight_of(rank: int, device_num: int, parallel=None) -> float:
    """StopVote's weight of `rank`'s loss: 1 / device_num (CPU data parallel, or `parallel`
    None); with a semi-auto `parallel` layout, 1 / devices per stage on the last stage and 0
    on the others."""
    if parallel is None:
        return 1.0 / device_num
    last_stage = rank // parallel.devices_per_stage == parallel.pipeline_stage - 1
    return 1.0 / parallel.devices_per_stage if last_stage else 0.0


class GradientNorm(nn.Cell):
    """The global gradient norm, and one decision shared by every device whether it is finite.

    Stand-alone and CPU data-parallel runs hold whole gradients (already all-reduced), so
    every gradient counts once and nothing is communicated. In semi-auto parallel each
    device holds slices: it weights each parameter's local squared norm (`weights`, from
    `replication.norm_weights`: 1 / copies of the piece, 0 for other stages' parameters)
    and one all-reduce over all devices sums the weighted squares together with the
    overflow flags, so every device gets the same norm and takes the same decision (a
    collective that some ranks skipped would hang the job, so this runs before any branch).

    Args:
        weights: one factor per gradient, or None to count every gradient once.
        all_reduce: sum over every device of the job (MindSpore's world group).
        float_status: also read the device's overflow status (Ascend 910, whose saturation
            mode turns an overflow into the largest float instead of inf: `isfinite` alone
            would miss it); see `uses_float_status`.

    Inputs:
        grads: tuple of the gradients (local slices), any float dtype.
    Outputs:
        (norm, finite): float32 scalar of the (still loss-scaled) global norm, and a bool
        scalar, False when any device saw an inf, a nan or a raised overflow status.
    """

    def __init__(self, weights=None, *, all_reduce=False, float_status=False):
        super().__init__()
        self.selected, self.weights = None, None
        if weights is not None:
            chosen = [(index, float(w)) for index, w in enumerate(weights) if w > 0]
            self.selected = tuple(index for index, _ in chosen)
            self.weights = tuple(w for _, w in chosen)
        self.all_reduce = ops.AllReduce() if all_reduce else None
        self.float_status = float_status
        self.status_buffer = Tensor(np.zeros(8, np.int32))  # what the float-status ops fill
        if float_status:
            from mindspore.ops.operations.math_ops import (NPUClearFloatStatusV2,
                                                           NPUGetFloatStatusV2)
            self.clear_status, self.get_status = NPUClearFloatStatusV2(), NPUGetFloatStatusV2()
        self.squared_norm = cpu_kernel("squared_norm") if weights is None else None
        self.hyper_map = ops.HyperMap()

    def clear_before(self, batch):
        """`batch`, made to wait until the overflow status is cleared: the status the step
        reads then covers its forward and backward passes, as in MindSpore's functional
        training (`mindspore/amp.py` `_all_finite` reads the status after the gradients and
        clears it for the next step; this step clears it again after its read)."""
        if not self.float_status:
            return batch
        return ops.depend(batch, self.clear_status(self.status_buffer))

    def construct(self, grads):
        squares = self._local_squares(grads)
        flag = ops.zeros((), ms.float32)
        if self.float_status:
            status = self.get_status(ops.depend(self.status_buffer, squares))
            flag = ops.reduce_sum(ops.cast(status, ms.float32))
        if self.all_reduce is not None:
            both = self.all_reduce(ops.stack((squares, flag)))
            squares, flag = both[0], both[1]
        if self.float_status:
            # cleared again after the collective, so this step's status does not leak into
            # the next one (MindSpore's TrainOneStepWithLossScaleCell does the same)
            squares = ops.depend(squares, self.clear_status(
                ops.depend(self.status_buffer, squares)))
        finite = ops.logical_and(ops.isfinite(squares), flag <= 0.0)
        return ops.sqrt(squares), finite

    def _local_squares(self, grads):
        """Sum of the squares of the gradient elements this device holds, weighted."""
        if self.selected is None:
            if self.squared_norm is not None:
                return ops.reshape(self.squared_norm(*grads), ())
            return ops.addn(self.hyper_map(_squared_sum, grads))
        total = ops.zeros((), ms.float32)
        for position in range(len(self.selected)):
            total = total + _squared_sum(grads[self.selected[position]]) * self.weights[position]
        return total


class ScaledLoss(nn.Cell):
    """`network`'s loss on a batch times the backward pass's sensitivity: the function whose
    value and gradients the train step takes in one pass (the loss is the value divided by
    the sensitivity). Not the loss as an auxiliary output (`has_aux`): with it, MindSpore
    2.10's semi-auto parallel pass gave gradients 4 times one device's (mp2 and dp2 x mp2;
    tests/test_dryrun.py, the partitioned step against one device).

    Inputs:
        *batch, sens: the batch's columns, then a float32 scalar.
    Outputs:
        loss * sens.
    """

    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, *batch_and_sens):
        loss = self.network(*batch_and_sens[:-1])
        return loss * ops.cast(batch_and_sens[-1], loss.dtype)


class TrainStep(nn.Cell):
    """One optimizer step over a batch, with optional gradient accumulation.

    Args:
        network: cell mapping the batch columns to a scalar loss; on Ascend it may be
            MindSpore's Pipeline or GradAccumulation wrapper, which cuts the batch into
            `micro_batches` and returns the sum of their losses.
        optimizer: a MindSpore optimizer over the network's trainable parameters.
        lr_schedule: the optimizer's schedule, evaluated here for logging.
        grad_reducer: cell that combines gradients across ranks, or None.
        dynamic_loss_scale: scale the loss (fp16): a step whose gradients overflow is
            skipped and the scale halved; after `scale_window` good steps it doubles.
        loss_scale: the initial scale (used only with dynamic_loss_scale).
        grad_clip: clip the global gradient norm to this value (0 disables).
        accumulation: micro batches cut here (stand-alone and CPU data parallel): the batch
            is cut into that many equal slices whose gradients are summed before one update.
        micro_batches: how many micro-batch losses `network` sums. The backward pass gets
            the sensitivity divided by it (as PanGu-alpha and MindFormers' pipeline cells
            do), so loss, gradients and norm are those of the mean, as without the wrapper.
        accumulated_by_compiler: semi-auto parallel with a Pipeline / GradAccumulation
            wrapper: MindSpore sums the micro batches' gradients into `accu_grads` buffers
            (found by that name prefix) and reduces them once a step; the step reads them
            (or, with `optimizer_shard`, the reduce-scattered gradients) and clears them
            after the update, as `mindspore.nn.wrap.cell_wrapper._TrainGradAccuStepCell`
            and MindFormers' `MFPipelineWithLossScaleCell` do.
        optimizer_shard: the parallel optimizer is on (see accumulated_by_compiler).
        gradient_norm: the GradientNorm cell (default: whole gradients, no communication).
        stop_vote: the StopVote cell (default: this rank's flag and loss only).
        loss_spike_factor: skip the update of a step whose loss is above this many times
            the running average of the applied steps' losses (`loss_average`; 0: never).
        log_steps: the log interval over which the StepTally sums the losses.

    Inputs:
        *batch: the dataset's columns, batch along dimension 0.
    Outputs:
        (loss, applied, loss_scale, grad_norm, lr, stop, finite): the loss averaged over
        micro batches, the same on every rank (StopVote), whether the update was applied
        (the gradients were finite and the loss no spike), the scale used, the unclipped
        gradient norm, the lr used, whether some rank asked to stop (StopVote), and
        whether the gradients were finite (the overflow decision; on Ascend 910 an
        overflow saturates, so the norm alone does not tell).
    """

    def __init__(self, network, optimizer, lr_schedule, *, grad_reducer=None,
                 dynamic_loss_scale=False, loss_scale=65536.0, scale_window=1000,
                 grad_clip=1.0, accumulation=1, micro_batches=1, accumulated_by_compiler=False,
                 optimizer_shard=False, gradient_norm=None, stop_vote=None,
                 loss_spike_factor=0.0, log_steps=1):
        super().__init__(auto_prefix=False)
        self.network = network
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.weights = optimizer.parameters
        self.grad_reducer = grad_reducer
        self.dynamic_loss_scale = dynamic_loss_scale
        self.loss_scale = Parameter(Tensor(loss_scale if dynamic_loss_scale else 1.0,
                                           ms.float32), name="loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps",
                                    requires_grad=False)
        self.scale_window = scale_window
        self.grad_clip = grad_clip
        self.accumulation = accumulation
        self.micro_batches = micro_batches
        self.accumulated_by_compiler = accumulated_by_compiler
        self.optimizer_shard = optimizer_shard
        if accumulated_by_compiler:
            self.accu_grads = self.weights.clone(prefix=GRADIENT_BUFFERS, init="zeros")
        self.step = Parameter(Tensor(0, ms.int32), name=STEP_COUNTER, requires_grad=False)
        self.loss_spike_factor = float(loss_spike_factor)
        self.loss_average = Parameter(Tensor(0.0, ms.float32), name=LOSS_AVERAGE,
                                      requires_grad=False)
        self.keyed_dropout = use_cpu_kernels()   # the masks follow DROPOUT_STEP
        # these optimizers unscale and clip the gradients as they read them, and skip a
        # step that is not finite themselves
        self.optimizer_scales = isinstance(optimizer, (FusedAdamWeightDecay,
                                                       SkippingAdamWeightDecay))
        self.hyper_map = ops.HyperMap()
        self.gradient_norm = gradient_norm if gradient_norm is not None else GradientNorm()
        # the loss and its gradients from one pass on every device, as MindSpore documents
        # functional training (pipeline included: value_and_grad of the Pipeline cell). On CPU
        # MindSpore kept the forward pass of a separate `network(*batch)` apart from the one
        # the gradient ran (profiled: the vocabulary projection and the cross-entropy ran
        # twice a step)
        self.loss_and_grads = ops.value_and_grad(ScaledLoss(network), None, self.weights)
        self.stop_vote = stop_vote if stop_vote is not None else StopVote()
        self.step_tally = StepTally(log_steps, overflow_expected=dynamic_loss_scale)

    def _gradients(self, batch, scale):
        """Loss and summed (still scaled) gradients over the accumulation micro batches,
        every one of which waits for the overflow status to be cleared."""
        batch = self.gradient_norm.clear_before(batch)
        if self.accumulation == 1:
            loss, grads = self._loss_and_gradients(self._keyed(batch, 0), scale)
            return loss / self.micro_batches, grads
        size = batch[0].shape[0] // self.accumulation
        loss_sum, grads = None, None
        for index in range(self.accumulation):
            micro = self._keyed(tuple(column[index * size:(index + 1) * size]
                                      for column in batch), index)
            loss, micro_grads = self._loss_and_gradients(micro, scale)
            if grads is None:
                loss_sum, grads = loss, micro_grads
            else:
                loss_sum = loss_sum + loss
                grads = self.hyper_map(ops.add, grads, micro_grads)
        return loss_sum / (self.accumulation * self.micro_batches), grads

    def _loss_and_gradients(self, micro, scale):
        """Loss and (still scaled) gradients of one (micro) batch, the sensitivity divided
        over the wrapper's micro batches."""
        sens = ops.cast(scale / self.micro_batches, ms.float32)
        scaled, grads = self.loss_and_grads(*micro, sens)
        return scaled / sens, grads

    def _keyed(self, batch, micro: int):
        """The batch, once DROPOUT_STEP holds (this step, micro batch `micro`): the dropout
        masks of its forward and backward passes follow the step, which checkpoints keep,
        so a resumed run draws the masks it would have."""
        if not self.keyed_dropout:
            return batch
        # * 1: the step's value (PyNative refuses to stack a Parameter with a tensor)
        key = ops.stack((self.step * 1, Tensor(micro, ms.int32)))
        return ops.depend(batch, ops.assign(DROPOUT_STEP, key))

    def construct(self, *batch):
        # a copy: returning the Parameter itself would report its value after this step's
        # adjustment instead of the scale this step used
        scale = self.loss_scale * 1.0
        lr = self.lr_schedule(self.optimizer.global_step)
        loss, grads = self._gradients(batch, scale)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        if self.accumulated_by_compiler and not self.optimizer_shard:
            grads = self.hyper_map(_read_accumulated, self.accu_grads, grads)
        # One pass over the gradients for the norm and one to unscale and clip them. A
        # non-finite gradient makes the norm non-finite, so the norm also tells whether the
        # step can be applied (cheaper than testing every gradient element).
        divisor = scale * self.accumulation
        norm, finite = self.gradient_norm(grads)
        # before any branch, every rank runs this collective, and after the gradient norm's
        # (it waits for the norm): two collectives over the same group without an order
        # between them could be issued in different orders on different ranks (MindSpore's
        # ExitByRequest and PanGu-alpha's overflow all-reduce also wait for the gradients)
        stop, loss = self.stop_vote(ops.depend(loss, norm))
        applied = self._not_a_spike(finite, loss)
        loss = self.step_tally(loss, applied, finite, self.step * 1, scale)
        grad_norm = norm / divisor
        factor = 1.0 / divisor
        if self.grad_clip > 0:
            factor = factor * self.grad_clip / ops.maximum(grad_norm, self.grad_clip)
        if not self.optimizer_scales:
            grads = self.hyper_map(ops.partial(_multiply, factor), grads)
        if self.dynamic_loss_scale:
            self._adjust_loss_scale(finite)
        if self.optimizer_scales:
            # no branch: the optimizer skips a step that is not finite by itself (a branch
            # of the graph costs MindSpore on CPU about 1 ms a step, which GPT-2 tiny's
            # 27 ms step spent switching between its subgraphs, and made the parallel
            # compile of a model reused per micro batch exponential: SkippingAdamWeightDecay)
            loss = ops.depend(loss, self.optimizer(grads, factor, applied))
        elif applied:
            loss = ops.depend(loss, self.optimizer(grads))
        if self.accumulated_by_compiler:
            every = self.step >= 0   # True, but not a constant the compiler could fold
            loss = ops.depend(loss, self.hyper_map(
                ops.partial(_clear_accumulated, every, loss), self.accu_grads))
        loss = ops.depend(loss, ops.assign_add(self.step, Tensor(1, ms.int32)))
        return loss, applied, scale, grad_norm, lr, stop, finite

    def _not_a_spike(self, finite, loss):
        """`finite`, and False when the loss is a spike (loss_spike_factor); the running
        average then follows the loss of every applied step (it starts at the first)."""
        if self.loss_spike_factor <= 0:
            return finite
        average = self.loss_average * 1.0
        spike = ops.logical_and(average > 0.0, loss > average * self.loss_spike_factor)
        applied = ops.logical_and(finite, ops.logical_not(spike))
        followed = ops.select(average > 0.0, average * 0.9 + loss * 0.1, loss)
        ops.assign(self.loss_average, ops.select(applied, followed, average))
        return applied

    def _adjust_loss_scale(self, finite):
        good = ops.select(finite, self.good_steps + 1, ops.zeros_like(self.good_steps))
        grow = good >= self.scale_window
        grown = ops.select(grow, self.loss_scale * 2.0, self.loss_scale)
        lowered = ops.maximum(self.loss_scale / 2.0, LOSS_SCALE_FLOOR)
        ops.assign(self.loss_scale, ops.select(finite, grown, lowered))
        ops.assign(self.good_steps, ops.select(grow, ops.zeros_like(good), good))


def _read_accumulated(accumulated, grad):
    """The compiler-accumulated gradient, read after this step's backward pass (no copy:
    it is cleared only once the scaled gradients made from it have been used)."""
    return ops.depend(accumulated, grad)


def _clear_accumulated(every, updated, accumulated):
    """Zero an accumulation buffer once this step's update has used the gradients: every
    element filled, `every` being a runtime True. Not `assign(zeros_like(buffer))` as
    MindSpore's own pipeline cell clears its buffers: with static shapes MindSpore folds
    that into a constant as large as the buffer slice (device memory beside the buffer;
    the MindIR of one Mixtral-8x7B pipeline stage passed protobuf's 2 GB from them). A
    fill, unlike a product with 0, also clears an inf or nan of a skipped step."""
    accumulated = ops.depend(accumulated, updated)
    return ops.assign(accumulated, ops.masked_fill(accumulated, every,
                                                   ops.cast(0.0, accumulated.dtype)))


def _multiply(factor, grad):
    return grad * ops.cast(factor, grad.dtype)


def _squared_sum(grad):
    return ops.reduce_sum(ops.square(ops.cast(grad, ms.float32)))


def uses_float_status(context) -> bool:
    """Whether overflow must be read from the device's float status: on Ascend 910 (always in
    saturation mode) and on 910B when MS_ASCEND_CHECK_OVERFLOW_MODE=SATURATION_MODE (its
    default INFNAN_MODE produces inf/nan, which the norm catches). This is the test
    MindSpore's TrainOneStepWithLossScaleCell makes (`nn/wrap/loss_scale.py`); `context`
    (a RunContext) names the chip a dry run compiles as."""
    if context.device_target != "Ascend":
        return False
    saturation = os.environ.get("MS_ASCEND_CHECK_OVERFLOW_MODE") == "SATURATION_MODE"
    return context.ascend_910() or (context.ascend_910b() and saturation)


class FusedAdamWeightDecay(nn.AdamWeightDecay):
    """`nn.AdamWeightDecay` as one fused CPU kernel over all parameters
    (`cpu_kernels.adamw_update`) instead of one kernel launch per parameter, with the
    train step's gradient factor (unscaling and clipping) applied as the kernel reads the
    gradients. The same parameters, moments and names: checkpoints are interchangeable.

    Inputs:
        gradients: tuple of float32 gradients, in the order of the parameters.
        factor: float32 scalar the gradients are multiplied by (default 1).
        finite: bool scalar; False leaves the parameters, moments and step count as they
            are (default True).
    Outputs:
        a float32 (1,) placeholder, for ordering.
    """

    def __init__(self, params, learning_rate, beta1, beta2, eps):
        super().__init__(params, learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps)
        self.constants = Tensor(np.array([beta1, beta2, eps], np.float32))
        decays = self.weight_decay if self.is_group else (self.weight_decay,) * len(
            self._parameters)
        fixed = not self.dynamic_weight_decay   # a schedule of decays is not supported
        self.decays = Tensor(np.array([float(decay) if flag and fixed else 0.0 for decay, flag
                                       in zip(decays, self.decay_flags)], np.float32))
        self.update = cpu_kernel("adamw_update", dtype=ms.float32)
        if self.update is None:
            raise ValueError("FusedAdamWeightDecay runs on the fused CPU kernels only; "
                             "build_optimizer picks the optimizer for the device")
        self.one = Tensor(1.0, ms.float32)

    def construct(self, gradients, factor=None, finite=None):
        lr = self.get_lr()
        if factor is None:   # called as any optimizer is, with the gradients alone
            factor = self.one
        if finite is None:
            apply = self.one
        else:
            apply = ops.cast(finite, ms.float32)
        step_increase = ops.cast(apply, ms.int32) * self.global_step_increase_tensor
        self.assignadd(self.global_step, step_increase)
        return self.update(ops.reshape(lr, (1,)), ops.reshape(ops.cast(factor, ms.float32), (1,)),
                           ops.reshape(apply, (1,)), self.constants, self.decays,
                           *self._parameters, *self.moments1, *self.moments2, *gradients)


class SkippingAdamWeightDecay(nn.AdamWeightDecay):
    """`nn.AdamWeightDecay` that applies the train step's gradient factor (unscaling and
    clipping) as it reads the gradients and leaves parameters, moments and step count as
    they are on a non-finite step, without a branch in the graph: the same update as
    MindSpore's (its `_update_run_op`: no bias correction, decay on the flagged
    parameters), each result selected against the old value by `finite`.

    The train step of a semi-auto run takes no branch because of this: with the model
    compiled once for all micro batches (`context.ReusedPerMicroBatch`), MindSpore 2.10's
    parallel pass took exponentially long in the number of blocks over a step that branched
    on the overflow (GPT-2 tiny, 8 micro batches: 2.7 s at 1 block, over 100 s at 4;
    measured with `model-zoo dryrun`). Same parameters, moments and names as
    `nn.AdamWeightDecay`: checkpoints are interchangeable.

    Inputs:
        gradients: tuple of gradients, in the order of the parameters.
        factor: float32 scalar the gradients are multiplied by.
        finite: bool scalar; False leaves everything as it was.
    Outputs:
        a tuple of the updated parameters' values, for ordering.
    """

    def construct(self, gradients, factor=None, finite=None):
        lr = self.get_lr()
        if factor is None:
            factor = ops.ones((), ms.float32)
        if finite is None:
            finite = ops.ones((), ms.bool_)
        self.assignadd(self.global_step, ops.cast(finite, ms.int32) *
                       self.global_step_increase_tensor)
        factor = ops.cast(factor, ms.float32)
        decay = self.get_weight_decay()
        if self.is_group:   # a decay per parameter
            return self.hyper_map(ops.partial(_skipping_adamw, self.beta1, self.beta2,
                                              self.eps, lr, factor, finite),
                                  decay, self._parameters, self.moments1, self.moments2,
                                  gradients, self.decay_flags)
        return self.hyper_map(ops.partial(_skipping_adamw, self.beta1, self.beta2, self.eps,
                                          lr, factor, finite, decay),
                              self._parameters, self.moments1, self.moments2, gradients,
                              self.decay_flags)


def _skipping_adamw(beta1, beta2, eps, lr, factor, finite, weight_decay, param, m, v,
                    gradient, decay_flag):
    """One parameter's AdamW step in float32, applied only when `finite`."""
    g = ops.cast(gradient, ms.float32) * factor
    m32, v32, p32 = (ops.cast(t, ms.float32) for t in (m, v, param))
    next_m = beta1 * m32 + (1.0 - beta1) * g
    next_v = beta2 * v32 + (1.0 - beta2) * ops.square(g)
    update = next_m / (eps + ops.sqrt(next_v))
    if decay_flag:
        update = update + weight_decay * p32
    next_param = p32 - lr * update
    next_param = ops.depend(next_param, ops.assign(
        m, ops.cast(ops.select(finite, next_m, m32), m.dtype)))
    next_param = ops.depend(next_param, ops.assign(
        v, ops.cast(ops.select(finite, next_v, v32), v.dtype)))
    return ops.assign(param, ops.cast(ops.select(finite, next_param, p32), param.dtype))


def build_optimizer(network, train_config, lr_schedule):
    """AdamW; biases, layer-norm parameters and other 1-D parameters get no weight decay.
    On CPU with the fused kernels and float32 parameters, as one kernel
    (`FusedAdamWeightDecay`); elsewhere MindSpore's operators (`SkippingAdamWeightDecay`).
    Either takes the step's gradient factor and skips a non-finite step itself."""
    params = network.trainable_params()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": train_config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # MindSpore refuses an empty group (a model without any 1-D or any 2-D parameter)
    groups = [group for group in groups if group["params"]] + [{"order_params": params}]
    arguments = dict(learning_rate=lr_schedule, beta1=train_config.adam_beta1,
                     beta2=train_config.adam_beta2, eps=train_config.adam_eps)
    if use_cpu_kernels() and all(p.dtype == ms.float32 for p in params):
        fused = FusedAdamWeightDecay(groups, **arguments)
        # the kernel takes one lr and fixed decays, and updates every parameter here
        if not (fused.is_group_lr or fused.dynamic_weight_decay or fused.use_parallel):
            return fused
    return SkippingAdamWeightDecay(groups, **arguments)
