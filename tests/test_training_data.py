"""Training rows of the tiny model: loss weights and visibility masks against plain numpy constructions."""

import numpy as np
import pytest

from zipage_jax.tasks import interleaved_sums, sample_problems
from zipage_jax.tasks.tokenizer import PAD_ID, encode_chat
from zipage_jax.tasks.training_data import (DIGIT_IDS, SEQ_LEN, WINDOW_RANGE, conclusion_targets, encode_batch,
                                            recalled_mask, sample_visibility, visibility_mask)
from seeds import fresh_seed, seeded_rng


def test_loss_weights_cover_the_assistant_and_weight_the_conclusion():
    """The answer weight covers what is computed once from the finished scratchpad: the boxed answer, and for
    interleaved sums the recall and `Sum:` lines before it (at weight 1 the sum stayed at chance in the first run)."""
    problems = [*sample_problems(2, seed=fresh_seed(), split="train"),
                *interleaved_sums.sample_problems(2, seed=fresh_seed(), split="train")]
    tokens, weights = encode_batch(problems, answer_weight=7.5)
    conclusion = conclusion_targets(problems)
    assert tokens.shape == (4, SEQ_LEN) and weights.shape == conclusion.shape == (4, SEQ_LEN - 1)
    for row, p in enumerate(problems):
        ids = encode_chat(p.question, p.solution())
        assert tokens[row, : len(ids)].tolist() == ids and (tokens[row, len(ids):] == PAD_ID).all()
        text = p.solution() + "#"  # '#' stands for the closing <|im_end|>
        first = len(text) - len("\n".join(text.split("\n")[-3:])) if row >= 2 else text.index("\\boxed")
        prompt = len(encode_chat(p.question))
        expected = np.zeros(SEQ_LEN - 1)
        for i, ch in enumerate(text):  # target position prompt + i is predicted at prompt + i - 1
            expected[prompt + i - 1] = 7.5 if i >= first else 1.0
        np.testing.assert_array_equal(weights[row], expected)
        np.testing.assert_array_equal(conclusion[row], (expected == 7.5) & (np.arange(SEQ_LEN - 1) < len(ids) - 2))
    with pytest.raises(ValueError, match="answer_weight"):
        encode_batch(problems, answer_weight=0.0)


def test_visibility_mask_matches_a_loop():
    rng = seeded_rng()
    window = rng.integers(1, 12, size=3)
    keep = rng.random((3, 10)) < 0.3
    expected = np.zeros((3, 10, 10), bool)
    for b in range(3):
        for q in range(10):
            for k in range(q + 1):
                expected[b, q, k] = q - k < window[b] or keep[b, k]
    np.testing.assert_array_equal(np.asarray(visibility_mask(window, keep)), expected)


def test_eviction_rows_keep_the_operands_a_window_and_nothing_in_full_rows_is_hidden():
    rng = seeded_rng()
    problems = sample_problems(40, seed=int(rng.integers(1 << 30)), split="train")
    window, keep = sample_visibility(problems, rng, evict_fraction=0.5)
    evicted = window < SEQ_LEN
    assert 0 < evicted.sum() < len(problems)  # 40 rows at p = 0.5: both kinds present (fails with p ~ 2e-12)
    assert keep[~evicted].all()
    assert ((window[evicted] >= WINDOW_RANGE[0]) & (window[evicted] <= WINDOW_RANGE[1])).all()
    for row in np.flatnonzero(evicted):
        prompt = np.array(encode_chat(problems[row].question))
        digits = np.isin(prompt, DIGIT_IDS)
        assert digits.sum() == 7 and keep[row, : len(prompt)][digits].all()  # 5 digits of A, 2 of B
    assert not keep[evicted, 64:].all()  # some older token is hidden somewhere
    with pytest.raises(ValueError, match="evict_fraction"):
        sample_visibility(problems, rng, evict_fraction=1.5)


def test_eviction_rows_of_interleaved_problems_keep_the_lines_read_after_a_gap():
    rng = seeded_rng()
    seed = int(rng.integers(1 << 30))
    problems = interleaved_sums.sample_problems(6, seed=seed, split="train")
    window, keep = sample_visibility(problems, rng, evict_fraction=1.0)
    for row, p in enumerate(problems):
        ids = encode_chat(p.question, p.solution())
        start = len(encode_chat(p.question))
        lines = p.solution().split("\n")
        recalled = recalled_mask(p)
        for index, line in enumerate(lines):
            begin = start + sum(len(x) + 1 for x in lines[:index])
            span = recalled[begin:begin + len(line) + 1]
            assert span.all() == (index in p.recalled_lines()) and (span.all() or not span.any()), seed
        assert recalled.sum() == sum(len(lines[i]) + 1 for i in p.recalled_lines())
        assert keep[row][recalled].all() and not recalled[len(ids):].any()
    assert not recalled_mask(sample_problems(1, seed=0, split="train")[0]).any()
