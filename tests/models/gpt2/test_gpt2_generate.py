"""Decoding a tiny random GPT-2: the window path, and batched generation through the
key/value caches held against it."""

import os

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest
import mindspore as ms

from model_zoo.causal_lm.generate import (CachedGenerator, filter_logits, generate,
                                            generate_ids, penalise_repetition)
from model_zoo.models.gpt2.model import GPT2Config, GPT2ForTraining

SEQ, VOCAB = 8, 23


@pytest.fixture(scope="module")
def lm():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    # A large init_std gives peaked logits, so argmax is not decided by rounding noise.
    config = GPT2Config(num_layers=1, hidden_size=32, num_heads=2, seq_length=SEQ,
                        vocab_size=VOCAB, init_std=0.3)
    network = GPT2ForTraining(config)
    network.set_train(False)
    return network.lm


def _argmax_last(lm, tokens):
    logits = lm(ms.Tensor(np.array([tokens], dtype=np.int32))).asnumpy()
    return int(np.argmax(logits.reshape(len(tokens), VOCAB)[-1]))


def test_greedy_equals_full_recomputation(lm):
    prompt = [3, 1, 4]
    expected, tokens = [], list(prompt)
    for _ in range(3):
        token = _argmax_last(lm, tokens)
        expected.append(token)
        tokens.append(token)
    assert generate(lm, prompt, 3, seq_length=SEQ) == expected


def test_top_k_1_sampling_equals_greedy(lm):
    prompt = [7, 2]
    greedy = generate(lm, prompt, 4, seq_length=SEQ)
    sampled = generate(lm, prompt, 4, seq_length=SEQ, greedy=False, top_k=1, seed=5,
                       temperature=2.0)
    assert sampled == greedy


def test_same_seed_same_sample(lm):
    kwargs = dict(seq_length=SEQ, greedy=False, temperature=3.0, top_k=10, top_p=0.95)
    first = generate(lm, [1, 2, 3], 5, seed=11, **kwargs)
    assert generate(lm, [1, 2, 3], 5, seed=11, **kwargs) == first
    assert len(first) == 5 and all(0 <= token < VOCAB for token in first)


def test_eos_stops_generation(lm):
    prompt = [9, 9, 1]
    full = generate(lm, prompt, 5, seq_length=SEQ)
    cut = 2
    eos = full[cut]
    stopped = generate(lm, prompt, 5, seq_length=SEQ, eos_id=eos)
    assert stopped == full[:full.index(eos) + 1]
    assert stopped[-1] == eos


def test_sliding_window(lm):
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, size=SEQ + 3)]
    ours = generate(lm, prompt, 3, seq_length=SEQ)
    expected, tokens = [], list(prompt)
    for _ in range(3):
        token = _argmax_last(lm, tokens[-SEQ:])
        expected.append(token)
        tokens.append(token)
    assert ours == expected
    assert generate(lm, prompt[-SEQ:], 3, seq_length=SEQ) == ours


def test_filter_logits():
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    np.testing.assert_allclose(filter_logits(logits), [0.2, 0.5, 0.3])
    np.testing.assert_allclose(filter_logits(logits, top_k=2), [0.0, 0.5 / 0.8, 0.3 / 0.8])
    np.testing.assert_allclose(filter_logits(logits, top_p=0.6), [0.0, 0.5 / 0.8, 0.3 / 0.8])
    np.testing.assert_allclose(filter_logits(logits, top_p=0.5), [0.0, 1.0, 0.0])
    hot = filter_logits(logits, temperature=0.5)
    assert hot[1] > 0.5 and hot.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("prompt, new, kwargs", [
    ([], 1, {}),
    ([1], 0, {}),
    ([1], 1, {"top_k": -1}),
    ([1], 1, {"top_p": 0.0}),
    ([1], 1, {"top_p": 1.5}),
    ([1], 1, {"temperature": 0.0}),
])
def test_bad_arguments(prompt, new, kwargs):
    with pytest.raises(ValueError):
        generate(None, prompt, new, seq_length=SEQ, **kwargs)


PROMPTS = [[3, 1, 4], [7], [2, 7, 1, 8, 2], [5, 5]]


