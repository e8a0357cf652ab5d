"""The query-free "triattention" scores (compression.trig_scores) against an independent numpy oracle of the paper's
formula (pre-RoPE keys at known positions, the trigonometric series summed offset by offset), and the query
centres' calibration (compression.query_centres, models.forward_dense's pre-RoPE queries)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax.compression import query_centres, trig_scores
from zipage_jax.compression.step import CompressionBatch, slot_scores
from zipage_jax.config import ScoringConfig
from zipage_jax.layers.attention import resolve_backend
from zipage_jax.models import ModelConfig, forward_dense
from zipage_jax.models.rope import inverse_frequencies
from zipage_jax.models.weights import init_random_params
from seeds import fresh_seed, seeded_rng

HKV, GROUP, D = 2, 3, 8


def small_config(**changes):
    fields = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=HKV * GROUP, num_kv_heads=HKV, head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0,
                  qk_norm=True)
    return ModelConfig(**{**fields, **changes})


def oracle(k_pre, key_pos, mean, norm, inv_freq, query_pos):
    """TriAttention's score of pre-RoPE keys ``k_pre [Hkv, N, D]`` at ``key_pos [N]`` for one layer, the sum over
    offsets written out: per query head, mean_d sum_f |mu_f||k_f| cos((p + d - n) w_f + phi_f) plus
    sum_f (E|q_f| - |mu_f|) |k_f|, phi_f = arg(mu_f conj(k_f)); max over each KV head's query group."""
    half = D // 2
    k = k_pre[..., :half] + 1j * k_pre[..., half:]  # [Hkv, N, F]
    mu = mean[..., :half] + 1j * mean[..., half:]  # [Hq, F]
    scores = np.empty((mean.shape[0], k_pre.shape[1]))
    for h in range(mean.shape[0]):
        kh = k[h // GROUP]
        amp, phi = np.abs(mu[h]) * np.abs(kh), np.angle(mu[h] * np.conj(kh))
        trig = np.mean([np.sum(amp * np.cos((query_pos + d - key_pos)[:, None] * inv_freq + phi), axis=1)
                        for d in trig_scores.OFFSETS], axis=0)
        scores[h] = trig + np.sum((norm[h] - np.abs(mu[h])) * np.abs(kh), axis=1)
    return scores.reshape(HKV, GROUP, -1).max(axis=1)


def rotate(x, positions, inv_freq):
    """RoPE (rotate-half pairing) of ``x [..., N, D]`` at ``positions [N]``, in numpy."""
    angles = positions[:, None] * inv_freq
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    return x * cos + np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1) * sin


