"""BERT (Devlin et al., 2019) as MindSpore cells with sharding strategies.

Post-LayerNorm encoder layers (x = LN(x + attn(x)); x = LN(x + ffn(x))), learned absolute
positions, token-type (segment) embeddings, the exact (erf) GELU, a tanh pooler on the
first token, and the two pre-training heads: masked language model (tied to the word
embeddings, plus an output bias) and next-sentence prediction.

Parameter names follow Hugging Face's structure so a checkpoint maps one to one (see
convert.py; its separate query, key and value become the fused `attention.qkv`), e.g. for
`BertForPreTraining`:

    bert.embeddings.word_embeddings.embedding_table     bert.embeddings.layer_norm.gamma
    bert.encoder.layer.0.attention.qkv.weight            bert.encoder.layer.0.attention.output.bias
    bert.encoder.layer.0.attention_layer_norm.gamma      bert.encoder.layer.0.ffn.expand.weight
    bert.encoder.layer.0.ffn.project.weight              bert.encoder.layer.0.output_layer_norm.beta
    bert.pooler.dense.weight                             cls.transform.weight
    cls.transform_layer_norm.gamma                       cls.output_bias
    cls.seq_relationship.weight

Every primitive gets its strategy in `__init__` from the ParallelConfig (dp, mp); see
`model_zoo/nn/layers.py` for the shared cells and `docs/mindspore-parallel-rules.md` for
the rules each strategy follows.
"""

import dataclasses
from dataclasses import dataclass

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer

from model_zoo.models.base import folder_name
from model_zoo.config import ModelConfig
from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import MultiHeadAttention
from model_zoo.nn.layers import (Dropout, FeedForward, LayerNorm, Linear, PaddingBias,
                                 PositionEmbedding, ResidualAdd, VocabEmbedding, VocabProjection,
                                 assign_pipeline_stages, stream_dropout, vocabulary_split)
from model_zoo.nn.loss import CrossEntropy

TASKS = ("pretrain", "classify")
SPECIAL_TOKENS = ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id")


@dataclass
class BertConfig(ModelConfig):
    """BERT's `model` section.

    ffn_hidden_size 0 means 4 x hidden_size; `seq_length` is both the training length and
    the number of learned positions. `task` picks the network `build_bert_network` builds:
    "pretrain" (masked LM + next sentence) or "classify" (sequence classification with
    `num_labels` classes). The special token ids are those of the project's tokenizer layout
    (a converted Hugging Face model carries its own: 0, 101, 102, 103).
    """

    name: str = folder_name(__name__)
    type_vocab_size: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    num_labels: int = 2
    task: str = "pretrain"
    pad_token_id: int = 0
    cls_token_id: int = 4
    sep_token_id: int = 5
    mask_token_id: int = 6

    def validate(self):
        super().validate()
        if self.type_vocab_size < 1:
            raise ConfigError(f"model.type_vocab_size must be >= 1, got {self.type_vocab_size}")
        if self.num_labels < 2:
            raise ConfigError(f"model.num_labels must be >= 2, got {self.num_labels}")
        self.check_fractions("dropout", "attention_dropout")
        for key in ("layer_norm_eps", "init_std"):
            if not getattr(self, key) > 0.0:
                raise ConfigError(f"model.{key} must be > 0, got {getattr(self, key)}")
        if self.task not in TASKS:
            raise ConfigError(f"model.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        seen = {}
        for key in SPECIAL_TOKENS:
            value = getattr(self, key)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"model.{key}={value} must be in [0, model.vocab_size="
                                  f"{self.vocab_size})")
            if value in seen:
                raise ConfigError(f"model.{key}={value} is the same id as model.{seen[value]}")
            seen[value] = key


def _last_stage(parallel_config: ParallelConfig) -> int:
    return parallel_config.pipeline_stage - 1


