"""Sampling against numpy references: penalties, filters, sampled frequencies, seeding, logprobs."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipage_jax.layers.sampler import (BAN_WIDTH, MIN_HISTORY_WIDTH, SamplingRow, SamplingTensors, apply_filters,
                                      apply_penalties, sample)
from zipage_jax.sampling_params import SamplingParams
from seeds import seeded_rng

sample_jit = jax.jit(sample)
penalties_jit = jax.jit(apply_penalties)
filters_jit = jax.jit(apply_filters)


# ---------------------------------------------------------------- numpy references

def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_penalize(logits, prompt, output, params, banned=()):
    """vLLM semantics: bans, repetition over prompt+output, then frequency and presence over output."""
    x = np.asarray(logits, np.float64).copy()
    x[list(banned)] = -np.inf
    seen = sorted(set(prompt) | set(output))
    p = params.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / p, x[seen] * p)
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.shape[0]).astype(np.float64)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def np_allowed(x, params, slack=0.0):
    """Tokens vLLM may sample from penalized logits x (temperature, min_p, top_k, top_p).

    slack > 0 loosens the min_p / top_p thresholds (a superset), slack < 0 tightens them (a subset),
    so float32-vs-float64 rounding at a boundary cannot make a test flaky.
    """
    x = np.asarray(x, np.float64) / params.temperature
    keep = np.isfinite(x)
    if params.min_p > 0:
        keep &= x >= x.max() + np.log(params.min_p) - slack
    if params.top_k > 0:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][min(params.top_k, x.size) - 1]
        keep &= x >= kth
    if params.top_p < 1.0:
        probs = np.exp(np.where(keep, x - x.max(), -np.inf))
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        kept = order[before < params.top_p + slack]
        mask = np.zeros_like(keep)
        mask[kept] = True
        mask[order[0]] = True
        keep &= mask
    return keep


def rows_for(params_list, rng, vocab, prompt_len=5, out_len=4):
    rows = []
    for i, p in enumerate(params_list):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        out = rng.integers(0, vocab, out_len).tolist()
        rows.append(SamplingRow(p, prompt, out, seed=int(rng.integers(0, 2**40)), step=len(out) + i))
    return rows


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("max_tokens", 0), ("n", 0),
    ("seed", 1.5), ("seed", "1"), ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("min_tokens", -1), ("logprobs", 21),
    ("ignore_eos", "yes"), ("kv_budget_pages", 0), ("skip_special_tokens", 1),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):  # the server reports the leading word as `param`
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_raises():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_keyword_raises_type_error():
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)


def test_params_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[7, np.int64(9)], top_k=-1, logprobs=True,
                       temperature=0, kv_budget_pages=3)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 9) and type(p.stop_token_ids[1]) is int
    assert p.top_k == 0 and p.logprobs == 0 and p.greedy and p.kv_budget_pages == 3
    q = SamplingParams(stop=["a", "b"], logprobs=False)
    assert q.stop == ("a", "b") and q.logprobs is None and not q.greedy and q.stop_token_ids == ()
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(q, top_p=0.0)


# ---------------------------------------------------------------- host builder

def test_from_rows_shapes_and_padding():
    rng = seeded_rng()
    plain = rows_for([SamplingParams(temperature=0.7, top_p=0.9)] * 3, rng, 50)
    t = SamplingTensors.from_rows(plain, 50, eos_token_ids=2, batch_size=8)
    assert t.history.shape == (8, 1) and t.banned_token_ids.shape == (8, BAN_WIDTH)  # one shape: no recompiles
    assert np.all(t.temperature[3:] == 0) and np.all(t.top_p[3:] == 1) and np.all(t.history == -1)
    penal = rows_for([SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5)],
                     rng, 50, prompt_len=6, out_len=3)
    t = SamplingTensors.from_rows(penal, 50, eos_token_ids=[2])
    assert t.history.shape == (2, MIN_HISTORY_WIDTH)  # 6 + 3 = 9: short histories share one width
    long = rows_for([SamplingParams(repetition_penalty=1.3)], rng, 50, prompt_len=MIN_HISTORY_WIDTH, out_len=3)
    assert SamplingTensors.from_rows(long, 50, eos_token_ids=[2]).history.shape == (1, 2 * MIN_HISTORY_WIDTH)
    many = [SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=list(range(10, 10 + BAN_WIDTH))), [1], [], 0, 0)]
    assert SamplingTensors.from_rows(many, 50, eos_token_ids=[2]).banned_token_ids.shape == (1, 2 * BAN_WIDTH)
    assert t.history_is_output[0].sum() == 3 and t.history_is_output[1].sum() == 3
    assert (t.history[1] >= 0).sum() == 3  # presence/frequency only need outputs
    with pytest.raises(ValueError, match="history_width"):
        SamplingTensors.from_rows(penal, 50, eos_token_ids=[2], history_width=8)
    with pytest.raises(ValueError, match="batch_size"):
        SamplingTensors.from_rows(penal, 50, eos_token_ids=[2], batch_size=1)


def test_greedy_rows_drop_filters():
    t = SamplingTensors.from_rows([SamplingRow(SamplingParams(temperature=0, top_k=3, top_p=0.5), [1], [], 0, 0)],
                                  10, eos_token_ids=[0])
    assert t.temperature[0] == 0 and t.top_k[0] == 0 and t.top_p[0] == 1


# ---------------------------------------------------------------- device math

def test_greedy_is_argmax_and_top_k_1_is_greedy():
    rng = seeded_rng()
    b, v = 6, 97
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    greedy = SamplingTensors.from_rows(rows_for([SamplingParams(temperature=0)] * b, rng, v, out_len=0), v, [0])
    top1 = SamplingTensors.from_rows(rows_for([SamplingParams(temperature=1.3, top_k=1)] * b, rng, v, out_len=0),
                                     v, [0])
    tok_g, _ = sample_jit(logits, greedy)
    tok_1, _ = sample_jit(logits, top1)
    np.testing.assert_array_equal(np.asarray(tok_g), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(tok_1), logits.argmax(-1))


def test_logprobs_equal_raw_log_softmax():
    rng = seeded_rng()
    b, v = 5, 64
    logits = rng.standard_normal((8, v)).astype(np.float32) * 4
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.5, presence_penalty=1.0), SamplingParams(),
              SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(top_k=5, min_p=0.1),
              SamplingParams(top_p=0.5)]
    tok, lp = sample_jit(logits, SamplingTensors.from_rows(rows_for(params, rng, v), v, [0], batch_size=8))
    tok, lp = np.asarray(tok), np.asarray(lp)
    np.testing.assert_allclose(lp, np_log_softmax(logits)[np.arange(8), tok], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logits"):
        sample(logits[:b], SamplingTensors.from_rows(rows_for(params, rng, v), v, [0], batch_size=8))


def test_penalties_match_numpy():
    rng = seeded_rng()
    b, v = 6, 40
    logits = rng.standard_normal((b, v)).astype(np.float32) * 2
    params = [SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2.0)),
                             presence_penalty=float(rng.uniform(-2, 2)),
                             frequency_penalty=float(rng.uniform(-2, 2)),
                             max_tokens=32, min_tokens=int(i % 2) * 20, stop_token_ids=[5, 6][: i % 3])
              for i in range(b - 1)] + [SamplingParams()]
    # Small vocab + long histories: plenty of repeated tokens within and across prompt / output.
    rows = rows_for(params, rng, v, prompt_len=9, out_len=12)
    t = SamplingTensors.from_rows(rows, v, eos_token_ids=[1, 3])
    got = np.asarray(penalties_jit(logits, t))
    for i, r in enumerate(rows):
        p = r.params
        banned = set(p.stop_token_ids) | {1, 3} if r.step < p.min_tokens else set()
        want = np_penalize(logits[i], r.prompt_token_ids, r.output_token_ids, p, banned)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[-1], logits[-1])
    greedy_rows = [r._replace(params=dataclasses.replace(r.params, temperature=0)) for r in rows]
    tok, _ = sample_jit(logits, SamplingTensors.from_rows(greedy_rows, v, eos_token_ids=[1, 3]))
    np.testing.assert_array_equal(np.asarray(tok), got.argmax(-1))


def test_min_tokens_bans_eos_and_stop_ids():
    v = 16
    logits = np.zeros((4, v), np.float32)
    logits[:, 3] = 50.0  # EOS
    logits[:, 7] = 40.0  # a stop token id
    logits[:, 9] = 30.0
    p = SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[7])
    rows = [SamplingRow(p, [1], [], 0, 0), SamplingRow(dataclasses.replace(p, ignore_eos=True), [1], [], 0, 4),
            SamplingRow(p, [1], [], 0, 5), SamplingRow(dataclasses.replace(p, temperature=1.0), [1], [], 0, 2)]
    tok, _ = sample_jit(logits, SamplingTensors.from_rows(rows, v, eos_token_ids=[3]))
    assert np.asarray(tok).tolist() == [9, 3, 3, 9]


def chi_square(counts, probs):
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def unambiguous_logits(rng, v, params, scale):
    """Random logits whose allowed set does not sit on a float rounding boundary."""
    while True:
        x = rng.standard_normal(v) * scale
        if np.array_equal(np_allowed(x, params, 1e-4), np_allowed(x, params, -1e-4)):
            return x.astype(np.float32)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.6, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95),
])
def test_sampled_frequencies_match_softmax(params):
    rng = seeded_rng()
    v, n = 12, 20000
    x = unambiguous_logits(rng, v, params, scale=1.5)
    allowed = np_allowed(x, params)
    z = np.where(allowed, x.astype(np.float64) / params.temperature, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    rows = [SamplingRow(params, [0], [], seed=s, step=3) for s in range(n)]
    tok, _ = sample_jit(np.broadcast_to(x, (n, v)), SamplingTensors.from_rows(rows, v, [0]))
    counts = np.bincount(np.asarray(tok), minlength=v).astype(np.float64)
    assert counts[~allowed].sum() == 0
    stat, dof = chi_square(counts, probs)
    # Mean dof, sd sqrt(2 dof): the bound sits ~8 sd out (never hit by chance), while a wrong
    # temperature or truncation gives a statistic in the hundreds or more at this sample count.
    assert stat < dof + 8 * np.sqrt(2 * dof) + 10, (stat, dof)


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=7, temperature=0.9), SamplingParams(top_p=0.6, temperature=1.2),
    SamplingParams(min_p=0.2), SamplingParams(top_k=20, top_p=0.9, min_p=0.02, temperature=0.6),
])
def test_filters_never_leave_allowed_set(params):
    rng = seeded_rng()
    b, v, draws = 8, 200, 64
    logits = (rng.standard_normal((b, v)) * rng.uniform(0.5, 4, (b, 1))).astype(np.float32)
    rows = [SamplingRow(params, [0], [], seed=int(rng.integers(2**31)), step=0) for _ in range(b)]
    t = SamplingTensors.from_rows(rows, v, [0])
    kept = np.isfinite(np.asarray(filters_jit(logits, t)))
    for i in range(b):
        assert np.all(kept[i] <= np_allowed(logits[i], params, 1e-4))
        assert np.all(kept[i] >= np_allowed(logits[i], params, -1e-4))
    for step in range(draws // 8):  # different steps give fresh draws
        t = dataclasses.replace(t, steps=np.full(b, step, np.int32))
        tok = np.asarray(sample_jit(logits, t)[0])
        for i in range(b):
            assert np_allowed(logits[i], params, 1e-4)[tok[i]]


def test_seeded_samples_independent_of_row_and_batch():
    rng = seeded_rng()
    v = 128
    x = rng.standard_normal(v).astype(np.float32)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0.5, repetition_penalty=1.2), SamplingParams(temperature=0),
              SamplingParams(top_k=3, presence_penalty=0.3), SamplingParams(min_p=0.1)]
    seqs = {}
    for layout, (b, row, bucket) in {"small": (3, 0, None), "large": (6, 4, 16)}.items():
        tokens = []
        for step in range(16):  # other rows' histories switch W between 8 and 16
            rows = rows_for([others[(j + step) % 4] for j in range(b)], rng, v, out_len=2 + 6 * (step % 2))
            rows[row] = SamplingRow(target, [1, 2, 3], [], seed=1234, step=step)
            logits = rng.standard_normal((bucket or b, v)).astype(np.float32)
            logits[row] = x
            tok, lp = sample_jit(logits, SamplingTensors.from_rows(rows, v, [0], batch_size=bucket))
            tokens.append(int(tok[row]))
        seqs[layout] = tokens
    assert seqs["small"] == seqs["large"]
    assert len(set(seqs["small"])) > 3  # the steps really draw different samples
    other_seed = SamplingTensors.from_rows([SamplingRow(target, [1], [], seed=99, step=s) for s in range(16)], v, [0])
    assert np.asarray(sample_jit(np.broadcast_to(x, (16, v)), other_seed)[0]).tolist() != seqs["small"]


# ---------------------------------------------------------------- property test

params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_p=st.floats(0.05, 1.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 30]),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    stop_token_ids=st.lists(st.integers(0, 23), max_size=3),
    max_tokens=st.just(64),
    min_tokens=st.integers(0, 8),
    ignore_eos=st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(params=st.lists(params_strategy, min_size=1, max_size=4), data=st.data())
def test_random_valid_params(params, data):
    v = 24
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = [SamplingRow(p, rng.integers(0, v, rng.integers(1, 7)).tolist(),
                        rng.integers(0, v, rng.integers(0, 7)).tolist(), seed=int(rng.integers(2**63)),
                        step=int(rng.integers(0, 10))) for p in params]
    logits = (rng.standard_normal((4, v)) * 3).astype(np.float32)
    tok, lp = sample_jit(logits, SamplingTensors.from_rows(rows, v, [2], history_width=16, batch_size=4))
    tok, lp = np.asarray(tok), np.asarray(lp)
    np.testing.assert_allclose(lp, np_log_softmax(logits)[np.arange(4), tok], rtol=1e-5, atol=1e-5)
    for i, r in enumerate(rows):
        p = r.params
        banned = (set(p.stop_token_ids) | (set() if p.ignore_eos else {2})) if r.step < p.min_tokens else set()
        x = np_penalize(logits[i], r.prompt_token_ids, r.output_token_ids, p, banned)
        assert tok[i] not in banned
        if p.greedy:
            assert tok[i] == x.argmax()
        else:
            assert np_allowed(x, p, 1e-4)[tok[i]]
