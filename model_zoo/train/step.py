"""The train step: forward, backward, gradient reduction, loss scaling, clipping, update.

One cell holds everything a step changes (model, optimizer moments, loss scale, step
counter), so one checkpoint of it is enough to resume exactly.
"""

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from model_zoo.parallel import cpu_kernels
from model_zoo.parallel.layers import use_cpu_kernels


class TrainStep(nn.Cell):
    """One optimizer step over a batch, with optional gradient accumulation.

    Args:
        network: cell mapping the batch columns to a scalar loss.
        optimizer: a MindSpore optimizer over the network's trainable parameters.
        lr_schedule: the optimizer's schedule, evaluated here for logging.
        grad_reducer: cell that combines gradients across ranks, or None.
        dynamic_loss_scale: scale the loss (fp16): a step whose gradients overflow is
            skipped and the scale halved; after `scale_window` good steps it doubles.
        loss_scale: the initial scale (used only with dynamic_loss_scale).
        grad_clip: clip the global gradient norm to this value (0 disables).
        accumulation: micro batches per step; the batch is cut into that many equal slices
            whose gradients are summed before one update.

    Inputs:
        *batch: the dataset's columns, batch along dimension 0.
    Outputs:
        (loss, finite, loss_scale, grad_norm, lr): loss averaged over micro batches, whether
        the update was applied, the scale used, the unclipped gradient norm, the lr used.
    """

    def __init__(self, network, optimizer, lr_schedule, *, grad_reducer=None,
                 dynamic_loss_scale=False, loss_scale=65536.0, scale_window=1000,
                 grad_clip=1.0, accumulation=1):
        super().__init__(auto_prefix=False)
        self.network = network
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.grad_reducer = grad_reducer
        self.dynamic_loss_scale = dynamic_loss_scale
        self.loss_scale = Parameter(Tensor(loss_scale if dynamic_loss_scale else 1.0,
                                           ms.float32), name="loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps",
                                    requires_grad=False)
        self.scale_window = scale_window
        self.grad_clip = grad_clip
        self.accumulation = accumulation
        self.step = Parameter(Tensor(0, ms.int32), name="train_step", requires_grad=False)
        self.hyper_map = ops.HyperMap()
        self.squared_norm = cpu_kernels.squared_norm() if use_cpu_kernels() else None

    def _gradients(self, batch, scale):
        """Loss and summed (still scaled) gradients over the accumulation micro batches."""
        if self.accumulation == 1:
            loss = self.network(*batch)
            grads = self.grad(self.network, self.weights)(*batch, ops.cast(scale, loss.dtype))
            return loss, grads
        size = batch[0].shape[0] // self.accumulation
        loss_sum, grads = None, None
        for index in range(self.accumulation):
            micro = tuple(column[index * size:(index + 1) * size] for column in batch)
            loss = self.network(*micro)
            micro_grads = self.grad(self.network, self.weights)(*micro,
                                                                ops.cast(scale, loss.dtype))
            if grads is None:
                loss_sum, grads = loss, micro_grads
            else:
                loss_sum = loss_sum + loss
                grads = self.hyper_map(ops.add, grads, micro_grads)
        return loss_sum / self.accumulation, grads

    def construct(self, *batch):
        # a copy: returning the Parameter itself would report its value after this step's
        # adjustment instead of the scale this step used
        scale = self.loss_scale * 1.0
        lr = self.lr_schedule(self.optimizer.global_step)
        loss, grads = self._gradients(batch, scale)
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        # One pass over the gradients for the norm and one to unscale and clip them. A
        # non-finite gradient makes the norm non-finite, so the norm also tells whether the
        # step can be applied (cheaper than testing every gradient element).
        divisor = scale * self.accumulation
        grad_norm = ops.sqrt(self._gradient_squares(grads)) / divisor
        finite = ops.isfinite(grad_norm)
        factor = 1.0 / divisor
        if self.grad_clip > 0:
            factor = factor * self.grad_clip / ops.maximum(grad_norm, self.grad_clip)
        grads = self.hyper_map(ops.partial(_multiply, factor), grads)
        if self.dynamic_loss_scale:
            self._adjust_loss_scale(finite)
        if finite:
            loss = ops.depend(loss, self.optimizer(grads))
        loss = ops.depend(loss, ops.assign_add(self.step, Tensor(1, ms.int32)))
        return loss, finite, scale, grad_norm, lr

    def _gradient_squares(self, grads):
        """Sum of the squares of every gradient element."""
        if self.squared_norm is not None:
            return ops.reshape(self.squared_norm(*grads), ())
        return ops.addn(self.hyper_map(_squared_sum, grads))

    def _adjust_loss_scale(self, finite):
        good = ops.select(finite, self.good_steps + 1, ops.zeros_like(self.good_steps))
        grow = good >= self.scale_window
        grown = ops.select(grow, self.loss_scale * 2.0, self.loss_scale)
        lowered = ops.maximum(self.loss_scale / 2.0, 1.0)
        ops.assign(self.loss_scale, ops.select(finite, grown, lowered))
        ops.assign(self.good_steps, ops.select(grow, ops.zeros_like(good), good))


def _multiply(factor, grad):
    return grad * ops.cast(factor, grad.dtype)


def _squared_sum(grad):
    return ops.reduce_sum(ops.square(ops.cast(grad, ms.float32)))


def build_optimizer(network, train_config, lr_schedule):
    """AdamW; biases, layer-norm parameters and other 1-D parameters get no weight decay."""
    params = network.trainable_params()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": train_config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # MindSpore refuses an empty group (a model without any 1-D or any 2-D parameter)
    groups = [group for group in groups if group["params"]] + [{"order_params": params}]
    return nn.AdamWeightDecay(groups, learning_rate=lr_schedule, beta1=train_config.adam_beta1,
                              beta2=train_config.adam_beta2, eps=train_config.adam_eps)
