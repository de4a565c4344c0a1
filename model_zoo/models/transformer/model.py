"""The Transformer for translation (Vaswani et al., 2017) as MindSpore cells with strategies.

An encoder-decoder with sinusoidal positions and one embedding table shared by the source,
the target and the output projection (the vocabulary is joint). The normalisation is
placed before each sub-layer ("pre", the default: trains stably without a long warmup) or
after it ("post", as in the paper). Like `torch.nn.Transformer`, both stacks end with a
layer norm. The decoder also runs incrementally, one position at a time, with cached keys
and values, for beam search.
"""

import math
from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.models.base import folder_name
from model_zoo.config import ModelConfig
from model_zoo.errors import ConfigError
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import MultiHeadAttention
from model_zoo.nn.backend import cpu_kernel
from model_zoo.nn.layers import (FeedForward, LayerNorm, PaddingBias, ResidualAdd,
                                 SinusoidalPositionEncoding, VocabEmbedding, VocabProjection,
                                 assign_pipeline_stages, stream_dropout, vocabulary_split)
from model_zoo.nn.loss import CrossEntropy


@dataclass
class TransformerConfig(ModelConfig):
    """The Transformer's `model` section.

    num_layers is the depth of the encoder and of the decoder; seq_length the longest
    source or target (in tokens, with eos). Token ids follow the dataset's tokenizer:
    pad 0, bos 2, eos 3.
    """

    name: str = folder_name(__name__)
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "relu"
    norm_placement: str = "pre"
    layer_norm_eps: float = 1e-5
    label_smoothing: float = 0.1
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 3
    beam_size: int = 4
    length_penalty: float = 0.6
    max_decode_extra: int = 50

    @property
    def pipeline_blocks(self) -> int:
        """Encoder and decoder layers, in that order, are the pipeline's blocks."""
        return 2 * self.num_layers

    def validate(self):
        super().validate()
        self.check_fractions("dropout", "attention_dropout", "label_smoothing")
        if self.norm_placement not in ("pre", "post"):
            raise ConfigError(f"model.norm_placement must be pre or post, got "
                              f"{self.norm_placement!r}")
        if self.activation not in ("relu", "gelu", "gelu_exact"):
            raise ConfigError(f"model.activation must be relu, gelu or gelu_exact, got "
                              f"{self.activation!r}")
        if self.beam_size < 1:
            raise ConfigError(f"model.beam_size must be >= 1, got {self.beam_size}")


class SubLayer(nn.Cell):
    """A residual connection around `function`, with the layer norm before or after it."""

    def __init__(self, function, config: TransformerConfig, parallel_config: ParallelConfig):
        super().__init__()
        self.function = function
        self.pre_norm = config.norm_placement == "pre"
        self.norm = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                              eps=config.layer_norm_eps)
        self.residual = ResidualAdd(parallel_config=parallel_config)

    def normed_input(self, x):
        return self.norm(x) if self.pre_norm else x

    def output(self, x, y):
        """The sub-layer's output given its input x and the function's result y."""
        out = self.residual(x, y)
        return out if self.pre_norm else self.norm(out)


