"""Mixtral (Jiang et al., 2024) as MindSpore cells: LLaMA's decoder (copied from
model_zoo/models/llama) whose feed-forward is a mixture of SwiGLU experts
(`nn.moe.MixtureOfExperts`: a top-k router, dropless unless `capacity_factor` > 0).
Training adds the router's load-balancing loss, `router_aux_loss_coef` times the Switch
Transformer's (summed over the layers as Hugging Face's Mixtral sums it). The keys Qwen2-MoE
adds (shared experts behind a sigmoid gate, query/key/value biases, unnormalised top-k
weights, dense layers between the sparse ones) make the same decoder a Qwen2-MoE. convert.py
maps Hugging Face's `MixtralForCausalLM` and `Qwen2MoeForCausalLM` onto these parameters.
"""

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from model_zoo.causal_lm.decoder import (DecoderLM, DecoderStack, RotaryDecoderConfig,
                                         block_attention, block_norm)
from model_zoo.causal_lm.training import NextTokenLoss
from model_zoo.errors import ConfigError
from model_zoo.models.base import folder_name
from model_zoo.nn import cache as kv_cache
from model_zoo.nn.layers import (GatedFeedForward, Linear, ResidualAdd, pre_norm_residual)
from model_zoo.nn.moe import LoadBalancingLoss, MixtureOfExperts
from model_zoo.parallel.config import ParallelConfig


