"""Mixture of experts: a top-k router over SwiGLU experts (Mixtral, Qwen2-MoE), with the
Switch Transformer's load-balancing statistics and expert parallelism.

Tokens reach their experts through one-hot dispatch products of static shape, as
MindSpore's own MoE layer moves them (mindspore/parallel/_transformer/moe.py of
MindSpore 1.x-2.2, the layer PanGu-Sigma trained with; MindFormers' MoE keeps the
layout). The tokens are routed in groups G of N, one sequence a group (GShard's groups;
equal parts of a sequence only when a data-parallel rank holds less than one), so the
routing is the same on any layout and its tensors grow with the batch, not its square:
each expert takes at most C tokens of a group (its capacity), a token's k choices placed
in priority order (every token's first choice before any second choice, GShard), and

    dispatch (G, N, E C)   1 where token n sits in slot c of expert e
    expert inputs          (G, E C, H) = dispatch^T x, on each group's own rank
    all-to-all             (dp/ep, E, S, H): the experts split over `expert_parallel`
                           devices, S = ep G/dp C slots of each outer group
    expert outputs         (dp/ep, E, S, H): each expert's SwiGLU on its slots (batched
                           products, the expert width split over model_parallel)
    all-to-all back        (G, E C, H)
    output (G, N, H)       = combine . expert outputs, combine = dispatch x weight

`capacity_factor` > 0 sets C = ceil(k N / E x factor) and drops what overflows (the
token's other choices still count); `capacity_factor` <= 0 is dropless: C = N, so every
choice fits (a token picks an expert once), at O(E N^2) a group for the dispatch
tensors, which is what a static shape costs.

Strategies (dp, mp, ep = data, model, expert parallel; ep divides dp and the experts),
laid out as MindFormers' MoE feed-forward is (outer batch dp/ep first, the experts on the
inner ep axis; mindformers/modules/transformer/transformer.py, FeedForward): the router and
the slots split the groups (dp, 1, 1), as the batch is split; the groups are viewed as
(dp/ep, ep, G/dp) and the transpose before the experts moves the inner ep factor to the
experts, an AllToAll among ep ranks mp apart (`AutoParallel` enables AllToAll), so the
expert products ((dp/ep, ep, 1, 1), (ep, 1, mp)) and ((dp/ep, ep, 1, mp), (ep, mp, 1)) on
(dp/ep, E, slots, H) find expert e's tokens on the ranks that hold its weights (each
expert's weights on the ep-th of the devices the AllToAll delivered to, replicated over
the dp/ep outer groups); the transpose after them moves the split back the same way.
"""

import math

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, Zero, initializer
from mindspore.ops.auto_generate import SiLU

from model_zoo.nn.backend import batch_products_broadcast, cpu_kernel
from model_zoo.parallel.config import ParallelConfig