def test_cached_batch_equals_the_window_path_row_by_row(lm):
    """Prompts of different lengths in one batch, greedy and with a repetition penalty."""
    generator = CachedGenerator(lm)
    for penalty in (1.0, 1.5):
        cached = generator.generate(PROMPTS, 3, repetition_penalty=penalty)
        window = [generate(lm, p, 3, seq_length=SEQ, repetition_penalty=penalty)
                  for p in PROMPTS]
        assert cached == window, penalty
    assert [len(ids) for ids in cached] == [3] * len(PROMPTS)


def test_a_reused_generator_ignores_what_its_caches_held(lm):
    """A second call of the same shape reuses the step cell and its caches unclear."""
    generator = CachedGenerator(lm)
    generator.generate(PROMPTS, 3)
    others = [[9, 9, 9, 9], [1, 2], [6], [4, 3, 2]]
    assert generator.generate(others, 3) == CachedGenerator(lm).generate(others, 3)
    assert len(generator.steps) == 1


def test_the_step_compiles_once_for_every_position(lm):
    """Each position's inputs are inputs of the compiled step, not constants of it: one
    graph for all the steps of a call and of the next (a graph per position made a GPT-2
    tiny step 850 ms instead of 2), and the model keeps its generator from call to call
    (`model-zoo generate`'s batches compiled each their own graphs)."""
    generate_ids(lm, [[3, 1]], 4)
    generate_ids(lm, [[5]], 6)
    (step,) = lm.cached_generator.steps.values()
    assert len(step.compile_cache) == 1


def test_prefilled_prompts_equal_the_window_path():
    """Prompts long enough for the one-pass prefill (16 positions here, then steps)."""
    ms.set_seed(1)
    config = GPT2Config(num_layers=2, hidden_size=32, num_heads=2, seq_length=48,
                        vocab_size=VOCAB, init_std=0.3)
    network = GPT2ForTraining(config)
    network.set_train(False)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (20, 33, 16)]
    cached = CachedGenerator(network.lm).generate(prompts, 5, repetition_penalty=1.3)
    assert cached == [generate(network.lm, p, 5, seq_length=48, repetition_penalty=1.3)
                      for p in prompts]


def test_cached_sampling_of_one_prompt_equals_the_window_path(lm):
    options = dict(greedy=False, top_k=5, top_p=0.9, temperature=0.8, seed=11)
    assert CachedGenerator(lm).generate([[4, 2]], 5, **options) == \
        [generate(lm, [4, 2], 5, seq_length=SEQ, **options)]


def test_each_row_stops_at_its_own_eos(lm):
    free = CachedGenerator(lm).generate(PROMPTS, 3)
    eos = free[0][1]          # row 0's second new token
    stopped = CachedGenerator(lm).generate(PROMPTS, 3, eos_id=eos)
    for row, ids in zip(free, stopped):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert ids == row[:cut]


def test_generate_ids_takes_the_window_path_past_the_positions(lm):
    long = [1, 2, 3, 4, 5, 6]
    assert generate_ids(lm, [long], 5) == [generate(lm, long, 5, seq_length=SEQ)]
    with pytest.raises(ValueError, match="take 11 positions, the model has 8"):
        CachedGenerator(lm).generate([long], 5)


def test_repetition_penalty_against_a_hand_count():
    scores = penalise_repetition([2.0, -1.0, 0.5, 3.0], [0, 1, 1], 2.0)
    np.testing.assert_allclose(scores, [1.0, -2.0, 0.5, 3.0])


def test_the_window_path_says_so_and_reports_its_progress(lm, capsys, monkeypatch):
    """More new tokens than positions take the uncached window: one note, then a progress
    line with throughput every PROGRESS_SECONDS (0 here: every token)."""
    from model_zoo.causal_lm import generate as generation
    monkeypatch.setattr(generation, "PROGRESS_SECONDS", 0.0)
    ids = generation.generate_ids(lm, [[1, 2, 3]], SEQ + 2)
    assert len(ids[0]) == SEQ + 2
    lines = capsys.readouterr().err.splitlines()
    assert "longer than the model's 8 positions" in lines[0]
    progress = [line for line in lines if line.startswith("generated ")]
    assert progress[0].startswith(f"generated 1/{SEQ + 2} tokens (")
    assert progress[-1].startswith(f"generated {SEQ + 1}/{SEQ + 2} tokens")