@dataclass
class MixtralConfig(RotaryDecoderConfig):
    """Mixtral's `model` section: the keys of `RotaryDecoderConfig` and the experts'.

    num_experts experts of width moe_intermediate_size (0: ffn_hidden_size), num_experts_per_tok
    of them for each token; capacity_factor 0 routes every choice (dropless), > 0 gives each
    expert ceil(k tokens / experts x factor) slots; router_aux_loss_coef weighs the
    load-balancing loss. num_shared_experts > 0 adds always-on experts beside the routed ones,
    as one SwiGLU of num_shared_experts x the expert width every token passes (DeepSeekMoE's
    shared experts), scaled by sigmoid(x w) with `shared_expert_gate` (Qwen2-MoE's shared
    expert). normalize_top_k scales a token's k routing weights to sum to 1 (Mixtral;
    Qwen2-MoE's norm_topk_prob, false in its releases). moe_layer_freq k gives experts to every
    k-th layer (those with (i + 1) % k == 0, Qwen2-MoE's decoder_sparse_step), the others a
    SwiGLU of ffn_hidden_size. attention_bias adds biases to the query, key and value
    projections (Qwen's).
    """

    name: str = folder_name(__name__)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    capacity_factor: float = 0.0
    normalize_top_k: bool = True
    shared_expert_gate: bool = False
    moe_layer_freq: int = 1
    attention_bias: bool = False

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.ffn_size

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) routes to experts (`moe_layer_freq`)."""
        return (layer + 1) % self.moe_layer_freq == 0

    @property
    def sparse_layers(self) -> int:
        return self.num_layers // self.moe_layer_freq

    def validate(self):
        super().validate()
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} must be "
                              f"in [1, model.num_experts={self.num_experts}]")
        if (self.moe_intermediate_size < 0 or self.router_aux_loss_coef < 0
                or self.num_shared_experts < 0):
            raise ConfigError("model.moe_intermediate_size, model.router_aux_loss_coef and "
                              "model.num_shared_experts must be >= 0")
        if not 1 <= self.moe_layer_freq <= self.num_layers:
            raise ConfigError(f"model.moe_layer_freq={self.moe_layer_freq} must be in "
                              f"[1, model.num_layers={self.num_layers}]: every k-th layer "
                              f"has experts")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ConfigError("model.shared_expert_gate needs shared experts: set "
                              "model.num_shared_experts > 0")


class MixtralBlock(nn.Cell):
    """x + attention(input_norm(x)), then x + experts(post_attention_norm(x)) (plus the
    shared experts' output, when there are any); a dense layer (`moe_layer_freq`) has a
    SwiGLU of ffn_size in place of the experts and passes the statistics on.

    Inputs:
        x: (batch, seq, hidden); positions: rotary (cos, sin) (seq, head_dim) of x's
        positions; cache: None, or the layer's decoding cache; statistics: None or (2, E).
    Outputs:
        x; statistics (2, E) plus the router's statistics of these tokens
        (`MixtureOfExperts`: choices per expert and summed probabilities).
    """

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig, compute_dtype,
                 layer: int = 0):
        super().__init__()
        ffn = dict(parallel_config=parallel_config, compute_dtype=compute_dtype,
                   init_std=config.init_std, output_init_std=config.output_init_std)
        self.input_norm = block_norm(config, parallel_config)
        self.attention = block_attention(config, parallel_config, compute_dtype,
                                         has_bias=config.attention_bias)
        self.post_attention_norm = block_norm(config, parallel_config)
        self.sparse = config.has_experts(layer)
        self.shared_experts, self.shared_gate = None, None
        if not self.sparse:
            self.mlp = GatedFeedForward(config.hidden_size, config.ffn_size, **ffn)
        else:
            self.mlp = MixtureOfExperts(
                config.hidden_size, config.expert_size, config.num_experts,
                config.num_experts_per_tok, capacity_factor=config.capacity_factor,
                normalize_top_k=config.normalize_top_k, **ffn)
        if self.sparse and config.num_shared_experts:
            self.shared_experts = GatedFeedForward(
                config.hidden_size, config.num_shared_experts * config.expert_size, **ffn)
            self.add_shared = ResidualAdd(parallel_config=parallel_config)
        if self.shared_experts is not None and config.shared_expert_gate:
            # (batch, seq, hidden) -> one gate a token; the shared output scaled by it
            dp = parallel_config.dp
            self.shared_gate = Linear(config.hidden_size, 1, parallel_config=parallel_config,
                                      has_bias=False, compute_dtype=compute_dtype,
                                      init_std=config.init_std)
            self.sigmoid = ops.Sigmoid().shard(((dp, 1, 1),))
            self.scale_shared = ops.Mul().shard(((dp, 1, 1), (dp, 1, 1)))
        self.residual_1 = ResidualAdd(parallel_config=parallel_config)
        self.residual_2 = ResidualAdd(parallel_config=parallel_config)

    def feed_forward(self, x, statistics=None):
        """The routed experts' output on the normed x, plus the shared experts'; and the
        router's statistics plus these tokens' (`MixtureOfExperts`). A dense layer's SwiGLU
        output and the statistics as they came."""
        if not self.sparse:
            return self.mlp(x), statistics
        mixed, statistics = self.mlp(x, statistics)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = self.scale_shared(shared, self.sigmoid(self.shared_gate(x)))
            mixed = self.add_shared(mixed, shared)
        return mixed, statistics

    def construct(self, x, positions, cache=None, statistics=None):
        x = pre_norm_residual(self.residual_1, self.input_norm, self.attention, x, positions,
                              cache=cache)
        mixed, statistics = self.feed_forward(self.post_attention_norm(x), statistics)
        return self.residual_2(x, mixed), statistics


class MixtralModel(DecoderStack):
    """Token embedding, blocks and the final norm; the rotary tables every block reads.

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length; cache: None, or a decoding
        cache (`nn.cache`).
    Outputs:
        float32 hidden states (batch, seq, hidden); the router's statistics summed over the
        layers (2, E): choices per expert and summed probabilities.
    """

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__(config, parallel_config,
                         lambda layer: MixtralBlock(config, parallel_config, compute_dtype, layer))

    def construct(self, input_ids, cache=None):
        positions = self.rotary(input_ids.shape[1], cache)
        x = self.embed(input_ids)
        statistics = None
        for index, block in enumerate(self.blocks):
            x, statistics = block(x, positions, kv_cache.for_layer(cache, index), statistics)
        return self.norm(x), statistics


class MixtralForCausalLM(DecoderLM):
    """Mixtral with its language-model head (`DecoderLM`) and the load-balancing loss of its
    routers."""

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(config, MixtralModel(config, parallel_config, compute_dtype),
                         parallel_config, compute_dtype)
        self.balance_loss = LoadBalancingLoss(config.num_experts)
        self.balance_loss.pipeline_stage = parallel_config.pipeline_stage - 1   # with the loss

    def construct(self, input_ids, cache=None):
        return self.logits(self.model(input_ids, cache)[0], cache)

    def with_balance_loss(self, input_ids):
        """(logits, the load-balancing loss of these tokens over every layer)."""
        hidden, statistics = self.model(input_ids)
        rows = input_ids.shape[0] * input_ids.shape[1] * self.config.sparse_layers
        return self.logits(hidden), self.balance_loss(statistics, rows)


class MixtralForTraining(NextTokenLoss):
    """The training network: the next-token loss of a MixtralForCausalLM (`NextTokenLoss`)
    plus router_aux_loss_coef times its load-balancing loss."""

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        parallel_config = parallel_config or ParallelConfig()
        super().__init__(MixtralForCausalLM(config, parallel_config, compute_dtype),
                         parallel_config)
        self.balance_weight = config.router_aux_loss_coef

    def construct(self, input_ids):
        batch, length = input_ids.shape
        inputs = self.slice(input_ids, (0, 0), (batch, length - 1), (1, 1))
        labels = self.slice(input_ids, (0, 1), (batch, length), (1, 1))
        logits, balance = self.lm.with_balance_loss(inputs)
        labels = ops.reshape(labels, (-1,))
        return (self.loss(logits, labels, ops.ones(labels.shape, ms.float32))
                + self.balance_weight * balance)
