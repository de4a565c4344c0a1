"""Autoregressive decoding: batched, through the attention's key/value caches.

`CachedGenerator` runs the positions every prompt has in one pass (prefill), then feeds
every row one token a step to a compiled step cell (`DecodeStep`) that attends over
key/value caches it updates in place, so a step costs the same at position 500 as at
position 1 and the cell compiles once per batch size and cache length. All prompts share
the step's position: a shorter prompt simply starts generating earlier, so no padding
enters any row (its positions are those of the prompt alone, as Hugging Face's left padding
with an attention mask gives). Greedy, or sampled with temperature, top-k and top-p; a
repetition penalty (Hugging Face's: a seen token's positive logit divided by it, a negative
one multiplied); each row stops at its end-of-sequence id.

A prompt plus its new tokens longer than the model's positions goes through the window
path instead (`generate`): the last seq_length tokens fed again every step.

What a language model (`lm`, e.g. GPT2LMHeadModel, LlamaForCausalLM) offers the cached path:
    config.seq_length          its positions;
    cache_layout()             (layers, cache heads, head_dim, dtype) of its key/value caches
                               (cache heads: the key/value heads, fewer than the query heads
                               with grouped-query attention);
    position_tables()          numpy tables (positions, ...) whose rows [p, p + n) are the
                               position inputs of positions p .. p + n - 1 (GPT-2: its
                               learned embeddings; LLaMA: rotary cos and sin);
    lm(ids (batch, n), cache)  the call that trains, given a decoding cache (`nn.cache`):
                               logits (batch, vocab) of the last position, the caches
                               written in place.
"""

import sys
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from model_zoo.nn import cache as kv_cache

PROGRESS_SECONDS = 10.0   # the window path prints its progress this often


def _check_arguments(prompt_ids, max_new_tokens, seq_length, top_k, top_p, temperature,
                     repetition_penalty):
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token id")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if int(seq_length) != seq_length or seq_length < 1:
        raise ValueError(f"seq_length must be an integer >= 1, got {seq_length!r}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")


def next_token(scores, seen, rng, *, greedy: bool, top_k: int, top_p: float,
               temperature: float, repetition_penalty: float) -> int:
    """The token after a logits row: the repetition penalty over the `seen` ids, then the
    most likely token (`greedy`) or one drawn from `rng` (`filter_logits`)."""
    if repetition_penalty != 1.0:
        scores = penalise_repetition(scores, seen, repetition_penalty)
    if greedy:
        return int(np.argmax(scores))
    probs = filter_logits(scores, temperature=temperature, top_k=top_k, top_p=top_p)
    return int(rng.choice(probs.size, p=probs))


