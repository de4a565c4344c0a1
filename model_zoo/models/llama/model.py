"""LLaMA (Touvron et al., 2023) as MindSpore cells with sharding strategies.

Pre-RMSNorm decoder blocks, rotary positions, grouped-query attention without biases, a
SwiGLU feed-forward and an output projection of its own (or tied to the token embedding).
Parameter names follow the paper's structure; convert.py maps Hugging Face's
`LlamaForCausalLM` onto them. A LLaMA-like model (bias on the query/key/value projections,
another norm) is a copy of this folder with changes here and in convert.py.
"""

import math
from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.causal_lm.training import NextTokenLoss
from model_zoo.config import ModelConfig
from model_zoo.errors import ConfigError
from model_zoo.models.base import folder_name
from model_zoo.nn.grouped_attention import GroupedQueryAttention, rotary_tables
from model_zoo.nn.layers import (GatedFeedForward, ResidualAdd, RMSNorm, VocabEmbedding,
                                 VocabProjection, assign_pipeline_stages)
from model_zoo.parallel.config import ParallelConfig


@dataclass
class LlamaConfig(ModelConfig):
    """LLaMA's `model` section.

    num_kv_heads: key/value heads, dividing num_heads (0: num_heads, plain multi-head
    attention). ffn_hidden_size: the SwiGLU width (0: LLaMA's rule, 2/3 of 4 x hidden_size
    rounded up to a multiple of 256). `seq_length` is the training length and the longest
    sequence the model decodes.
    """

    name: str = folder_name(__name__)
    num_kv_heads: int = 0
    ffn_hidden_size: int = 0
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

    def validate(self):
        super().validate()
        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                              f"model.num_heads={self.num_heads} (0: as many as num_heads)")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"rotary positions need an even head size: model.hidden_size / "
                              f"model.num_heads = {self.hidden_size // self.num_heads}")
        if self.ffn_hidden_size < 0:
            raise ConfigError(f"model.ffn_hidden_size must be >= 0, got {self.ffn_hidden_size}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("model.rope_theta and model.rms_norm_eps must be > 0")
        self.check_fractions("attention_dropout")


class LlamaBlock(nn.Cell):
    """x + attention(input_norm(x)), then x + mlp(post_attention_norm(x)).

    Inputs:
        x: (batch, seq, hidden); cos, sin: (seq, head_dim), the rotary rows of x's positions.
    """

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        output_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.input_norm = RMSNorm(config.hidden_size, parallel_config=parallel_config,
                                  eps=config.rms_norm_eps)
        self.attention = GroupedQueryAttention(
            config.hidden_size, config.num_heads, config.kv_heads,
            parallel_config=parallel_config, max_seq_length=config.seq_length,
            attention_dropout=config.attention_dropout, compute_dtype=compute_dtype,
            init_std=config.init_std, output_init_std=output_std,
            flash=config.flash_attention)
        self.post_attention_norm = RMSNorm(config.hidden_size, parallel_config=parallel_config,
                                           eps=config.rms_norm_eps)
        self.mlp = GatedFeedForward(config.hidden_size, config.ffn_size,
                                    parallel_config=parallel_config,
                                    compute_dtype=compute_dtype, init_std=config.init_std,
                                    output_init_std=output_std)
        self.residual_1 = ResidualAdd(parallel_config=parallel_config)
        self.residual_2 = ResidualAdd(parallel_config=parallel_config)

    def construct(self, x, cos, sin):
        x = self.residual_1(x, self.attention(self.input_norm(x), cos, sin))
        return self.residual_2(x, self.mlp(self.post_attention_norm(x)))

    def decode_step(self, x, cos, sin, cache_key, cache_value, write_index, step_bias):
        """`construct` for the newest position x (batch, 1, hidden) over the key/value caches,
        which it writes in place (`GroupedQueryAttention.decode_residual`; on CPU one launch
        for each half of the block)."""
        x = self.attention.decode_residual(self.input_norm, x, cos, sin, cache_key, cache_value,
                                           write_index, step_bias)
        return self.mlp.decode_residual(self.post_attention_norm, x)

    def prefill(self, x, cos, sin, cache_key, cache_value, write_index):
        """`construct` for the first positions x (batch, P, hidden), writing their keys and
        values into the caches (`GroupedQueryAttention.prefill`)."""
        x = self.residual_1(x, self.attention.prefill(
            self.input_norm(x), cos, sin, cache_key, cache_value, write_index))
        return self.residual_2(x, self.mlp(self.post_attention_norm(x)))


class LlamaModel(nn.Cell):
    """Token embedding, blocks and the final norm; the rotary tables every block reads.

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length.
    Outputs:
        float32 hidden states (batch, seq, hidden).
    """

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__()
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size,
                                    parallel_config=parallel_config, init_std=config.init_std)
        self.blocks = nn.CellList([LlamaBlock(config, parallel_config, compute_dtype)
                                   for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, parallel_config=parallel_config,
                            eps=config.rms_norm_eps)
        cos, sin = rotary_tables(config.hidden_size // config.num_heads, config.seq_length,
                                 config.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.slice_table = ops.StridedSlice().shard(((1, 1),))
        assign_pipeline_stages(list(self.blocks), parallel_config)
        self.embed.pipeline_stage = 0
        self.norm.pipeline_stage = parallel_config.pipeline_stage - 1

    def construct(self, input_ids):
        seq = input_ids.shape[1]
        cos = self.slice_table(self.cos, (0, 0), (seq, self.cos.shape[1]), (1, 1))
        sin = self.slice_table(self.sin, (0, 0), (seq, self.sin.shape[1]), (1, 1))
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Cell):
    """LLaMA with its language-model head: an output table of its own (`head.weight`, vocab x
    hidden) unless `tie_word_embeddings`, then the token embedding's.

    Inputs:
        input_ids: int32 (batch, seq).
    Outputs:
        float32 logits (batch * seq, vocab).
    """

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.config = config
        self.model = LlamaModel(config, parallel_config, compute_dtype)
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

    def construct(self, input_ids):
        return self.head(self.model(input_ids), self.output_table())

    # cached decoding (model_zoo.causal_lm.generate)
    def cache_layout(self):
        attention = self.model.blocks[0].attention
        return (len(self.model.blocks), attention.num_kv_heads, attention.head_dim,
                attention.compute_dtype)

    def position_tables(self):
        return (self.model.cos.asnumpy(), self.model.sin.asnumpy())

    def decode_step(self, ids, positions, keys, values, write_index, step_bias):
        cos, sin = positions
        x = self.model.embed(ids)
        for index, block in enumerate(self.model.blocks):
            x = block.decode_step(x, cos, sin, keys[index], values[index], write_index,
                                  step_bias)
        return self.head(self.model.norm(x), self.output_table())

    def prefill(self, ids, positions, keys, values, write_index):
        cos, sin = positions
        x = self.model.embed(ids)
        for index, block in enumerate(self.model.blocks):
            x = block.prefill(x, cos, sin, keys[index], values[index], write_index)
        return self.head(self.model.norm(x[:, -1:]), self.output_table())


class LlamaForTraining(NextTokenLoss):
    """The training network: the next-token loss of a LlamaForCausalLM (`NextTokenLoss`)."""

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(LlamaForCausalLM(config, parallel_config, compute_dtype), parallel_config)