def expert_capacity(tokens: int, num_experts: int, experts_per_token: int,
                    capacity_factor: float) -> int:
    """Slots per expert for a group of `tokens`: every token when dropless (factor <= 0),
    else the even share of the k tokens choices times the factor, rounded up (at most
    `tokens`: a token picks an expert once)."""
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
        x: (batch, seq, hidden); statistics: float32 (2, E), the earlier layers'
        load-balancing statistics (or None: the first layer).
    Outputs:
        float32 (batch, seq, hidden); statistics plus these tokens' (2, E): row 0 the
        choices each expert received (summed over the k choices, dropped ones included),
        row 1 the router probability summed over the tokens (`LoadBalancingLoss` turns
        them, summed over layers, into the auxiliary loss).
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
        dp, mp = parallel_config.dp, parallel_config.mp
        ep = parallel_config.expert_parallel
        parallel_config.check_divisible("model.num_experts", num_experts, "expert_parallel")
        parallel_config.check_divisible("model.moe_intermediate_size", ffn_hidden_size)
        self.num_experts, self.top_k = num_experts, experts_per_token
        self.capacity_factor, self.normalize_top_k = capacity_factor, normalize_top_k
        self.compute_dtype = compute_dtype
        self.data_parallel, self.expert_parallel = dp, ep
        # on CPU, dropless, float32: the experts' products on the rows routed to them
        self.kernel = (cpu_kernel("moe_experts", dtype=compute_dtype)
                       if capacity_factor <= 0 else None)

        def weight(shape, std, name):
            return Parameter(initializer(Normal(std), shape, ms.float32), name=name)
        self.router = weight((num_experts, hidden_size), init_std, "router")
        # (E, in, out): batched products over the experts
        self.gate = weight((num_experts, hidden_size, ffn_hidden_size), init_std, "gate")
        self.up = weight((num_experts, hidden_size, ffn_hidden_size), init_std, "up")
        self.down = weight((num_experts, ffn_hidden_size, hidden_size),
                           output_init_std or init_std, "down")
        # the routing of the last call (a step's last micro batch), which the run log reads
        # (`train.loop`): the choices each expert received, and those dropped at capacity;
        # not weights (`checkpoint.contents.ROUTING_RECORD`: not saved)
        self.expert_load = Parameter(initializer(Zero(), (num_experts,), ms.float32),
                                     name="expert_load", requires_grad=False)
        self.expert_dropped = (Parameter(initializer(Zero(), (1,), ms.float32),
                                         name="expert_dropped", requires_grad=False)
                               if capacity_factor > 0 else None)
        self.record = ops.Assign().shard(((1,), (1,)))

        groups = (dp, 1, 1)         # (G, N, E) and (G, N, H): the groups split as the batch
        self.route = ops.MatMul(transpose_b=True).shard(((dp, 1), (1, 1)))
        self.softmax = ops.Softmax(axis=-1).shard((groups,))
        self.top = ops.ArgMaxWithValue(axis=-1).shard((groups,))
        self.one_hot = ops.OneHot().shard((groups, (), ()))
        self.doubled = ops.Mul().shard((groups, ()))
        self.mask_out = ops.Sub().shard((groups, groups))
        self.less_one = ops.Sub().shard((groups, ()))
        self.sum_weights = ops.Add().shard(((dp, 1), (dp, 1)))
        self.share = ops.RealDiv().shard(((dp, 1), (dp, 1)))
        self.running = ops.CumSum().shard((groups,))
        self.offset = ops.Add().shard((groups, (dp, 1, 1)))
        self.fits = ops.Less().shard((groups, ()))
        self.keep = ops.Mul().shard((groups, groups))
        self.count = ops.ReduceSum(keep_dims=True).shard((groups,))
        self.add_counts = ops.Add().shard((groups, groups))
        self.slot_index = ops.ReduceSum().shard((groups,))
        self.place = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.weigh_choice = ops.Mul().shard((groups, groups))
        self.add_weights = ops.Add().shard((groups, groups))
        self.weigh = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.add_slots = ops.Add().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.statistics = ops.ReduceSum().shard((groups,))
        self.within_capacity = ops.Minimum().shard((groups, ()))
        self.count_kept = ops.ReduceSum().shard((groups,))
        self.stack = ops.Concat().shard(((1, 1), (1, 1)))
        self.add_statistics = ops.Add().shard(((1, 1), (1, 1)))
        # (G, N, E C)^T x (G, N, H) -> (G, E C, H), and back
        self.dispatch_product = ops.BatchMatMul(transpose_a=True).shard((groups, groups))
        self.combine_product = ops.BatchMatMul().shard((groups, groups))
        # (dp/ep, ep, G/dp, E, C, H) -> (dp/ep, E, ep, G/dp, C, H): the inner ep factor of
        # the groups moves to the experts (an AllToAll over ep ranks mp apart), and back
        outer = (dp // ep, ep, 1, 1)
        self.to_experts = ops.Transpose().shard(((dp // ep, 1, 1, ep, 1, 1),))
        self.from_experts = ops.Transpose().shard(((dp // ep, ep, 1, 1, 1, 1),))
        # (dp/ep, E, S, H) x (E, H, F) -> (dp/ep, E, S, F); (.., F) x (E, F, H) -> (.., H):
        # on Ascend BatchMatMul broadcasts the 3-D weight itself (as MindFormers' does);
        # MindSpore's CPU and GPU kernels do not, so there each weight is first copied to
        # (dp/ep, E, in, out) by a Mul by ones (the products' device matrix, a rank holding
        # only its slice): the same layouts and collectives, one weight-sized copy more
        if batch_products_broadcast():
            self.copy_in = self.copy_out = None
            weight_in, weight_out = (ep, 1, mp), (ep, mp, 1)
        else:
            self.copy_in = ops.Mul().shard(((dp // ep, 1, 1, 1), (ep, 1, mp)))
            self.copy_out = ops.Mul().shard(((dp // ep, 1, 1, 1), (ep, mp, 1)))
            weight_in, weight_out = (dp // ep, ep, 1, mp), (dp // ep, ep, mp, 1)
        self.expert_in = ops.BatchMatMul().shard((outer, weight_in))
        self.expert_out = ops.BatchMatMul().shard(((dp // ep, ep, 1, mp), weight_out))
        # the plan's model FLOPs (MFU) are the routed tokens through their experts only
        # (cost/compute.py): the dispatch and combine products move tokens, and of the
        # experts' slots the k N choices of a group fill at most k N of E C
        self.dispatch_product.model_work = "moves tokens"
        self.dispatch_product.routed_choices = experts_per_token
        self.combine_product.model_work = "moves tokens"
        self.expert_in.model_work = self.expert_out.model_work = "expert slots"
        self.silu = SiLU().shard(((dp // ep, ep, 1, mp),))
        self.gated = ops.Mul().shard(((dp // ep, ep, 1, mp), (dp // ep, ep, 1, mp)))

    def construct(self, x, statistics=None):
        batch, seq, hidden = x.shape
        # a group a sequence; equal parts of one when the data-parallel ranks hold less
        # than a sequence each
        pieces = self.data_parallel // math.gcd(batch, self.data_parallel)
        pieces = pieces if seq % pieces == 0 else 1
        groups, count = batch * pieces, seq // pieces
        tokens = ops.reshape(x, (groups, count, hidden))                       # (G, N, H)
        logits = self.route(ops.reshape(ops.cast(tokens, ms.float32), (-1, hidden)),
                            self.router)
        probabilities = self.softmax(ops.reshape(logits, (groups, count, -1)))  # (G, N, E)
        indices, picks, weights = self._choices(probabilities)
        if self.kernel is not None:
            mixed, choices = self._routed(tokens, indices, picks, weights)
        else:
            capacity = expert_capacity(count, self.num_experts, self.top_k,
                                       self.capacity_factor)
            dispatch, combine, choices, kept = self._slots(picks, weights, capacity)
            inputs = self.dispatch_product(dispatch, ops.cast(tokens, self.compute_dtype))
            outputs = self._experts(inputs, groups, capacity)                    # (G, E C, H)
            mixed = self.combine_product(combine, outputs)
            if self.expert_dropped is not None:
                dropped = ops.reshape(groups * count * self.top_k - kept, (1,))
                choices = ops.depend(choices, self.record(self.expert_dropped, dropped))
        # the records wait on the small statistics, not on the activations
        choices = ops.depend(choices, self.record(self.expert_load, choices))
        own = self.stack((ops.reshape(choices, (1, -1)),
                          ops.reshape(self.statistics(probabilities, (0, 1)), (1, -1))))
        if statistics is not None:
            own = self.add_statistics(statistics, own)
        return ops.reshape(ops.cast(mixed, ms.float32), (batch, seq, hidden)), own

    def _routed(self, tokens, indices, picks, weights):
        """The dropless output through the CPU kernel (`cpu_kernels.moe_experts`: each
        expert's products on only the rows routed to it, no slots) and the choices per
        expert (E,); the tokens (G, N, H)."""
        groups, count, hidden = tokens.shape
        experts = self.num_experts
        chosen = ops.stack([ops.reshape(ops.cast(index, ms.int32), (-1,))
                            for index in indices], -1)                           # (T, k)
        weight = ops.stack([ops.reshape(w, (-1,)) for w in weights], -1)         # (T, k)
        mixed = self.kernel(ops.reshape(tokens, (-1, hidden)), chosen, weight, self.gate,
                            self.up, self.down)[0]
        choices = picks[0]
        for picked in picks[1:]:
            choices = choices + picked
        return (ops.reshape(mixed, (groups, count, hidden)),
                ops.sum(ops.reshape(choices, (-1, experts)), 0))

    def _experts(self, inputs, groups: int, capacity: int):
        """(G, E C, H) slots -> their experts' outputs, same layout (module docstring)."""
        experts, hidden = self.num_experts, inputs.shape[-1]
        # the groups as (dp / ep, ep, G / dp): each rank's groups, the inner ep factor the
        # split that moves to the experts (any G on one device, where the strategies do not
        # apply)
        split = math.gcd(groups, self.data_parallel)
        moved = math.gcd(split, self.expert_parallel)
        ranks = (split // moved, moved, groups // split)
        outer = ranks[0]
        inputs = ops.reshape(inputs, (*ranks, experts, capacity, hidden))
        inputs = self.to_experts(inputs, (0, 3, 1, 2, 4, 5))
        inputs = ops.reshape(inputs, (outer, experts, -1, hidden))           # (dp/ep, E, S, H)
        gate = self.expert_in(inputs, self._per_group(self.gate, self.copy_in, outer))
        up = self.expert_in(inputs, self._per_group(self.up, self.copy_in, outer))
        outputs = self.expert_out(self.gated(self.silu(gate), up),
                                  self._per_group(self.down, self.copy_out, outer))
        outputs = ops.reshape(outputs, (outer, experts, *ranks[1:], capacity, hidden))
        outputs = self.from_experts(outputs, (0, 2, 3, 1, 4, 5))
        return ops.reshape(outputs, (groups, experts * capacity, hidden))

    def _per_group(self, weight, copy, outer: int):
        """An expert weight (E, in, out) in the compute dtype, as the products take it: as it
        is, or copied to (outer, E, in, out) by `copy` (a Mul by ones; see __init__)."""
        weight = ops.cast(weight, self.compute_dtype)
        if copy is None:
            return weight
        return copy(ops.ones((outer, 1, 1, 1), self.compute_dtype), weight)

    def _choices(self, probabilities):
        """The k choices of every token from the router's probabilities (G, N, E): each an
        index (G, N), its one-hot (G, N, E) and its weight (G, N), renormalised with
        `normalize_top_k`."""
        experts = probabilities.shape[-1]
        remaining, indices, picks, weights = probabilities, [], [], []
        for _ in range(self.top_k):
            index, weight = self.top(remaining)                                  # (G, N)
            picked = self.one_hot(index, experts, ops.ones((), ms.float32),
                                  ops.zeros((), ms.float32))                     # (G, N, E)
            # the picked expert's probability pushed below every other
            remaining = self.mask_out(remaining, self.doubled(picked, ops.cast(2.0, ms.float32)))
            indices.append(index)
            picks.append(picked)
            weights.append(weight)
        if self.normalize_top_k:
            total = weights[0]
            for weight in weights[1:]:
                total = self.sum_weights(total, weight)
            weights = [self.share(weight, total) for weight in weights]
        return indices, picks, weights

    def _slots(self, picks, weights, capacity: int):
        """(dispatch (G, N, E C), combine (G, N, E C) in the compute dtype, choices per
        expert (E,), the choices given a slot: a float32 scalar) of the tokens' choices
        (`_choices`): choice j of every token placed after the slots its group's choices
        0..j-1 took, in token order; beyond the capacity dropped."""
        groups, count, experts = picks[0].shape
        taken = ops.zeros((groups, 1, experts), ms.float32)
        dispatch = token_weights = None
        for picked, weight in zip(picks, weights):
            ahead = self.less_one(self.running(picked, 1), ops.cast(1.0, ms.float32))
            slot = self.offset(ahead, taken)                                     # (G, N, E)
            fits = self.fits(slot, ops.cast(capacity, ms.float32))
            kept = self.keep(picked, ops.cast(fits, ms.float32))
            taken = self.add_counts(taken, self.count(picked, 1))
            position = self.one_hot(ops.cast(self.slot_index(self.keep(slot, kept), -1),
                                             ms.int32), capacity,
                                    ops.ones((), ms.float32), ops.zeros((), ms.float32))
            placed = self.place(ops.reshape(kept, (groups, count, experts, 1)),
                                ops.reshape(position, (groups, count, 1, capacity)))  # (G,N,E,C)
            dispatch = placed if dispatch is None else self.add_slots(dispatch, placed)
            # the token's weight for each expert it picked (G, N, E): a token picks an
            # expert once, and a dropped choice has no slot to weigh
            chosen = self.weigh_choice(picked, ops.reshape(weight, (groups, count, 1)))
            token_weights = chosen if token_weights is None else self.add_weights(
                token_weights, chosen)
        dispatch = ops.cast(dispatch, self.compute_dtype)
        combine = self.weigh(dispatch, ops.reshape(ops.cast(token_weights, self.compute_dtype),
                                                   (groups, count, experts, 1)))
        flat = (groups, count, experts * capacity)
        # an expert keeps the first C of a group's choices of it
        kept = self.count_kept(self.within_capacity(taken, ops.cast(capacity, ms.float32)), ())
        return (ops.reshape(dispatch, flat), ops.reshape(combine, flat),
                self.statistics(taken, (0, 1)), kept)


class LoadBalancingLoss(nn.Cell):
    """The Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6), as Hugging
    Face's Mixtral computes it over all layers: E sum_e f_e P_e with f_e the share of the
    choices expert e received per token (summing to k) and P_e its mean router
    probability.

    Inputs:
        statistics: float32 (2, E), `MixtureOfExperts`' choices and probability sums,
        summed over the layers; tokens: the token rows they were summed over (tokens x
        layers), a Python int.
    Outputs:
        the loss, a float32 scalar.
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.product = ops.ReduceProd().shard(((1, 1),))   # choices x probability sums
        self.total = ops.ReduceSum().shard(((1,),))
        self.scale = ops.Mul().shard(((), ()))

    def construct(self, statistics, tokens: int):
        return self.scale(self.total(self.product(statistics, 0), ()),
                          ops.cast(self.num_experts / tokens ** 2, ms.float32))