class BertEmbeddings(nn.Cell):
    """word + position + token-type embeddings, then LayerNorm and dropout.

    The word table is split by vocabulary over mp unless `vocab_emb_dp` (see
    VocabEmbedding); the token-type table (2 rows) is always kept whole and its lookup split
    by batch, Gather ((1,1),(dp,1)).

    Inputs:
        input_ids, token_type_ids: int32 (batch, seq), seq <= config.seq_length.
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig):
        super().__init__()
        dp = parallel_config.dp
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size,
                                              parallel_config=parallel_config,
                                              init_std=config.init_std)
        self.position_embeddings = PositionEmbedding(config.seq_length, config.hidden_size,
                                                     parallel_config=parallel_config,
                                                     init_std=config.init_std)
        self.token_type_embeddings = VocabEmbedding(
            config.type_vocab_size, config.hidden_size,
            parallel_config=dataclasses.replace(parallel_config, vocab_emb_dp=True),
            init_std=config.init_std)
        self.add = ops.Add().shard(((dp, 1, 1), (dp, 1, 1)))
        self.layer_norm = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                                    eps=config.layer_norm_eps)
        self.dropout = stream_dropout(config.dropout, parallel_config)

    def construct(self, input_ids, token_type_ids):
        x = self.add(self.word_embeddings(input_ids), self.token_type_embeddings(token_type_ids))
        return self.dropout(self.layer_norm(self.position_embeddings(x)))


class BertLayer(nn.Cell):
    """One post-LayerNorm encoder layer: x = LN(x + attn(x)); x = LN(x + ffn(x)).

    Attention heads and the feed-forward's inner size are split over mp (column-split
    projections in, row-split out, one all-reduce each); residuals and norms split by dp.

    Inputs:
        x: float32 (batch, seq, hidden).
        attention_bias: float32 (batch, 1, 1, seq): 0 to keep, a large negative for padding.
    Outputs:
        float32 (batch, seq, hidden).
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.attention = MultiHeadAttention(
            config.hidden_size, config.num_heads, parallel_config=parallel_config,
            causal=False, attention_dropout=config.attention_dropout,
            hidden_dropout=config.dropout, compute_dtype=compute_dtype,
            init_std=config.init_std, flash=config.flash_attention)
        self.attention_residual = ResidualAdd(parallel_config=parallel_config)
        self.attention_layer_norm = LayerNorm(config.hidden_size,
                                              parallel_config=parallel_config,
                                              eps=config.layer_norm_eps)
        self.ffn = FeedForward(config.hidden_size, config.ffn_size,
                               parallel_config=parallel_config, activation="gelu_exact",
                               hidden_dropout=config.dropout, compute_dtype=compute_dtype,
                               init_std=config.init_std)
        self.output_residual = ResidualAdd(parallel_config=parallel_config)
        self.output_layer_norm = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                                           eps=config.layer_norm_eps)

    def construct(self, x, attention_bias):
        x = self.attention_layer_norm(
            self.attention_residual(x, self.attention(x, None, attention_bias)))
        return self.output_layer_norm(self.output_residual(x, self.ffn(x)))


class BertEncoder(nn.Cell):
    """`num_layers` BertLayers in a CellList, spread over the pipeline stages.

    Inputs / Outputs: as BertLayer.
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.layer = nn.CellList([BertLayer(config, parallel_config, compute_dtype)
                                  for _ in range(config.num_layers)])
        assign_pipeline_stages(list(self.layer), parallel_config)

    def construct(self, x, attention_bias):
        for layer in self.layer:
            x = layer(x, attention_bias)
        return x


class BertPooler(nn.Cell):
    """tanh(dense(first token)): the sequence summary used by NSP and classification.

    StridedSlice ((dp,1,1),) takes position 0 (the split batch dimension is fetched whole,
    the sequence dimension is not split); the dense layer keeps its small weight whole.

    Inputs:
        x: float32 (batch, seq, hidden).
    Outputs:
        (batch, hidden) in compute_dtype.
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.first_token = ops.StridedSlice().shard(((parallel_config.dp, 1, 1),))
        self.dense = Linear(config.hidden_size, config.hidden_size, split="none",
                            activation="tanh", parallel_config=parallel_config,
                            compute_dtype=compute_dtype, init_std=config.init_std)

    def construct(self, x):
        batch = x.shape[0]
        first = self.first_token(x, (0, 0, 0), (batch, 1, self.hidden_size), (1, 1, 1))
        return self.dense(ops.reshape(first, (batch, self.hidden_size)))


