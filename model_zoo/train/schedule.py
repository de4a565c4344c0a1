"""Learning-rate schedules: linear warmup, then cosine decay to a floor or inverse square root."""

import math

import mindspore as ms
from mindspore import nn, ops


class WarmupCosineSchedule(nn.learning_rate_schedule.LearningRateSchedule):
    """lr rises linearly over `warmup_steps`, then follows a half cosine to `min_lr` at
    `total_steps` and stays there.

    Inputs:
        global_step: int32 scalar tensor, the number of optimizer updates so far.
    Outputs:
        float32 scalar learning rate.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int):
        super().__init__()
        self.lr, self.min_lr = lr, min_lr
        self.warmup_steps = max(warmup_steps, 0)
        self.decay_steps = max(total_steps - self.warmup_steps, 1)

    def construct(self, global_step):
        step = ops.cast(global_step, ms.float32)
        warmup = self.lr * (step + 1.0) / max(self.warmup_steps, 1)
        progress = ops.clip_by_value((step - self.warmup_steps) / self.decay_steps, 0.0, 1.0)
        cosine = self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + ops.cos(math.pi * progress))
        return ops.select(step < self.warmup_steps, warmup, cosine)


class WarmupInverseSqrtSchedule(nn.learning_rate_schedule.LearningRateSchedule):
    """The Transformer's schedule: lr rises linearly to `lr` over `warmup_steps`, then
    decays as lr * sqrt(warmup_steps / step), never below `min_lr`.

    Inputs:
        global_step: int32 scalar tensor, the number of optimizer updates so far.
    Outputs:
        float32 scalar learning rate.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int):
        super().__init__()
        self.lr, self.min_lr = lr, min_lr
        self.warmup_steps = max(warmup_steps, 1)

    def construct(self, global_step):
        step = ops.cast(global_step, ms.float32) + 1.0
        scale = ops.minimum(step / self.warmup_steps, ops.sqrt(self.warmup_steps / step))
        return ops.maximum(self.lr * scale, self.min_lr)


def build_schedule(train_config):
    """The schedule named by `train.lr_schedule`."""
    if train_config.lr_schedule == "inverse_sqrt":
        return WarmupInverseSqrtSchedule(train_config.lr, train_config.min_lr,
                                         train_config.warmup_steps)
    return WarmupCosineSchedule(train_config.lr, train_config.min_lr,
                                train_config.warmup_steps, train_config.schedule_steps)
