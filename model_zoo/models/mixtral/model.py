"""Mixtral (Jiang et al., 2024) as MindSpore cells: LLaMA's decoder (copied from
model_zoo/models/llama) whose feed-forward is a mixture of SwiGLU experts
(`nn.moe.MixtureOfExperts`: a top-k router, dropless unless `capacity_factor` > 0).
Training adds the router's load-balancing loss, `router_aux_loss_coef` times the Switch
Transformer's (summed over the layers as Hugging Face's Mixtral sums it). The keys Qwen2-MoE
adds (shared experts behind a sigmoid gate, query/key/value biases, unnormalised top-k
weights, dense layers between the sparse ones) make the same decoder a Qwen2-MoE. convert.py
maps Hugging Face's `MixtralForCausalLM` and `Qwen2MoeForCausalLM` onto these parameters.
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
from model_zoo.nn.layers import (GatedFeedForward, Linear, ResidualAdd, RMSNorm,
                                 VocabEmbedding, VocabProjection, assign_pipeline_stages)
from model_zoo.nn.moe import LoadBalancingLoss, MixtureOfExperts
from model_zoo.parallel.config import ParallelConfig


@dataclass
class MixtralConfig(ModelConfig):
    """Mixtral's `model` section: LLaMA's keys and the experts'.

    num_kv_heads: key/value heads, dividing num_heads (0: num_heads). num_experts experts
    of width moe_intermediate_size (0: ffn_hidden_size, whose 0 is LLaMA's rule, 2/3 of
    4 x hidden_size rounded up to a multiple of 256), num_experts_per_tok of them for each
    token; capacity_factor 0 routes every choice (dropless), > 0 gives each expert
    ceil(k tokens / experts x factor) slots; router_aux_loss_coef weighs the
    load-balancing loss. num_shared_experts > 0 adds always-on experts beside the routed
    ones, as one SwiGLU of num_shared_experts x the expert width every token passes
    (DeepSeekMoE's shared experts), scaled by sigmoid(x w) with `shared_expert_gate`
    (Qwen2-MoE's shared expert). normalize_top_k scales a token's k routing weights to sum
    to 1 (Mixtral; Qwen2-MoE's norm_topk_prob, false in its releases). moe_layer_freq k
    gives experts to every k-th layer (those with (i + 1) % k == 0, Qwen2-MoE's
    decoder_sparse_step), the others a SwiGLU of ffn_hidden_size. attention_bias adds
    biases to the query, key and value projections (Qwen's).
    """

    name: str = folder_name(__name__)
    num_kv_heads: int = 0
    ffn_hidden_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    init_std: float = 0.02
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
        x: (batch, seq, hidden); cos, sin: (seq, head_dim), the rotary rows of x's positions.
    Outputs:
        x; statistics (2, E) plus the router's statistics of these tokens
        (`MixtureOfExperts`: choices per expert and summed probabilities).
    """

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig, compute_dtype,
                 layer: int = 0):
        super().__init__()
        output_std = config.init_std / math.sqrt(2 * config.num_layers)
        ffn = dict(parallel_config=parallel_config, compute_dtype=compute_dtype,
                   init_std=config.init_std, output_init_std=output_std)
        self.input_norm = RMSNorm(config.hidden_size, parallel_config=parallel_config,
                                  eps=config.rms_norm_eps)
        self.attention = GroupedQueryAttention(
            config.hidden_size, config.num_heads, config.kv_heads,
            parallel_config=parallel_config, max_seq_length=config.seq_length,
            attention_dropout=config.attention_dropout, compute_dtype=compute_dtype,
            init_std=config.init_std, output_init_std=output_std,
            flash=config.flash_attention, has_bias=config.attention_bias)
        self.post_attention_norm = RMSNorm(config.hidden_size, parallel_config=parallel_config,
                                           eps=config.rms_norm_eps)
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

    def construct(self, x, cos, sin, statistics=None):
        x = self.residual_1(x, self.attention(self.input_norm(x), cos, sin))
        mixed, statistics = self.feed_forward(self.post_attention_norm(x), statistics)
        return self.residual_2(x, mixed), statistics

    def decode_step(self, x, cos, sin, cache_key, cache_value, write_index, step_bias):
        """`construct` for the newest position x (batch, 1, hidden) over the key/value caches,
        which it writes in place (`GroupedQueryAttention.decode_residual`: on CPU the
        attention's half of the block is one launch)."""
        x = self.attention.decode_residual(self.input_norm, x, cos, sin, cache_key, cache_value,
                                           write_index, step_bias)
        return self.residual_2(x, self.feed_forward(self.post_attention_norm(x))[0])

    def prefill(self, x, cos, sin, cache_key, cache_value, write_index):
        """`construct` for the first positions x (batch, P, hidden), writing their keys and
        values into the caches (`GroupedQueryAttention.prefill`)."""
        x = self.residual_1(x, self.attention.prefill(
            self.input_norm(x), cos, sin, cache_key, cache_value, write_index))
        return self.residual_2(x, self.feed_forward(self.post_attention_norm(x))[0])


class MixtralModel(nn.Cell):
    """Token embedding, blocks and the final norm; the rotary tables every block reads.

    Inputs:
        input_ids: int32 (batch, seq), seq <= config.seq_length.
    Outputs:
        float32 hidden states (batch, seq, hidden); the router's statistics summed over the
        layers (2, E): choices per expert and summed probabilities.
    """

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig,
                 compute_dtype=ms.float32):
        super().__init__()
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size,
                                    parallel_config=parallel_config, init_std=config.init_std)
        self.blocks = nn.CellList([MixtralBlock(config, parallel_config, compute_dtype, layer)
                                   for layer in range(config.num_layers)])
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
        statistics = None
        for block in self.blocks:
            x, statistics = block(x, cos, sin, statistics)
        return self.norm(x), statistics


class MixtralForCausalLM(nn.Cell):
    """Mixtral with its language-model head: an output table of its own (`head.weight`, vocab x
    hidden) unless `tie_word_embeddings`, then the token embedding's.

    Inputs:
        input_ids: int32 (batch, seq).
    Outputs:
        float32 logits (batch * seq, vocab).
    """

    def __init__(self, config: MixtralConfig, parallel_config: ParallelConfig = None,
                 compute_dtype=ms.float32):
        super().__init__()
        parallel_config = parallel_config or ParallelConfig()
        self.config = config
        self.model = MixtralModel(config, parallel_config, compute_dtype)
        self.tied = config.tie_word_embeddings
        self.balance_loss = LoadBalancingLoss(config.num_experts)
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
        return self.head(self.model(input_ids)[0], self.output_table())

    def with_balance_loss(self, input_ids):
        """(logits, the load-balancing loss of these tokens over every layer)."""
        hidden, statistics = self.model(input_ids)
        rows = input_ids.shape[0] * input_ids.shape[1] * self.config.sparse_layers
        return self.head(hidden, self.output_table()), self.balance_loss(statistics, rows)

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
