"""LLaMA (Touvron et al., 2023) as MindSpore cells with sharding strategies.

Pre-RMSNorm decoder blocks, rotary positions, grouped-query attention without biases, a
SwiGLU feed-forward and an output projection of its own (or tied to the token embedding).
Parameter names follow the paper's structure; convert.py maps Hugging Face's
`LlamaForCausalLM` onto them. A LLaMA-like model is a copy of this folder: its block here,
its keys in the config, its names in convert.py.
"""

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn

from model_zoo.causal_lm.decoder import (DecoderLM, DecoderStack, RotaryDecoderConfig,
                                         block_attention, block_norm)
from model_zoo.causal_lm.training import NextTokenLoss
from model_zoo.models.base import folder_name
from model_zoo.nn import cache as kv_cache
from model_zoo.nn.layers import GatedFeedForward, ResidualAdd, pre_norm_residual
from model_zoo.parallel.config import ParallelConfig


@dataclass
class LlamaConfig(RotaryDecoderConfig):
    """LLaMA's `model` section: the keys of `RotaryDecoderConfig`."""

    name: str = folder_name(__name__)


class LlamaBlock(nn.Cell):
    """x + attention(input_norm(x)), then x + mlp(post_attention_norm(x)).

    Inputs:
        x: (batch, seq, hidden); positions: rotary (cos, sin) (seq, head_dim) of x's
        positions; cache: None, or the layer's decoding cache.
    """

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig, compute_dtype):
        super().__init__()
        self.input_norm = block_norm(config, parallel_config)
        self.attention = block_attention(config, parallel_config, compute_dtype)
        self.post_attention_norm = block_norm(config, parallel_config)
        self.mlp = GatedFeedForward(config.hidden_size, config.ffn_size,
                                    parallel_config=parallel_config, compute_dtype=compute_dtype,
                                    init_std=config.init_std,
                                    output_init_std=config.output_init_std)
        self.residual_1 = ResidualAdd(parallel_config=parallel_config)
        self.residual_2 = ResidualAdd(parallel_config=parallel_config)

    def construct(self, x, positions, cache=None):
        x = pre_norm_residual(self.residual_1, self.input_norm, self.attention, x, positions,
                              cache=cache)
        return pre_norm_residual(self.residual_2, self.post_attention_norm, self.mlp, x)


class LlamaModel(DecoderStack):
    """Token embedding, blocks and the final norm; the rotary tables every block reads.

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length; cache: None, or a decoding
        cache (`nn.cache`).
    Outputs:
        float32 hidden states (batch, seq, hidden).
    """

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__(config, parallel_config,
                         lambda layer: LlamaBlock(config, parallel_config, compute_dtype))

    def construct(self, input_ids, cache=None):
        positions = self.rotary(input_ids.shape[1], cache)
        x = self.embed(input_ids)
        for index, block in enumerate(self.blocks):
            x = block(x, positions, kv_cache.for_layer(cache, index))
        return self.norm(x)


class LlamaForCausalLM(DecoderLM):
    """LLaMA with its language-model head (`DecoderLM`)."""

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(config, LlamaModel(config, parallel_config, compute_dtype),
                         parallel_config, compute_dtype)


class LlamaForTraining(NextTokenLoss):
    """The training network: the next-token loss of a LlamaForCausalLM (`NextTokenLoss`)."""

    def __init__(self, config: LlamaConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(LlamaForCausalLM(config, parallel_config, compute_dtype), parallel_config)
