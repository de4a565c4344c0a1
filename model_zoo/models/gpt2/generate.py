"""Autoregressive decoding with a fixed input shape.

Every step feeds the language model one (1, seq_length) batch: the context right-padded
with id 0, so a graph-mode network compiles once. The causal mask keeps the padding after
position i out of position i's logits, so the logits of the last real token are exact.
A context longer than seq_length keeps its last seq_length tokens (a sliding window).
"""

import numpy as np
import mindspore as ms


def _check_arguments(prompt_ids, max_new_tokens, seq_length, top_k, top_p, temperature):
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


def generate(lm, prompt_ids, max_new_tokens: int, *, seq_length: int, greedy: bool = True,
             top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0, seed: int = 0,
             eos_id=None) -> list:
    """Continue `prompt_ids`; returns the new ids only (the prompt excluded).

    Args:
        lm: a cell mapping int32 ids (1, seq_length) to logits (seq_length, vocab), e.g. the
            `.lm` of `GPT2ForTraining`; put it in eval mode (`set_train(False)`) first.
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to add at most (>= 1).
        seq_length: the model's input length (its number of positions).
        greedy: take the most likely token; otherwise sample with `temperature`, `top_k`
            (0 disables it) and `top_p` (1.0 disables it) from `numpy.random.default_rng(seed)`.
        eos_id: stop after producing this id (it is included in the result).

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, top_k < 0, top_p outside (0, 1],
            temperature <= 0.
    """
    prompt = [int(token) for token in np.asarray(prompt_ids).reshape(-1)]
    _check_arguments(prompt, max_new_tokens, seq_length, top_k, top_p, temperature)
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    new_ids = []
    window = np.zeros((1, seq_length), dtype=np.int32)
    for _ in range(int(max_new_tokens)):
        context = tokens[-seq_length:]
        window[:] = 0
        window[0, :len(context)] = context
        logits = lm(ms.Tensor(window)).asnumpy()
        row = logits.reshape(-1, logits.shape[-1])[len(context) - 1]
        if greedy:
            token = int(np.argmax(row))
        else:
            probs = filter_logits(row, temperature=temperature, top_k=top_k, top_p=top_p)
            token = int(rng.choice(probs.size, p=probs))
        tokens.append(token)
        new_ids.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new_ids