def test_scores_equal_the_papers_formula_from_post_rope_keys_alone():
    """Compacted keys (out of position order, gaps) at a late position: the folded post-RoPE form equals the
    offset-by-offset sum over pre-RoPE keys and their positions, per row of a batch."""
    rng = seeded_rng()
    inv_freq = inverse_frequencies(D, 10000.0, None)
    mean = rng.normal(size=(HKV * GROUP, D)) + 1.0  # concentrated off zero, as the paper observes
    norm = np.abs(mean[:, : D // 2] + 1j * mean[:, D // 2:]) + rng.uniform(0.1, 1.0, size=(HKV * GROUP, D // 2))
    rows, n = 3, 40
    positions = rng.integers(200, 3000, size=rows)
    got = []
    for b in range(rows):
        key_pos = np.sort(rng.choice(positions[b], size=n, replace=False)).astype(np.float64)
        k_pre = rng.normal(size=(HKV, n, D))
        got.append((oracle(k_pre, key_pos, mean, norm, inv_freq, positions[b]), rotate(k_pre, key_pos, inv_freq)))
    scores = trig_scores.trig_scores(jnp.asarray(np.stack([g[1] for g in got]), jnp.float32),
                                     jnp.asarray(mean, jnp.float32), jnp.asarray(norm, jnp.float32),
                                     jnp.asarray(inv_freq), jnp.asarray(positions))
    want = np.stack([g[0] for g in got])
    np.testing.assert_allclose(np.asarray(scores), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_compression_scores_rank_by_the_oracle_and_protect_window_and_sinks():
    """``slot_scores`` of the "triattention" policy over a paged pool: the oracle's values on the live unprotected
    slots, +inf on the window and sinks, -inf past the live range."""
    rng = seeded_rng()
    layers, pages, page, width = 2, 12, 4, 3
    inv_freq = inverse_frequencies(D, 10000.0, None)
    k_pre = rng.normal(size=(layers, pages, HKV, page, D))
    pos = np.arange(width * page, dtype=np.float64)
    table = np.array([[5, 2, 9, 0]])  # three live pages, one padding
    k_pool = np.zeros_like(k_pre)
    for i, p in enumerate(table[0, :width]):
        k_pool[:, p] = rotate(k_pre[:, p], pos[i * page:(i + 1) * page], inv_freq)
    centres = query_centres.QueryCentres(jnp.asarray(rng.normal(size=(layers, HKV * GROUP, D)) + 0.5, jnp.float32),
                                         jnp.asarray(rng.uniform(1, 2, size=(layers, HKV * GROUP, D // 2)),
                                                     jnp.float32), jnp.asarray(inv_freq))
    batch = CompressionBatch(jnp.asarray(table, jnp.int32), jnp.asarray([width], jnp.int32),
                             jnp.asarray([[5, 2]], jnp.int32), jnp.zeros(1, jnp.int32),
                             jnp.asarray([width * page], jnp.int32), jnp.zeros(1, bool), jnp.ones(1, bool))
    cfg = ScoringConfig(eviction_policy="triattention", window=3, sink_tokens=1)
    placeholder = jnp.zeros((1, 1, 1, 1), jnp.float32)
    scores = np.asarray(slot_scores(jnp.asarray(k_pool, jnp.float32), placeholder, placeholder[None], batch, cfg,
                                    D ** -0.5, resolve_backend("reference"), centres))[0]
    for layer in range(layers):
        keys_pre = np.concatenate([k_pre[layer, p] for p in table[0, :width]], axis=1)  # [Hkv, N, D]
        want = oracle(keys_pre, pos, np.asarray(centres.mean[layer]), np.asarray(centres.norm[layer]), inv_freq,
                      width * page - 1)
        live = width * page
        np.testing.assert_allclose(scores[layer, :, 1:live - 3], want[:, 1:live - 3], rtol=2e-3,
                                   atol=2e-3 * np.abs(want).max())
        assert np.all(scores[layer, :, :1] == np.inf) and np.all(scores[layer, :, live - 3:live] == np.inf)
        assert np.all(scores[layer, :, live:] == -np.inf)
    with pytest.raises(ValueError, match="query_centres"):
        slot_scores(jnp.asarray(k_pool, jnp.float32), placeholder, placeholder[None], batch, cfg, D ** -0.5,
                    resolve_backend("reference"), None)


def test_centres_are_the_mean_and_band_norms_of_pre_rope_queries(tmp_path):
    rng = seeded_rng()
    queries = rng.normal(size=(2, 3, 5, 4, D)).astype(np.float32) + 0.3
    valid = rng.random((3, 5)) < 0.7
    valid[0, 0] = True
    centres = query_centres.centres_from_queries(jnp.asarray(queries), valid, np.ones(D // 2))
    picked = queries[:, valid]  # [L, tokens, Hq, D]
    np.testing.assert_allclose(np.asarray(centres.mean), picked.mean(axis=1), rtol=1e-5, atol=1e-6)
    band = np.abs(picked[..., : D // 2] + 1j * picked[..., D // 2:]).mean(axis=1)
    np.testing.assert_allclose(np.asarray(centres.norm), band, rtol=1e-5, atol=1e-6)
    cfg = small_config(num_heads=4)
    path = query_centres.save(tmp_path, centres)
    assert path.name == query_centres.CENTRES_FILE
    loaded = query_centres.load(tmp_path, cfg)
    np.testing.assert_array_equal(loaded.mean, np.asarray(centres.mean))
    with pytest.raises(ValueError, match="eviction_policy"):
        query_centres.load(tmp_path / "nowhere", cfg)
    with pytest.raises(ValueError, match="eviction_policy"):
        query_centres.load(tmp_path, small_config(num_heads=6))


def test_forward_dense_returns_pre_rope_queries():
    """Pre-RoPE queries do not move with the positions (layer 0 sees the tokens only; RoPE is relative); the
    logits are those of the plain forward; calibration averages them."""
    cfg = small_config(num_heads=4)
    params = init_random_params(cfg, jax.random.key(fresh_seed()), jnp.float32)
    tokens = jnp.asarray(seeded_rng().integers(1, 64, size=(2, 9)), jnp.int32)

    @jax.jit
    def run(params, tokens):
        logits, queries = forward_dense(params, cfg, tokens, return_queries=True)
        shifted = forward_dense(params, cfg, tokens, positions=jnp.arange(9) + 7, return_queries=True)[1]
        return logits, queries, shifted, forward_dense(params, cfg, tokens)

    logits, queries, shifted, plain = run(params, tokens)
    assert queries.shape == (2, 2, 9, 4, D)
    np.testing.assert_allclose(np.asarray(queries), np.asarray(shifted), atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-6)
    centres = query_centres.calibrate(params, cfg, [(tokens, np.ones((2, 9), bool))])
    np.testing.assert_allclose(np.asarray(centres.mean), np.asarray(queries).mean(axis=(1, 2)), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(centres.inv_freq), inverse_frequencies(D, cfg.rope_theta, None))
