"""KV dropout masks (tasks.kv_dropout): per-(layer, KV head) random subsets with sinks and a recent window kept,
against a plain loop, and their use as forward_dense's per-head mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax.models import ModelConfig, forward_dense
from zipage_jax.models.weights import init_random_params
from zipage_jax.tasks.kv_dropout import (BUDGET_RANGE, SINKS, WINDOW_RANGE, kv_dropout_mask, sample_kv_dropout)
from seeds import fresh_seed, seeded_rng


def test_rows_keep_sinks_window_and_a_budget_share_per_head_independently():
    seed = fresh_seed()
    window, keep, budget = sample_kv_dropout(64, 400, 3, 2, np.random.default_rng(seed), 0.75)
    again = sample_kv_dropout(64, 400, 3, 2, np.random.default_rng(seed), 0.75)
    assert all(np.array_equal(x, y) for x, y in zip((window, keep, budget), again))
    evicted = budget < 1
    assert 0 < evicted.sum() < 64
    assert np.all(keep[~evicted]) and np.all(window[~evicted] == 400)
    assert np.all((window[evicted] >= WINDOW_RANGE[0]) & (window[evicted] <= WINDOW_RANGE[1]))
    assert np.all((budget[evicted] >= BUDGET_RANGE[0]) & (budget[evicted] <= BUDGET_RANGE[1]))
    assert np.all(keep[evicted][..., :SINKS])
    old = keep[evicted][..., SINKS:]  # [rows, L, Hkv, T - SINKS]
    shares = old.mean(axis=(1, 2, 3))
    np.testing.assert_allclose(shares, budget[evicted], atol=0.06)  # 2376 draws a row: 6 sigma or more
    heads = old.reshape(len(old), 6, -1)
    assert all(len({h.tobytes() for h in row}) == 6 for row in heads)  # every (layer, head) its own subset
    with pytest.raises(ValueError, match="evict_fraction"):
        sample_kv_dropout(1, 8, 1, 1, np.random.default_rng(0), 1.5)


def test_mask_matches_a_loop():
    rng = seeded_rng()
    window = rng.integers(1, 6, size=2)
    keep = rng.random((2, 3, 2, 9)) < 0.3
    mask = np.asarray(kv_dropout_mask(jnp.asarray(window), jnp.asarray(keep)))
    assert mask.shape == (3, 2, 2, 9, 9)
    for b, layer, h, t, s in np.ndindex(2, 3, 2, 9, 9):
        assert mask[layer, b, h, t, s] == (s <= t and (t - s < window[b] or keep[b, layer, h, s]))


def test_forward_dense_applies_each_layer_and_head_its_own_mask():
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, qk_norm=True)
    params = init_random_params(cfg, jax.random.key(fresh_seed()), jnp.float32)
    rng = seeded_rng()
    tokens = jnp.asarray(rng.integers(1, 64, size=(2, 10)), jnp.int32)
    row_mask = jnp.asarray(np.tril(rng.random((2, 10, 10)) < 0.6) | np.eye(10, dtype=bool))
    per_head = jnp.broadcast_to(row_mask[None, :, None], (2, 2, 2, 10, 10))
    changed = per_head.at[1, :, 1].set(jnp.tril(jnp.ones((10, 10), bool)))  # layer 1, KV head 1: full context

    @jax.jit
    def run(p, t):
        return forward_dense(p, cfg, t, attention_mask=row_mask), forward_dense(p, cfg, t, attention_mask=per_head), \
            forward_dense(p, cfg, t, attention_mask=changed)

    rows, heads, other = run(params, tokens)
    np.testing.assert_allclose(np.asarray(heads), np.asarray(rows), atol=1e-5)
    assert not np.allclose(np.asarray(other), np.asarray(rows), atol=1e-4)
    with pytest.raises(ValueError, match="attention_mask"):
        forward_dense(params, cfg, tokens, attention_mask=per_head[:, :, :1])
