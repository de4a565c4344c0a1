"""The cross-entropy loss with its strategies: whole classes, or vocabulary-parallel under a
vocabulary-split head (the logits never gathered), with label smoothing and a masked
mean. Strategies follow docs/mindspore-parallel-rules.md."""

import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.nn.backend import cpu_kernel
from model_zoo.parallel.config import ParallelConfig


class CrossEntropy(nn.Cell):
    """Mean cross-entropy over the positions whose mask is 1.

    Whole classes (class_split 1): OneHot and SoftmaxCrossEntropyWithLogits split the tokens
    by dp and keep the class dimension whole, as MindSpore requires.

    Vocabulary-parallel (class_split > 1, the logits of a vocabulary-split head): the
    log-softmax is composed of operators that keep the class axis split (dp, class_split),
    as MindFormers' CrossEntropyLoss and MindSpore r1.8's `nn/transformer/loss.py` do, so
    the logits are never gathered: per token only the maximum, the sum of exponentials and
    the target's log-probability cross the mp group (an all-reduce of one value each, and
    the same in the backward pass), instead of all-gathering (tokens, vocab) float32 logits
    over mp. The maximum is a constant of the backward pass (stop_gradient), which leaves
    the gradient unchanged (softmax - target) and saves its backward all-reduce.

    The masked mean reduces over dp. CPU builds use the fused kernel of `cpu_kernels`
    instead of either (CPU runs ignore strategies).

    Args:
        parallel_config: the layout; dp splits the tokens.
        label_smoothing: spread this much of the target mass evenly over the classes.
        num_classes: the number of classes (needed with label smoothing).
        class_split: the split of the logits' class axis (`vocabulary_split` for a
            vocabulary-sized head, else 1).

    Inputs:
        logits: float32 (tokens, classes); labels: int32 (tokens,); mask: float32 (tokens,).
    Outputs:
        float32 scalar.
    """

    def __init__(self, *, parallel_config: ParallelConfig, label_smoothing: float = 0.0,
                 num_classes: int = None, class_split: int = 1):
        super().__init__()
        dp = parallel_config.dp
        if label_smoothing and not num_classes:
            raise ValueError("label smoothing needs num_classes")
        self.kernel = cpu_kernel("cross_entropy")
        self.vocabulary_parallel = class_split > 1 and self.kernel is None
        classes = (dp, class_split)                      # (tokens, classes) split
        self.one_hot = ops.OneHot().shard((classes, (), ()))
        if self.vocabulary_parallel:
            self.max = ops.ReduceMax(keep_dims=True).shard((classes,))
            self.shift = ops.Sub().shard((classes, (dp, 1)))
            self.exp = ops.Exp().shard((classes,))
            self.sum_exp = ops.ReduceSum(keep_dims=True).shard((classes,))
            self.log = ops.Log().shard(((dp, 1),))
            self.normalise = ops.Sub().shard((classes, (dp, 1)))
            self.weigh = ops.Mul().shard((classes, classes))
            self.sum_classes = ops.ReduceSum().shard((classes,))
            self.neg = ops.Neg().shard(((dp,),))
        else:
            self.softmax_cross_entropy = ops.SoftmaxCrossEntropyWithLogits().shard(
                ((dp, 1), (dp, 1)))
        self.mul = ops.Mul().shard(((dp,), (dp,)))
        self.sum = ops.ReduceSum().shard(((dp,),))
        # Label smoothing spreads `label_smoothing` of the target mass evenly over all
        # classes, so the one-hot target becomes (1 - e + e/V, e/V): the same loss as
        # (1 - e) * NLL + e * mean over classes of -log p, without extra operators.
        off = label_smoothing / num_classes if label_smoothing else 0.0
        self.on_value = Tensor(1.0 - label_smoothing + off, ms.float32)
        self.off_value = Tensor(off, ms.float32)

    def construct(self, logits, labels, mask):
        if self.kernel is not None:
            loss = self.kernel(logits, ops.cast(labels, ms.int32), self.on_value,
                               self.off_value)[0]
        else:
            target = self.one_hot(labels, logits.shape[-1], self.on_value, self.off_value)
            if self.vocabulary_parallel:
                loss = self._split_cross_entropy(logits, target)
            else:
                loss = self.softmax_cross_entropy(logits, target)[0]
        total = self.sum(self.mul(loss, mask), ())
        return total / ops.maximum(self.sum(mask, ()), 1.0)

    def _split_cross_entropy(self, logits, target):
        """-sum_c target_c log softmax(logits)_c per token, the class axis staying split."""
        shifted = self.shift(logits, ops.stop_gradient(self.max(logits, -1)))  # (tokens, V)
        log_norm = self.log(self.sum_exp(self.exp(shifted), -1))             # (tokens, 1)
        log_probs = self.normalise(shifted, log_norm)
        return self.neg(self.sum_classes(self.weigh(log_probs, target), -1))  # (tokens,)
