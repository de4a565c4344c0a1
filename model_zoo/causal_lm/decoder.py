"""What the LLaMA family of decoders shares (LLaMA, Mixtral / Qwen2-MoE, and the families
after them): the `model` keys of a pre-RMSNorm decoder with rotary positions, grouped-query
attention and SwiGLU, the rotary tables its blocks read, and the language-model head with
the hooks of cached decoding. A folder's model.py composes its block from `model_zoo.nn`
and its model from these, so that the block is what differs between folders."""

import math
from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.config import ModelConfig
from model_zoo.errors import ConfigError
from model_zoo.nn import cache as kv_cache
from model_zoo.nn.grouped_attention import GroupedQueryAttention
from model_zoo.nn.layers import (RMSNorm, VocabEmbedding, VocabProjection,
                                 assign_pipeline_stages)
from model_zoo.nn.rotary import rotary_tables
from model_zoo.parallel.config import ParallelConfig


@dataclass
class RotaryDecoderConfig(ModelConfig):
    """The keys of a pre-RMSNorm decoder with rotary positions (LLaMA's).

    num_kv_heads: key/value heads, dividing num_heads (0: num_heads, plain multi-head
    attention). ffn_hidden_size: the SwiGLU width (0: LLaMA's rule, 2/3 of 4 x hidden_size
    rounded up to a multiple of 256). `seq_length` is the training length and the longest
    sequence the model decodes.
    """

    num_kv_heads: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 256 * math.ceil(int(2 * 4 * self.hidden_size / 3) / 256)

    @property
    def output_init_std(self) -> float:
        """The init of the projections into the residual stream (GPT-2's scaling)."""
        return self.init_std / math.sqrt(2 * self.num_layers)

    def validate(self):
        super().validate()
        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                              f"model.num_heads={self.num_heads} (0: as many as num_heads)")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"rotary positions need an even head size: model.hidden_size / "
                              f"model.num_heads = {self.hidden_size // self.num_heads}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("model.rope_theta and model.rms_norm_eps must be > 0")
        self.check_fractions("attention_dropout")


def block_norm(config: RotaryDecoderConfig, parallel_config: ParallelConfig) -> RMSNorm:
    """One of a block's RMSNorms over hidden_size."""
    return RMSNorm(config.hidden_size, parallel_config=parallel_config, eps=config.rms_norm_eps)


def block_attention(config: RotaryDecoderConfig, parallel_config: ParallelConfig, compute_dtype,
                    has_bias: bool = False) -> GroupedQueryAttention:
    """A block's grouped-query attention with rotary positions, by the config's keys (q, k and
    v with biases when `has_bias`)."""
    return GroupedQueryAttention(
        config.hidden_size, config.num_heads, config.kv_heads, parallel_config=parallel_config,
        max_seq_length=config.seq_length, attention_dropout=config.attention_dropout,
        compute_dtype=compute_dtype, init_std=config.init_std,
        output_init_std=config.output_init_std, flash=config.flash_attention, has_bias=has_bias)


class RotaryPositions(nn.Cell):
    """The rotary tables of a model's positions, and the rows a call reads.

    Inputs:
        seq: the call's length; cache: None (positions 0 .. seq - 1), or a decoding cache,
        which carries its positions' rows.
    Outputs:
        (cos, sin), float32 (seq, head_dim).
    """

    def __init__(self, config: RotaryDecoderConfig):
        super().__init__()
        cos, sin = rotary_tables(config.hidden_size // config.num_heads, config.seq_length,
                                 config.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.slice_table = ops.StridedSlice().shard(((1, 1),))

    def tables(self):
        """numpy (cos, sin) of every position (`position_tables`)."""
        return (self.cos.asnumpy(), self.sin.asnumpy())

    def construct(self, seq, cache=None):
        if cache is not None:
            return kv_cache.positions(cache)
        cos = self.slice_table(self.cos, (0, 0), (seq, self.cos.shape[1]), (1, 1))
        sin = self.slice_table(self.sin, (0, 0), (seq, self.sin.shape[1]), (1, 1))
        return cos, sin


class DecoderStack(nn.Cell):
    """A decoder's token embedding, its blocks (`make_block(layer)` for each layer, given
    stages over the pipeline), the final RMSNorm and the rotary tables every block reads. A
    folder's `<Name>Model` is this with its block and its `construct`, which runs them.
    (Built in this order, the seeded initial weights are the same from one version to the
    next.)"""

    def __init__(self, config: RotaryDecoderConfig, parallel_config: ParallelConfig,
                 make_block):
        super().__init__()
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size,
                                    parallel_config=parallel_config, init_std=config.init_std)
        self.blocks = nn.CellList([make_block(layer) for layer in range(config.num_layers)])
        self.norm = block_norm(config, parallel_config)
        self.rotary = RotaryPositions(config)
        assign_pipeline_stages(list(self.blocks), parallel_config)
        self.embed.pipeline_stage = 0
        self.norm.pipeline_stage = parallel_config.pipeline_stage - 1


class DecoderLM(nn.Cell):
    """A decoder (`model`: embed, blocks, norm, rotary) with its language-model head: an
    output table of its own (`head.weight`, vocab x hidden) unless `tie_word_embeddings`,
    then the token embedding's. A folder's `<Name>ForCausalLM` is this around its model.

    Inputs:
        input_ids: int32 (batch, seq); cache: None, or a decoding cache (`nn.cache`).
    Outputs:
        float32 logits (batch * seq, vocab); with a cache, of the last position (batch, vocab).
    """

    def __init__(self, config: RotaryDecoderConfig, model, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__()
        self.config = config
        self.model = model
        self.tied = config.tie_word_embeddings
        self.head = VocabProjection(config.hidden_size, parallel_config=parallel_config,
                                    compute_dtype=compute_dtype, init_std=config.init_std,
                                    vocab_size=0 if self.tied else config.vocab_size)
        self.head.pipeline_stage = parallel_config.pipeline_stage - 1
        if self.tied and parallel_config.pipeline_stage > 1:
            self.model.embed.tie_across_stages()

    def output_table(self):
        """The tied embedding table, or None: the head's own."""
        return self.model.embed.embedding_table if self.tied else None

    def logits(self, hidden, cache=None):
        """The head's logits of hidden (batch, seq, hidden): with a cache, the last position's."""
        return self.head(kv_cache.last_position(hidden, cache), self.output_table())

    def construct(self, input_ids, cache=None):
        return self.logits(self.model(input_ids, cache), cache)

    # what cached decoding reads (model_zoo.causal_lm.generate)
    def cache_layout(self):
        attention = self.model.blocks[0].attention
        return (len(self.model.blocks), attention.num_kv_heads, attention.head_dim,
                attention.compute_dtype)

    def position_tables(self):
        return self.model.rotary.tables()