class EncoderLayer(nn.Cell):
    def __init__(self, config: TransformerConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.self_attention = SubLayer(_attention(config, parallel_config, compute_dtype),
                                       config, parallel_config)
        self.feed_forward = SubLayer(_feed_forward(config, parallel_config, compute_dtype),
                                     config, parallel_config)

    def construct(self, x, source_bias):
        normed = self.self_attention.normed_input(x)
        x = self.self_attention.output(x, self.self_attention.function(normed, None,
                                                                       source_bias))
        return self.feed_forward.output(
            x, self.feed_forward.function(self.feed_forward.normed_input(x)))


class DecoderLayer(nn.Cell):
    def __init__(self, config: TransformerConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.self_attention = SubLayer(_attention(config, parallel_config, compute_dtype,
                                                  causal=True), config, parallel_config)
        self.cross_attention = SubLayer(_attention(config, parallel_config, compute_dtype,
                                                   cross=True), config, parallel_config)
        self.feed_forward = SubLayer(_feed_forward(config, parallel_config, compute_dtype),
                                     config, parallel_config)

    def construct(self, x, memory, source_bias, cache=None):
        """Teacher-forced x over the encoder's memory; with a cache, a beam-search step (x
        (batch, 1, hidden); memory the cross attention's precomputed (keys, values),
        `CrossKeyValues`; cache (key, value, write_index, step_bias, parents): the caches'
        rows taken from `parents` first, or None) returning (x, key, value)."""
        normed = self.self_attention.normed_input(x)
        if cache is not None:
            out, key, value = self.self_attention.function.reordered_step(normed, *cache)
            x = self.self_attention.output(x, out)
            x = self.cross_attention.output(
                x, self.cross_attention.function.attend(self.cross_attention.normed_input(x),
                                                        memory[0], memory[1], source_bias))
            return self._feed_forward(x), key, value
        x = self.self_attention.output(x, self.self_attention.function(normed))
        x = self.cross_attention.output(
            x, self.cross_attention.function(self.cross_attention.normed_input(x), memory,
                                             source_bias))
        return self._feed_forward(x)

    def _feed_forward(self, x):
        return self.feed_forward.output(
            x, self.feed_forward.function(self.feed_forward.normed_input(x)))


def _attention(config, parallel_config, compute_dtype, causal=False, cross=False):
    return MultiHeadAttention(
        config.hidden_size, config.num_heads, parallel_config=parallel_config, causal=causal,
        cross=cross,
        max_seq_length=config.seq_length + config.max_decode_extra + 1,
        attention_dropout=config.attention_dropout, hidden_dropout=config.dropout,
        compute_dtype=compute_dtype, init_std=config.hidden_size ** -0.5,
        flash=config.flash_attention)


def _feed_forward(config, parallel_config, compute_dtype):
    return FeedForward(config.hidden_size, config.ffn_size, parallel_config=parallel_config,
                       activation=config.activation, hidden_dropout=config.dropout,
                       compute_dtype=compute_dtype, init_std=config.hidden_size ** -0.5)


class Transformer(nn.Cell):
    """Encoder, decoder and the shared embedding; the logits of a (teacher-forced) target.

    Inputs:
        source_ids, source_mask: int32 (batch, seq_s); decoder_input_ids: int32 (batch, seq_t).
    Outputs:
        float32 logits (batch * seq_t, vocab).
    """

    def __init__(self, config: TransformerConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        dp = parallel_config.dp
        self.config = config
        self.embedding = VocabEmbedding(config.vocab_size, config.hidden_size,
                                        parallel_config=parallel_config,
                                        init_std=config.hidden_size ** -0.5)
        self.embedding_scale = ops.Mul().shard(((dp, 1, 1), ()))
        self.positions = SinusoidalPositionEncoding(
            config.seq_length + config.max_decode_extra + 1, config.hidden_size,
            parallel_config=parallel_config)
        # one per side: a cell's mask follows the step, so a shared one would drop the same
        # positions of the source and target embeddings
        self.source_dropout = stream_dropout(config.dropout, parallel_config)
        self.target_dropout = stream_dropout(config.dropout, parallel_config)
        self.encoder_layers = nn.CellList([EncoderLayer(config, parallel_config, compute_dtype)
                                           for _ in range(config.num_layers)])
        self.encoder_norm = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                                      eps=config.layer_norm_eps)
        self.decoder_layers = nn.CellList([DecoderLayer(config, parallel_config, compute_dtype)
                                           for _ in range(config.num_layers)])
        self.decoder_norm = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                                      eps=config.layer_norm_eps)
        self.projection = VocabProjection(config.hidden_size, parallel_config=parallel_config,
                                          compute_dtype=compute_dtype)
        assign_pipeline_stages(list(self.encoder_layers) + list(self.decoder_layers),
                               parallel_config)
        for cell in (self.embedding, self.positions, self.source_dropout, self.target_dropout):
            cell.pipeline_stage = 0
        self.decoder_norm.pipeline_stage = parallel_config.pipeline_stage - 1
        self.projection.pipeline_stage = parallel_config.pipeline_stage - 1
        if parallel_config.pipeline_stage > 1:
            self.embedding.tie_across_stages()
        self.embedding_multiplier = Tensor(math.sqrt(config.hidden_size), ms.float32)
        self.padding_bias = PaddingBias(parallel_config=parallel_config)

    def embed(self, ids, source: bool):
        """Token embeddings scaled by sqrt(hidden), plus positions (from 0), then the
        source's or the target's dropout."""
        x = self.positions(self.embedding_scale(self.embedding(ids), self.embedding_multiplier))
        if source:
            return self.source_dropout(x)
        return self.target_dropout(x)

    def encode(self, source_ids, source_mask):
        """(memory (batch, seq_s, hidden), source bias (batch, 1, 1, seq_s))."""
        source_bias = self.padding_bias(source_mask)
        x = self.embed(source_ids, True)
        for layer in self.encoder_layers:
            x = layer(x, source_bias)
        return self.encoder_norm(x), source_bias

    def decode(self, decoder_input_ids, memory, source_bias):
        x = self.embed(decoder_input_ids, False)
        for layer in self.decoder_layers:
            x = layer(x, memory, source_bias)
        return self.projection(self.decoder_norm(x), self.embedding.embedding_table)

    def construct(self, source_ids, source_mask, decoder_input_ids):
        memory, source_bias = self.encode(source_ids, source_mask)
        return self.decode(decoder_input_ids, memory, source_bias)


class TransformerForTraining(nn.Cell):
    """Label-smoothed cross-entropy over the real target positions.

    Inputs (the dataset's batch columns, in order):
        source_ids, source_mask, decoder_input_ids, decoder_mask, label_ids: int32 (batch, len).
    Outputs:
        float32 scalar.
    """

    def __init__(self, config: TransformerConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.transformer = Transformer(config, parallel_config, compute_dtype)
        self.loss = CrossEntropy(parallel_config=parallel_config,
                                 label_smoothing=config.label_smoothing,
                                 num_classes=config.vocab_size,
                                 class_split=vocabulary_split(parallel_config))
        self.loss.pipeline_stage = parallel_config.pipeline_stage - 1

    def construct(self, source_ids, source_mask, decoder_input_ids, decoder_mask, label_ids):
        logits = self.transformer(source_ids, source_mask, decoder_input_ids)
        return self.loss(logits, ops.reshape(label_ids, (-1,)),
                         ops.cast(ops.reshape(decoder_mask, (-1,)), ms.float32))


class CrossKeyValues(nn.Cell):
    """Encoder output -> every decoder layer's cross-attention keys and values, once per
    sentence (incremental decoding reuses them at every step).

    Outputs:
        (keys, values): tuples with one (batch, heads, seq_s, head_dim) tensor per layer.
    """

    def __init__(self, transformer: Transformer):
        super().__init__(auto_prefix=False)
        self.transformer = transformer

    def construct(self, memory):
        keys, values = (), ()
        for layer in self.transformer.decoder_layers:
            k, v = layer.cross_attention.function.project_key_value(memory)
            keys += (k,)
            values += (v,)
        return keys, values


class DecoderStep(nn.Cell):
    """One incremental decoder step for a batch of hypotheses, returning only the `top_k`
    best continuations of each (all a search needs, and little to copy out).

    Inputs:
        token_ids: int32 (batch, 1), the newest tokens; parents: int32 (batch,), the row of
        the caches each hypothesis continues (read when `reorder`: beam search);
        write_index (batch, heads, 3) and step_bias (1, 1, 1, max_len): the position
        (`cache.step_inputs`);
        position_encoding: float32 (1, hidden), the sinusoid row of that position;
        cache_keys, cache_values: tuples of (batch, heads, max_len, head_dim), one per layer
        (without `reorder` they are written in place);
        cross_keys, cross_values: from CrossKeyValues; source_bias: (batch, 1, 1, seq_s).
    Outputs:
        (top log-probabilities (batch, top_k), their ids, cache_keys, cache_values).
    """

    def __init__(self, transformer: Transformer, top_k: int,
                 parallel_config: ParallelConfig = None, reorder: bool = True):
        super().__init__(auto_prefix=False)
        parallel_config = parallel_config or ParallelConfig()
        self.transformer = transformer
        self.top_k = top_k
        self.reorder = reorder
        self.log_softmax = ops.LogSoftmax(axis=-1).shard(((parallel_config.dp, 1),))
        self.top = ops.TopK(sorted=True).shard(((parallel_config.dp, 1),))
        # on CPU both in one pass (MindSpore's TopK is most of a small model's step)
        self.fused_top = cpu_kernel("log_softmax_top_k", top_k)

    def construct(self, token_ids, parents, write_index, step_bias, position_encoding,
                  cache_keys, cache_values, cross_keys, cross_values, source_bias):
        model = self.transformer
        x = model.embedding_scale(model.embedding(token_ids), model.embedding_multiplier)
        x = model.positions.add(x, position_encoding)
        new_keys, new_values = (), ()
        for index, layer in enumerate(model.decoder_layers):
            cache = (cache_keys[index], cache_values[index], write_index, step_bias,
                     parents if self.reorder else None)
            x, key, value = layer(x, (cross_keys[index], cross_values[index]), source_bias,
                                  cache)
            new_keys += (key,)
            new_values += (value,)
        logits = model.projection(model.decoder_norm(x), model.embedding.embedding_table)
        if self.fused_top is not None:
            values, ids = self.fused_top(logits)
        else:
            values, ids = self.top(self.log_softmax(logits), self.top_k)
        return values, ids, new_keys, new_values


class FlatDecoderStep(nn.Cell):
    """DecoderStep with every input a tensor, for export: MindIR keeps a tuple input as a
    constant of the graph, so the per-layer tuples are given one tensor after another.

    Inputs:
        token_ids, parents, write_index, step_bias, position_encoding, then num_layers cache keys,
        num_layers cache values, num_layers cross keys, num_layers cross values, and
        source_bias (shapes in DecoderStep).
    Outputs:
        as DecoderStep's.
    """

    def __init__(self, step: DecoderStep):
        super().__init__(auto_prefix=False)
        self.step = step
        self.num_layers = len(step.transformer.decoder_layers)

    def construct(self, *inputs):
        layers = self.num_layers
        groups = [inputs[5 + index * layers:5 + (index + 1) * layers] for index in range(4)]
        return self.step(*inputs[:5], *groups, inputs[5 + 4 * layers])
