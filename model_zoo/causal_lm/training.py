"""The next-token loss every decoder-only model trains with."""

import mindspore as ms
from mindspore import nn, ops

from model_zoo.nn.layers import vocabulary_split
from model_zoo.nn.loss import CrossEntropy
from model_zoo.parallel.config import ParallelConfig


class NextTokenLoss(nn.Cell):
    """A language model's next-token loss: a sample of seq_length + 1 tokens gives inputs and
    shifted labels. A folder's training network is this around its own model (`.lm`, a
    cell: ids (batch, seq) -> logits (batch * seq, vocab)), so parameter names start with
    `lm.`; the loss sits on the last pipeline stage.

    Inputs:
        input_ids: int32 (batch, seq_length + 1).
    Outputs:
        float32 scalar, the mean cross-entropy.
    """

    def __init__(self, lm, parallel_config: ParallelConfig):
        super().__init__()
        dp = parallel_config.dp
        self.lm = lm
        self.slice = ops.StridedSlice().shard(((dp, 1),))
        self.loss = CrossEntropy(parallel_config=parallel_config,
                                 class_split=vocabulary_split(parallel_config))
        self.loss.pipeline_stage = parallel_config.pipeline_stage - 1

    def construct(self, input_ids):
        batch, length = input_ids.shape
        inputs = self.slice(input_ids, (0, 0), (batch, length - 1), (1, 1))
        labels = self.slice(input_ids, (0, 1), (batch, length), (1, 1))
        logits = self.lm(inputs)
        labels = ops.reshape(labels, (-1,))
        return self.loss(logits, labels, ops.ones(labels.shape, ms.float32))