def filter_logits(logits, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> np.ndarray:
    """Sampling probabilities of one logits row: temperature, then top-k, then top-p.

    Top-k keeps the k largest logits (0 keeps all); top-p (nucleus) keeps the smallest set
    of most likely tokens whose probability reaches top_p (the most likely token always
    stays). Returns float64 probabilities summing to 1.
    """
    scores = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < scores.size:
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        keep = np.zeros(probs.shape, dtype=bool)
        keep[order[mass_before < top_p]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


CACHE_STEP = 64
PREFILL_STEP = 16   # prompts are prefilled in multiples of this many positions
KEPT_STEPS = 4      # compiled step cells (and their caches) a generator keeps


class DecodeStep(nn.Cell):
    """Positions of a language model for `batch` rows over key/value caches of `length`
    positions, which the cell holds as Parameters and the attention writes in place (no
    cache is copied or allocated per step): a step (one position) or prefill (the first P).

    Inputs:
        ids: int32 (batch, n), the tokens at the call's positions in every row.
        positions: the lm's position inputs of those positions (rows of `position_tables`).
        write_index: `cache.cache_index` of the positions.
        bias: a step's `cache.step_bias` (prefill reads only its own positions: any).
    Outputs:
        float32 logits (batch, vocab) for the position after the last.
    """

    def __init__(self, lm, batch: int, length: int):
        super().__init__(auto_prefix=False)
        self.lm = lm
        # BatchMatMul takes q and the cached k in one dtype: the attention's compute dtype
        layers, heads, head_dim, dtype = lm.cache_layout()
        shape = (batch, heads, length, head_dim)
        self.keys = kv_cache.zeros(layers, shape, dtype, "decode_keys")
        self.values = kv_cache.zeros(layers, shape, dtype, "decode_values")

    def construct(self, ids, positions, write_index, bias):
        return self.lm(ids, kv_cache.make(self.keys, self.values, write_index, bias, positions))


class CachedGenerator:
    """Batched cached generation with one language model (put in eval mode here; see the
    module docstring). It keeps the step cells of its last `KEPT_STEPS` (batch, cache
    length) shapes, so calls of those shapes reuse the compiled graphs and caches."""

    def __init__(self, lm):
        lm.set_train(False)
        self.lm = lm
        self.seq_length = lm.config.seq_length
        self.heads = lm.cache_layout()[1]
        self.steps = {}

    def positions(self, start: int, count: int) -> tuple:
        """The position inputs of positions start .. start + count - 1, as a mutable tuple:
        a plain tuple is a constant of the compiled graph, which then compiled again for
        every position (850 ms a step instead of 2 for GPT-2 tiny)."""
        return ms.mutable(tuple(Tensor(table[start:start + count]) for table in self.tables))

    def step_cells(self, batch: int, length: int):
        """The decoding cell for `batch` rows and caches of `length` positions."""
        key = (batch, length)
        if key not in self.steps:
            if len(self.steps) == KEPT_STEPS:
                del self.steps[next(iter(self.steps))]   # the oldest
            self.steps[key] = DecodeStep(self.lm, batch, length)
        return self.steps[key]

    def generate(self, prompts, max_new_tokens: int, *, greedy: bool = True, top_k: int = 0,
                 top_p: float = 1.0, temperature: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int = 0, eos_id=None) -> list:
        """The new ids of every prompt (lists of ids), in order; see the module docstring."""
        self.lm.set_train(False)   # training may have switched it back since
        # the tables as the weights are now (GPT-2's are learned: trained or loaded since)
        self.tables = self.lm.position_tables()
        prompts = [[int(t) for t in np.asarray(p).reshape(-1)] for p in prompts]
        if not prompts:
            raise ValueError("no prompt: give at least one")
        for prompt in prompts:
            _check_arguments(prompt, max_new_tokens, self.seq_length, top_k, top_p,
                             temperature, repetition_penalty)
        choice = dict(greedy=greedy, top_k=top_k, top_p=top_p, temperature=temperature,
                      repetition_penalty=repetition_penalty)
        longest = max(len(p) for p in prompts) + int(max_new_tokens)
        if longest > self.seq_length:
            raise ValueError(f"a prompt and its new tokens take {longest} positions, the model "
                             f"has {self.seq_length}")
        rng = np.random.default_rng(seed)
        batch = len(prompts)
        # caches as long as this call needs, in steps of 64 so that calls of similar
        # lengths share a compiled step: attention then spans those positions only. Their
        # old contents need no clearing: position p is written before any step reads it.
        length = min(self.seq_length, -(-longest // CACHE_STEP) * CACHE_STEP)
        step = self.step_cells(batch, length)
        tokens = [list(p) for p in prompts]          # prompt + generated, per row
        new_ids = [[] for _ in prompts]
        done = [False] * batch
        # the positions every prompt has, in one pass (in multiples of PREFILL_STEP, so
        # that few prompt lengths need a graph of their own); the steps go on from there
        position = min(len(p) for p in prompts) // PREFILL_STEP * PREFILL_STEP
        logits = None
        if position:
            ids = np.array([row[:position] for row in tokens], np.int32)
            logits = step(Tensor(ids), self.positions(0, position),
                          kv_cache.cache_index(0, position, batch, self.heads),
                          kv_cache.step_bias(position - 1, length)).asnumpy()
        while True:
            if logits is not None:   # the logits of position - 1 choose the token at position
                for row in range(batch):
                    if done[row] or position < len(tokens[row]):
                        continue   # finished, or still feeding its prompt
                    token = next_token(logits[row], tokens[row], rng, **choice)
                    tokens[row].append(token)
                    new_ids[row].append(token)
                    done[row] = len(new_ids[row]) == max_new_tokens or token == eos_id
                if all(done):
                    break
            # a finished row is fed its last token again: its outputs are not read
            ids = np.array([[row[min(position, len(row) - 1)]] for row in tokens], np.int32)
            write_index, step_bias = kv_cache.step_inputs(position, length, batch, self.heads)
            logits = step(Tensor(ids), self.positions(position, 1), write_index,
                          step_bias).asnumpy()
            position += 1
        return new_ids


def penalise_repetition(logits, seen, penalty: float) -> np.ndarray:
    """Hugging Face's repetition penalty: a seen token's logit divided by `penalty` when
    positive, multiplied when negative (CTRL, Keskar et al. 2019)."""
    scores = np.array(logits, dtype=np.float64)
    index = np.unique(np.asarray(seen, dtype=np.int64))
    chosen = scores[index]
    scores[index] = np.where(chosen > 0, chosen / penalty, chosen * penalty)
    return scores


def generate_ids(lm, prompts, max_new_tokens: int, **options) -> list:
    """The new ids of every prompt: through the caches (`CachedGenerator`) when each prompt
    and its new tokens fit in the model's positions, else prompt by prompt through the
    window (`generate`). `options`: those of `CachedGenerator.generate`."""
    seq_length = lm.config.seq_length
    if max(len(p) for p in prompts) + int(max_new_tokens) <= seq_length:
        # one generator per model, kept on it: its step cells keep their compiled graphs
        # from call to call (`model-zoo generate`'s batches; a new one compiled each batch)
        generator = getattr(lm, "cached_generator", None)
        if generator is None:
            generator = lm.cached_generator = CachedGenerator(lm)
        return generator.generate(prompts, max_new_tokens, **options)
    print(f"note: a prompt plus {int(max_new_tokens)} new tokens is longer than the model's "
          f"{seq_length} positions: generating through a sliding window without the "
          f"key/value cache (each token runs the whole window; progress every "
          f"{PROGRESS_SECONDS:.0f} s)", file=sys.stderr, flush=True)
    return [generate(lm, prompt, max_new_tokens, seq_length=seq_length, **options)
            for prompt in prompts]


def generate(lm, prompt_ids, max_new_tokens: int, *, seq_length: int, greedy: bool = True,
             top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0,
             repetition_penalty: float = 1.0, seed: int = 0, eos_id=None) -> list:
    """Continue `prompt_ids` by feeding the whole window every step (no cache); returns the
    new ids only (the prompt excluded). The reference `CachedGenerator` is held against,
    and the path for a prompt plus new tokens longer than the model's positions.

    Args:
        lm: a cell mapping int32 ids (1, seq_length) to logits (seq_length, vocab), e.g. the
            `.lm` of a training network; put it in eval mode (`set_train(False)`) first.
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to add at most (>= 1).
        seq_length: the model's input length (its number of positions).
        greedy: take the most likely token; otherwise sample with `temperature`, `top_k`
            (0 disables it) and `top_p` (1.0 disables it) from `numpy.random.default_rng(seed)`.
        eos_id: stop after producing this id (it is included in the result).

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, top_k < 0, top_p outside (0, 1],
            temperature <= 0, repetition_penalty <= 0.
    """
    prompt = [int(token) for token in np.asarray(prompt_ids).reshape(-1)]
    _check_arguments(prompt, max_new_tokens, seq_length, top_k, top_p, temperature,
                     repetition_penalty)
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    new_ids = []
    window = np.zeros((1, seq_length), dtype=np.int32)
    started = reported = time.perf_counter()
    for done in range(int(max_new_tokens)):
        if done and time.perf_counter() - reported >= PROGRESS_SECONDS:
            reported = time.perf_counter()
            print(f"generated {done}/{int(max_new_tokens)} tokens "
                  f"({done / (reported - started):.1f} tokens/s)", file=sys.stderr, flush=True)
        context = tokens[-seq_length:]
        window[:] = 0
        window[0, :len(context)] = context
        logits = lm(ms.Tensor(window)).asnumpy()
        row = logits.reshape(-1, logits.shape[-1])[len(context) - 1]
        token = next_token(row, tokens, rng, greedy=greedy, top_k=top_k, top_p=top_p,
                           temperature=temperature, repetition_penalty=repetition_penalty)
        tokens.append(token)
        new_ids.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new_ids
