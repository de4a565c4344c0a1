"""Mixture of experts: a top-k router over SwiGLU experts (Mixtral, Qwen2-MoE), with the
Switch Transformer's load-balancing statistics.

Tokens reach their experts through one-hot dispatch products of static shape, as
MindSpore's own MoE layer moves them (mindspore/parallel/_transformer/moe.py of
MindSpore 1.x-2.2, the layer PanGu-Sigma trained with): each expert takes at most C tokens
(its capacity), a token's k choices are placed in priority order (every token's first
choice before any second choice, GShard), and

    dispatch (T, E, C)   1 where token t sits in slot c of expert e
    expert inputs        (E, C, H) = dispatch^T x
    expert outputs       (E, C, H): each expert's SwiGLU on its slots (batched products)
    output (T, H)        = combine (T, E C) . expert outputs, combine = dispatch x weight

`capacity_factor` > 0 sets C = ceil(k T / E x factor) and drops what overflows (the
token's other choices still count); `capacity_factor` <= 0 is dropless: C = T, so every
choice fits (a token picks an expert once), at O(E T^2) for the dispatch tensors, which
is what a static shape costs.
"""

import math

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.auto_generate import SiLU

from model_zoo.parallel.config import ParallelConfig


def expert_capacity(tokens: int, num_experts: int, experts_per_token: int,
                    capacity_factor: float) -> int:
    """Slots per expert: every token when dropless (factor <= 0), else the even share of
    the k T choices times the factor, rounded up (at most T: a token picks an expert once)."""
    if capacity_factor <= 0:
        return tokens
    share = experts_per_token * tokens / num_experts
    return min(tokens, max(1, math.ceil(share * capacity_factor)))


class MixtureOfExperts(nn.Cell):
    """Top-k routed SwiGLU experts (module docstring).

    Router: logits = x W_r^T in float32, probabilities their softmax, the k largest kept
    and, with `normalize_top_k` (Mixtral), scaled to sum to 1. Expert e computes
    down_e(silu(gate_e(x)) * up_e(x)), its weights one (E, in, out) tensor per projection.

    Inputs:
        x: (batch, seq, hidden).
    Outputs:
        float32 (batch, seq, hidden); the load-balancing statistics of these tokens:
        float32 (E,) choices each expert received (summed over the k choices, dropped ones
        included) and float32 (E,) router probability summed over the tokens
        (`load_balancing_loss` turns them, summed over layers, into the auxiliary loss).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 experts_per_token: int, *, parallel_config: ParallelConfig,
                 capacity_factor: float = 0.0, normalize_top_k: bool = True,
                 compute_dtype=ms.float32, init_std: float = 0.02,
                 output_init_std: float = None):
        super().__init__()
        if not 0 < experts_per_token <= num_experts:
            raise ValueError(f"experts_per_token={experts_per_token} must be in "
                             f"[1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, experts_per_token
        self.capacity_factor, self.normalize_top_k = capacity_factor, normalize_top_k
        self.compute_dtype = compute_dtype

        def weight(shape, std, name):
            return Parameter(initializer(Normal(std), shape, ms.float32), name=name)
        self.router = weight((num_experts, hidden_size), init_std, "router")
        # (E, in, out): batched products over the experts
        self.gate = weight((num_experts, hidden_size, ffn_hidden_size), init_std, "gate")
        self.up = weight((num_experts, hidden_size, ffn_hidden_size), init_std, "up")
        self.down = weight((num_experts, ffn_hidden_size, hidden_size),
                           output_init_std or init_std, "down")
        self.route = ops.MatMul(transpose_b=True)
        self.expert_product = ops.BatchMatMul()
        self.dispatch_product = ops.MatMul(transpose_a=True)
        self.combine_product = ops.MatMul()
        self.softmax = ops.Softmax(axis=-1)
        self.silu = SiLU()

    def construct(self, x):
        batch, seq, hidden = x.shape
        tokens = ops.reshape(x, (batch * seq, hidden))                 # (T, H)
        count = batch * seq
        probabilities = self.softmax(self.route(ops.cast(tokens, ms.float32),
                                                self.router))          # (T, E)
        weights, chosen = ops.topk(probabilities, self.top_k)          # (T, k)
        if self.normalize_top_k:
            weights = weights / ops.sum(weights, -1, keepdim=True)
        capacity = expert_capacity(count, self.num_experts, self.top_k,
                                   self.capacity_factor)
        dispatch, combine, choices = self._slots(chosen, weights, capacity)
        # (E C, H): each expert's slots; empty slots stay zero and come back as zero
        inputs = self.dispatch_product(dispatch, ops.cast(tokens, self.compute_dtype))
        inputs = ops.reshape(inputs, (self.num_experts, capacity, hidden))
        gate = self.expert_product(inputs, ops.cast(self.gate, self.compute_dtype))
        up = self.expert_product(inputs, ops.cast(self.up, self.compute_dtype))
        outputs = self.expert_product(self.silu(gate) * up,
                                      ops.cast(self.down, self.compute_dtype))  # (E, C, H)
        outputs = ops.reshape(ops.cast(outputs, ms.float32),
                              (self.num_experts * capacity, hidden))
        mixed = self.combine_product(combine, outputs)                 # (T, H)
        return (ops.reshape(mixed, (batch, seq, hidden)), choices,
                ops.sum(probabilities, 0))

    def _slots(self, chosen, weights, capacity: int):
        """(dispatch (T, E C) in the compute dtype, combine (T, E C) float32, choices per
        expert (E,)): choice j of every token placed after the slots taken by choices
        0..j-1, in token order; beyond the capacity dropped."""
        taken = ops.zeros((1, self.num_experts), ms.float32)
        dispatch = combine = None
        for j in range(self.top_k):
            picked = ops.one_hot(chosen[:, j], self.num_experts,
                                 ops.ones((), ms.float32), ops.zeros((), ms.float32))
            slot = ops.cumsum(picked, 0) - 1 + taken                   # (T, E)
            kept = picked * ops.cast(slot < capacity, ms.float32)
            taken = taken + ops.sum(picked, 0, keepdim=True)
            position = ops.one_hot(ops.cast(ops.sum(slot * kept, -1), ms.int32), capacity,
                                   ops.ones((), ms.float32), ops.zeros((), ms.float32))
            placed = ops.expand_dims(kept, -1) * ops.expand_dims(position, 1)   # (T, E, C)
            weighted = placed * ops.reshape(weights[:, j], (-1, 1, 1))
            dispatch = placed if dispatch is None else dispatch + placed
            combine = weighted if combine is None else combine + weighted
        flat = (dispatch.shape[0], self.num_experts * capacity)
        return (ops.cast(ops.reshape(dispatch, flat), self.compute_dtype),
                ops.reshape(combine, flat), ops.reshape(taken, (self.num_experts,)))


def load_balancing_loss(choices, probability_sums, tokens: int, num_experts: int):
    """The Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6), as Hugging
    Face's Mixtral computes it over all layers: E sum_e f_e P_e with f_e the share of the
    choices expert e received per token (summing to k) and P_e its mean router
    probability. `choices`, `probability_sums`: (E,) summed over the layers; `tokens`: the
    token rows they were summed over (tokens x layers)."""
    return num_experts * ops.sum((choices / tokens) * (probability_sums / tokens))