class BertModel(nn.Cell):
    """Embeddings, encoder layers and pooler.

    Args:
        config: the model section.
        parallel_config: the layout (default: one device).
        compute_dtype: dtype of the matmuls (layer norms, softmax and outputs are float32).

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length.
        token_type_ids: int32 (batch, seq), segment ids (0 or 1).
        attention_mask: int32 (batch, seq), 1 for tokens, 0 for padding.
    Outputs:
        sequence_output: float32 (batch, seq, hidden).
        pooled_output: (batch, hidden) in compute_dtype.

    Raises:
        ConfigError: num_heads, hidden_size or ffn size not divisible by model_parallel,
            vocab_size not divisible by it when the vocabulary is split, num_layers not
            divisible by pipeline_stage.
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.embeddings = BertEmbeddings(config, parallel_config)
        self.encoder = BertEncoder(config, parallel_config, compute_dtype)
        self.pooler = BertPooler(config, parallel_config, compute_dtype)
        self.padding_bias = PaddingBias(parallel_config=parallel_config)
        self.embeddings.pipeline_stage = 0
        self.pooler.pipeline_stage = _last_stage(parallel_config)

    def construct(self, input_ids, token_type_ids, attention_mask):
        x = self.embeddings(input_ids, token_type_ids)
        x = self.encoder(x, self.padding_bias(attention_mask))
        return x, self.pooler(x)


class BertPreTrainingHeads(nn.Cell):
    """Masked-LM and next-sentence heads.

    MLM: dense + exact GELU + LayerNorm on the hidden states at the masked positions, then
    logits = h E^T + output_bias with E the word embedding table (tied), its vocabulary axis
    split over mp like the embedding unless `vocab_emb_dp`. NSP: a 2-way dense layer on the
    pooled output.

    Inputs:
        masked_hidden: float32 (batch, predictions, hidden).
        pooled_output: (batch, hidden).
        embedding_table: (vocab, hidden), the word embeddings.
    Outputs:
        mlm_logits: float32 (batch * predictions, vocab).
        nsp_logits: float32 (batch, 2).
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        dp = parallel_config.dp
        vocab_split = vocabulary_split(parallel_config)
        linear = dict(parallel_config=parallel_config, compute_dtype=compute_dtype,
                      init_std=config.init_std)
        self.transform = Linear(config.hidden_size, config.hidden_size, split="none",
                                activation="gelu_exact", **linear)
        self.transform_layer_norm = LayerNorm(config.hidden_size,
                                              parallel_config=parallel_config,
                                              eps=config.layer_norm_eps)
        self.decoder = VocabProjection(config.hidden_size, parallel_config=parallel_config,
                                       compute_dtype=compute_dtype)
        self.output_bias = Parameter(initializer(Zero(), (config.vocab_size,), ms.float32),
                                     name="output_bias")
        # logits (tokens, vocab) carry the decoder MatMul's output layout (dp, vocab_split).
        self.add_output_bias = ops.Add().shard(((dp, vocab_split), (vocab_split,)))
        self.seq_relationship = Linear(config.hidden_size, 2, split="none", **linear)

    def construct(self, masked_hidden, pooled_output, embedding_table):
        h = self.transform_layer_norm(self.transform(masked_hidden))
        mlm_logits = self.add_output_bias(self.decoder(h, embedding_table), self.output_bias)
        nsp_logits = ops.cast(self.seq_relationship(pooled_output), ms.float32)
        return mlm_logits, nsp_logits


class GatherPositions(nn.Cell):
    """Hidden states at given positions of each sequence, as a one-hot batched matmul.

    one_hot(positions) (batch, P, seq) @ hidden (batch, seq, hidden) -> (batch, P, hidden).
    Rules (docs/mindspore-parallel-rules.md, "Operators"):
    - OneHot: "first tuple over the OUTPUT shape; indices rank>1: axis=-1, only dim 0
      split" -> ((dp,1,1),(),());
    - BatchMatMul: "MatMul rule on last 2 dims; batch dims right-aligned and equal" ->
      ((dp,1,1),(dp,1,1)): the contracted seq axis is whole on both sides, so no
      communication. The product is exact (one 1.0 times the value plus zeros).

    Inputs:
        hidden: float32 (batch, seq, hidden); positions: int32 (batch, P), each in [0, seq).
    Outputs:
        float32 (batch, P, hidden).
    """

    def __init__(self, *, parallel_config: ParallelConfig):
        super().__init__()
        dp = parallel_config.dp
        self.one_hot = ops.OneHot(axis=-1).shard(((dp, 1, 1), (), ()))
        self.matmul = ops.BatchMatMul().shard(((dp, 1, 1), (dp, 1, 1)))
        self.on_value = Tensor(1.0, ms.float32)
        self.off_value = Tensor(0.0, ms.float32)

    def construct(self, hidden, positions):
        select = self.one_hot(positions, hidden.shape[1], self.on_value, self.off_value)
        return self.matmul(select, ops.cast(hidden, ms.float32))


