"""GPT-2 (Radford et al., 2019) as MindSpore cells with sharding strategies.

Pre-LayerNorm decoder blocks, learned positions, tanh-approximated GELU, and an output
projection tied to the token embedding. Parameter names follow the paper's structure so a
Hugging Face checkpoint maps onto them one to one (see convert.py).
"""

import math
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn

from model_zoo.models.base import folder_name
from model_zoo.causal_lm.training import NextTokenLoss
from model_zoo.config import ModelConfig
from model_zoo.parallel.config import ParallelConfig
from model_zoo.nn.attention import MultiHeadAttention
from model_zoo.nn import cache as kv_cache
from model_zoo.nn.layers import (FeedForward, LayerNorm, PositionEmbedding, ResidualAdd,
                                 VocabEmbedding, VocabProjection, assign_pipeline_stages,
                                 pre_norm_residual, stream_dropout)


@dataclass
class GPT2Config(ModelConfig):
    """GPT-2's `model` section.

    ffn_hidden_size 0 means 4 x hidden_size; `seq_length` is both the training length and
    the number of learned positions.
    """

    name: str = folder_name(__name__)
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def validate(self):
        super().validate()
        self.check_fractions("dropout", "attention_dropout")


class GPT2Block(nn.Cell):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        output_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.ln_1 = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                              eps=config.layer_norm_eps)
        self.attention = MultiHeadAttention(
            config.hidden_size, config.num_heads, parallel_config=parallel_config, causal=True,
            max_seq_length=config.seq_length, attention_dropout=config.attention_dropout,
            hidden_dropout=config.dropout, compute_dtype=compute_dtype,
            init_std=config.init_std, output_init_std=output_std, flash=config.flash_attention)
        self.ln_2 = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                              eps=config.layer_norm_eps)
        self.mlp = FeedForward(config.hidden_size, config.ffn_size,
                               parallel_config=parallel_config, activation="gelu",
                               hidden_dropout=config.dropout, compute_dtype=compute_dtype,
                               init_std=config.init_std, output_init_std=output_std)
        self.residual_1 = ResidualAdd(parallel_config=parallel_config)
        self.residual_2 = ResidualAdd(parallel_config=parallel_config)

    def construct(self, x, cache=None):
        x = pre_norm_residual(self.residual_1, self.ln_1, self.attention, x, cache=cache)
        return pre_norm_residual(self.residual_2, self.ln_2, self.mlp, x)


class GPT2Model(nn.Cell):
    """Embeddings, blocks and the final layer norm.

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length.
        cache: None, or a decoding cache (`nn.cache`) whose positions are rows of `wpe`.
    Outputs:
        float32 hidden states (batch, seq, hidden).
    """

    def __init__(self, config: GPT2Config, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size,
                                  parallel_config=parallel_config, init_std=config.init_std)
        self.wpe = PositionEmbedding(config.seq_length, config.hidden_size,
                                     parallel_config=parallel_config, init_std=0.01)
        self.dropout = stream_dropout(config.dropout, parallel_config)
        self.blocks = nn.CellList([GPT2Block(config, parallel_config, compute_dtype)
                                   for _ in range(config.num_layers)])
        self.ln_f = LayerNorm(config.hidden_size, parallel_config=parallel_config,
                              eps=config.layer_norm_eps)
        assign_pipeline_stages(list(self.blocks), parallel_config)
        for cell in (self.wte, self.wpe, self.dropout):
            cell.pipeline_stage = 0
        self.ln_f.pipeline_stage = parallel_config.pipeline_stage - 1

    def construct(self, input_ids, cache=None):
        x = self.wte(input_ids)
        if cache is None:
            x = self.wpe(x)                           # positions 0 .. seq - 1
        else:
            x = x + kv_cache.positions(cache)[0]      # the rows of the call's positions
        x = self.dropout(x)
        for index, block in enumerate(self.blocks):
            x = block(x, kv_cache.for_layer(cache, index))
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Cell):
    """GPT-2 with its tied language-model head.

    Inputs:
        input_ids: int32 (batch, seq); cache: None, or a decoding cache (`nn.cache`).
    Outputs:
        float32 logits (batch * seq, vocab); with a cache, of the last position (batch, vocab).
    """

    def __init__(self, config: GPT2Config, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.config = config
        self.transformer = GPT2Model(config, parallel_config, compute_dtype)
        self.head = VocabProjection(config.hidden_size, parallel_config=parallel_config,
                                    compute_dtype=compute_dtype)
        self.head.pipeline_stage = parallel_config.pipeline_stage - 1
        if parallel_config.pipeline_stage > 1:
            self.transformer.wte.tie_across_stages()

    def construct(self, input_ids, cache=None):
        hidden = kv_cache.last_position(self.transformer(input_ids, cache), cache)
        return self.head(hidden, self.transformer.wte.embedding_table)

    # what cached decoding reads (model_zoo.causal_lm.generate)
    def cache_layout(self):
        attention = self.transformer.blocks[0].attention
        return (len(self.transformer.blocks), attention.num_heads, attention.head_dim,
                attention.compute_dtype)

    def position_tables(self):
        return (self.transformer.wpe.embedding_table.asnumpy(),)


class GPT2ForTraining(NextTokenLoss):
    """The training network: the next-token loss of a GPT2LMHeadModel (`NextTokenLoss`)."""

    def __init__(self, config: GPT2Config, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(GPT2LMHeadModel(config, parallel_config, compute_dtype), parallel_config)