class BertForPreTraining(nn.Cell):
    """BERT with the masked-LM and next-sentence losses.

    Args:
        config, parallel_config, compute_dtype: as BertModel.

    Inputs:
        input_ids, token_type_ids, attention_mask: int32 (batch, seq).
        masked_lm_positions: int32 (batch, P), positions of the predicted tokens (padding
            entries point anywhere, e.g. 0, with weight 0).
        masked_lm_ids: int32 (batch, P), the original tokens there.
        masked_lm_weights: float32 (batch, P), 1 for a real prediction, 0 for padding.
        next_sentence_label: int32 (batch,) or (batch, 1), 1 if sentence B is random.
    Outputs:
        float32 scalar: mean MLM cross-entropy over the weighted predictions
        (sum(w * ce) / sum(w)) + mean NSP cross-entropy.
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.config = config
        self.bert = BertModel(config, parallel_config, compute_dtype)
        self.gather_positions = GatherPositions(parallel_config=parallel_config)
        self.cls = BertPreTrainingHeads(config, parallel_config, compute_dtype)
        self.mlm_loss = CrossEntropy(parallel_config=parallel_config,
                                     class_split=vocabulary_split(parallel_config))
        self.nsp_loss = CrossEntropy(parallel_config=parallel_config)
        self.add_losses = ops.Add().shard(((), ()))
        for cell in (self.gather_positions, self.cls, self.mlm_loss, self.nsp_loss):
            cell.pipeline_stage = _last_stage(parallel_config)
        if parallel_config.pipeline_stage > 1:
            self.bert.embeddings.word_embeddings.tie_across_stages()

    def logits(self, input_ids, token_type_ids, attention_mask, masked_lm_positions):
        """(mlm_logits float32 (batch * P, vocab), nsp_logits float32 (batch, 2)).

        Callable from Python (eagerly) or inside a graph; `LogitsCell` compiles it.
        """
        sequence_output, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        masked_hidden = self.gather_positions(sequence_output, masked_lm_positions)
        return self.cls(masked_hidden, pooled,
                        self.bert.embeddings.word_embeddings.embedding_table)

    def construct(self, input_ids, token_type_ids, attention_mask, masked_lm_positions,
                  masked_lm_ids, masked_lm_weights, next_sentence_label):
        mlm_logits, nsp_logits = self.logits(input_ids, token_type_ids, attention_mask,
                                             masked_lm_positions)
        labels = ops.reshape(masked_lm_ids, (-1,))
        weights = ops.reshape(ops.cast(masked_lm_weights, ms.float32), (-1,))
        mlm = self.mlm_loss(mlm_logits, labels, weights)
        nsp_labels = ops.reshape(next_sentence_label, (-1,))
        nsp = self.nsp_loss(nsp_logits, nsp_labels, ops.ones(nsp_labels.shape, ms.float32))
        return self.add_losses(mlm, nsp)


class BertForSequenceClassification(nn.Cell):
    """BERT with a classifier on the pooled output: pooled -> dropout -> dense.

    Args:
        config: the model section (`num_labels` classes), parallel_config, compute_dtype:
            as BertModel.

    Inputs:
        input_ids, token_type_ids, attention_mask: int32 (batch, seq).
        label: int32 (batch,) or (batch, 1), in [0, num_labels).
    Outputs:
        float32 scalar, the mean cross-entropy.
    """

    def __init__(self, config: BertConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.config = config
        self.bert = BertModel(config, parallel_config, compute_dtype)
        self.dropout = Dropout(config.dropout, (parallel_config.dp, 1))
        self.classifier = Linear(config.hidden_size, config.num_labels, split="none",
                                 parallel_config=parallel_config, compute_dtype=compute_dtype,
                                 init_std=config.init_std)
        self.loss = CrossEntropy(parallel_config=parallel_config)
        for cell in (self.dropout, self.classifier, self.loss):
            cell.pipeline_stage = _last_stage(parallel_config)

    def logits(self, input_ids, token_type_ids, attention_mask):
        """float32 (batch, num_labels)."""
        _, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        return ops.cast(self.classifier(self.dropout(pooled)), ms.float32)

    def construct(self, input_ids, token_type_ids, attention_mask, label):
        logits = self.logits(input_ids, token_type_ids, attention_mask)
        labels = ops.reshape(label, (-1,))
        return self.loss(logits, labels, ops.ones(labels.shape, ms.float32))


class LogitsCell(nn.Cell):
    """A graph-compiled view of `network.logits(*inputs)`, for evaluation and fill-mask.

    Built with auto_prefix=False, so wrapping leaves the network's parameter names as
    they are. Put it in eval mode (`set_train(False)`) for deterministic logits.
    """

    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, *inputs):
        return self.network.logits(*inputs)


def build_bert_network(config: BertConfig, parallel_config: ParallelConfig = None,
                       compute_dtype=ms.float32):
    """The loss network `config.task` names: BertForPreTraining or
    BertForSequenceClassification."""
    if config.task == "pretrain":
        return BertForPreTraining(config, parallel_config, compute_dtype)
    if config.task == "classify":
        return BertForSequenceClassification(config, parallel_config, compute_dtype)
    raise ConfigError(f"model.task must be one of {', '.join(TASKS)}, got {config.task!r}")
