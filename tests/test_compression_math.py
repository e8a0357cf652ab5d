"""Compressed PagedAttention device math against a dense numpy implementation written from the scoring rules
in docs/ARCHITECTURE.md.

The oracle works per request, layer and KV head on plain arrays (loops, float64); the device code works on
the paged pools. Fresh random inputs every run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import paged_decode_ref
from zipage_jax.compression.step import CompressionBatch, compress, layer_group, slot_scores
from zipage_jax.config import ScoringConfig
from zipage_jax.compression.selection import select_slots
from zipage_jax.layers.attention import REFERENCE
from seeds import seeded_rng

LAYERS, PAGE, DIM, WINDOW, BUDGET = 2, 8, 16, 4, 3  # S = 8 slots per page, W = 4, M = 3 kept pages
SCALE = DIM ** -0.5


# ------------------------------------------------ numpy oracle (docs/ARCHITECTURE.md, Compression: scores)

def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_redundancy(keys, page, cfg):
    """R over the live slots of one (layer, head): ``keys [n, D]``."""
    n = keys.shape[0]
    unit = keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-6)
    groups = [range(p, p + page) for p in range(0, n, page)] if cfg.redundancy == "lightning" else [range(n)]
    raw = np.zeros(n)
    for group in groups:
        idx = np.array(group)
        sim = unit[idx] @ unit[idx].T
        np.fill_diagonal(sim, 0.0)
        for col in range(len(idx)):
            above = np.nonzero(sim[:, col] > cfg.similarity_threshold)[0]
            if len(above):
                sim[above.max(), col] = 0.0
        raw[idx] = sim.sum(axis=1)
    return np_softmax(raw / (cfg.redundancy_temperature * len(groups[0])))


def np_request_scores(keys, queries, history, compressed_before, cfg, page):
    """One request: ``keys [L, Hkv, n, D]``, window queries ``[L, W, Hq, D]`` (in order), history ``[L, Hkv, n]``.

    Returns (final score, G), each ``[L, Hkv, n]``.
    """
    layers, hkv, n, _ = keys.shape
    w_len, hq = queries.shape[1], queries.shape[2]
    group = hq // hkv
    final, g_out = np.zeros((layers, hkv, n)), np.zeros((layers, hkv, n))
    for layer in range(layers):
        for h in range(hkv):
            if cfg.eviction_policy == "window":
                score = np.arange(n, dtype=np.float64)
            else:
                attn = np.zeros(n)
                for w in range(w_len):
                    slot = n - w_len + w
                    best = np.zeros(n)
                    for g in range(group):
                        probs = np_softmax(keys[layer, h, :slot + 1] @ queries[layer, w, h * group + g] * SCALE)
                        best[:slot + 1] = np.maximum(best[:slot + 1], probs)
                    attn += best / w_len
                glob = attn.copy()
                if cfg.global_score and compressed_before:
                    for t in range(n - page):  # the last page is fresh
                        glob[t] = max(attn[t], cfg.decay * history[layer, h, t])
                g_out[layer, h] = glob
                score = glob.copy()
                if cfg.pooling and not (cfg.pooling_first_only and compressed_before):
                    lo, hi = (cfg.pooling_width - 1) // 2, cfg.pooling_width // 2
                    score = np.array([glob[max(0, t - lo):min(n, t + hi + 1)].max() for t in range(n)])
                if cfg.redundancy != "off":
                    red = np_redundancy(keys[layer, h], page, cfg)
                    score = (1 - cfg.redundancy_weight) * score - cfg.redundancy_weight * red
            score[n - cfg.window:] = np.inf
            score[:cfg.sink_tokens] = np.inf
            final[layer, h] = score
    return final, g_out


def np_top_k(scores, keep):
    """Kept slots of one (layer, head), ascending; ties go to the earlier slot."""
    return np.sort(np.argsort(-scores, kind="stable")[:keep])


# ---------------------------------------------------------------- random paged problems

def slot_values(cache, layer, table, n):
    """``cache [L, pages, Hkv, S, ...]`` at slots 0..n-1 of ``table`` → ``[Hkv, n, ...]``."""
    return np.stack([cache[layer, table[i // PAGE], :, i % PAGE] for i in range(n)], axis=1)


def window_queries(query_cache, slot, logical_len):
    ring = [(logical_len - WINDOW + w) % WINDOW for w in range(WINDOW)]
    return query_cache[:, slot, ring]  # [L, W, Hq, D]


def make_problem(rng, hkv, group, rows, padding, max_src=5):
    """Pools, caches and a batch for ``rows`` requests plus ``padding`` padding rows.

    Requests compressed before hold exactly M+1 pages and compact in place; first compressions hold
    M+1..max_src pages and half of them write to fresh (copy-on-write) pages.
    """
    hq = hkv * group
    num_pages = 1 + rows * (max_src + BUDGET) + 4
    k_pool = rng.standard_normal((LAYERS, num_pages, hkv, PAGE, DIM)).astype(np.float32)
    v_pool = rng.standard_normal((LAYERS, num_pages, hkv, PAGE, DIM)).astype(np.float32)
    # near-duplicate keys so the redundancy threshold matters
    k_pool[:, :, :, 1::2] = k_pool[:, :, :, 0::2] + 0.4 * rng.standard_normal(k_pool[:, :, :, 1::2].shape)
    score_cache = rng.uniform(0.0, 0.15, (LAYERS, num_pages, hkv, PAGE)).astype(np.float32)
    query_cache = rng.standard_normal((LAYERS, rows + padding + 1, WINDOW, hq, DIM)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    total = rows + padding
    src = np.zeros((total, max_src), np.int32)
    dst = np.zeros((total, BUDGET), np.int32)
    num_src = np.zeros(total, np.int32)
    logical = np.zeros(total, np.int32)
    before = np.zeros(total, bool)
    query_rows = rng.permutation(query_cache.shape[1])[:total].astype(np.int32)
    for b in range(rows):
        before[b] = rng.random() < 0.5
        num_src[b] = BUDGET + 1 if before[b] else rng.integers(BUDGET + 1, max_src + 1)
        src[b, :num_src[b]] = [free.pop() for _ in range(num_src[b])]
        copy_on_write = not before[b] and rng.random() < 0.5
        dst[b] = [free.pop() for _ in range(BUDGET)] if copy_on_write else src[b, :BUDGET]
        logical[b] = num_src[b] * PAGE + (rng.integers(1, 4) * PAGE if before[b] else 0) + rng.integers(0, 3) * WINDOW
    for b in range(rows, total):  # padding rows pointing at real pages: they must still change nothing
        src[b], dst[b], num_src[b], logical[b] = src[0], src[0, :BUDGET], num_src[0], logical[0]
    order = rng.permutation(total)  # padding rows anywhere in the bucket
    batch = dict(src_tables=src[order], num_src_pages=num_src[order], dst_tables=dst[order],
                query_rows=query_rows[order], logical_lens=logical[order], compressed_before=before[order],
                valid=(np.arange(total) < rows)[order])
    return k_pool, v_pool, score_cache, query_cache, batch


def device_batch(batch):
    return CompressionBatch(**{name: jnp.asarray(value) for name, value in batch.items()})


def oracle_scores(k_pool, score_cache, query_cache, batch, cfg):
    """Dense numpy scores and G ``[B, L, Hkv, N]`` of a paged problem (padding -inf / 0)."""
    total, max_src = batch["src_tables"].shape
    hkv = k_pool.shape[2]
    final = np.full((total, LAYERS, hkv, max_src * PAGE), -np.inf)
    glob = np.zeros_like(final)
    for b in np.nonzero(batch["valid"])[0]:
        n, table = batch["num_src_pages"][b] * PAGE, batch["src_tables"][b]
        keys = np.stack([slot_values(k_pool, layer, table, n) for layer in range(LAYERS)]).astype(np.float64)
        history = np.stack([slot_values(score_cache, layer, table, n) for layer in range(LAYERS)])
        queries = window_queries(query_cache, batch["query_rows"][b], batch["logical_lens"][b]).astype(np.float64)
        final[b, :, :, :n], glob[b, :, :, :n] = np_request_scores(
            keys, queries, history, batch["compressed_before"][b], cfg, PAGE)
    return final, glob


@functools.lru_cache(maxsize=None)
def jitted_scores(cfg):
    return jax.jit(functools.partial(slot_scores, cfg=cfg, sm_scale=SCALE, backend=REFERENCE))


@functools.lru_cache(maxsize=None)
def jitted_compress(cfg, max_pages=None):
    """``max_pages``: None compresses layer by layer; ALL_LAYERS lets every layer go in one group."""
    return jax.jit(functools.partial(compress, cfg=cfg, sm_scale=SCALE, backend=REFERENCE, max_pages=max_pages),
                   donate_argnums=(0, 1, 2))


ALL_LAYERS = 10 ** 6


def device_scores(k_pool, score_cache, query_cache, batch, cfg):
    return np.asarray(jitted_scores(cfg)(jnp.asarray(k_pool), jnp.asarray(score_cache), jnp.asarray(query_cache),
                                         device_batch(batch)))


def assert_scores_close(got, want):
    assert np.array_equal(np.isposinf(got), np.isposinf(want))
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-4, atol=2e-6)


# ---------------------------------------------------------------- tests

DEFAULT = ScoringConfig(window=WINDOW)
SCORING_CASES = [
    # (cfg, group, rows, padding)
    (DEFAULT, 4, 4, 1),
    (DEFAULT, 1, 3, 0),
    (ScoringConfig(window=WINDOW, global_score=False, pooling=False, redundancy="off"), 4, 3, 1),
    (ScoringConfig(window=WINDOW, global_score=True, pooling=False, redundancy="off", decay=0.9), 1, 4, 2),
    (ScoringConfig(window=WINDOW, pooling_first_only=False, pooling_width=3, redundancy="off"), 4, 3, 1),
    (ScoringConfig(window=WINDOW, redundancy="full", sink_tokens=3), 4, 3, 1),
    (ScoringConfig(window=WINDOW, redundancy="full", global_score=False, pooling=False, redundancy_weight=0.5,
                   similarity_threshold=0.2, redundancy_temperature=1.0), 1, 2, 1),
    (ScoringConfig(window=WINDOW, redundancy="lightning", sink_tokens=2, pooling_width=4,
                   pooling_first_only=False), 1, 3, 0),
    (ScoringConfig(window=WINDOW, eviction_policy="window", sink_tokens=3), 4, 3, 2),
]


@pytest.mark.parametrize("cfg,group,rows,padding", SCORING_CASES)
def test_slot_scores_match_dense_numpy(cfg, group, rows, padding):
    rng = seeded_rng()
    k_pool, _, score_cache, query_cache, batch = make_problem(rng, hkv=2, group=group, rows=rows, padding=padding)
    got = device_scores(k_pool, score_cache, query_cache, batch, cfg)
    want, _ = oracle_scores(k_pool, score_cache, query_cache, batch, cfg)
    assert got.shape == want.shape and got.dtype == np.float32
    assert_scores_close(got, want)


def test_history_and_pooling_knobs_change_the_scores():
    """Guards the oracle comparison above against knobs that silently do nothing."""
    rng = seeded_rng()
    k_pool, _, score_cache, query_cache, batch = make_problem(rng, hkv=2, group=4, rows=4, padding=0)
    batch["compressed_before"][:] = [True, True, False, False]
    batch["num_src_pages"][:] = BUDGET + 1
    base = ScoringConfig(window=WINDOW, global_score=False, pooling=False, redundancy="off")
    scores = {name: device_scores(k_pool, score_cache, query_cache, batch, cfg) for name, cfg in {
        "base": base,
        "global": ScoringConfig(window=WINDOW, global_score=True, pooling=False, redundancy="off"),
        "pool_first": ScoringConfig(window=WINDOW, global_score=False, pooling=True, redundancy="off"),
    }.items()}
    finite = np.isfinite(scores["base"])
    history_rows, fresh_rows = [0, 1], [2, 3]
    assert not np.allclose(scores["global"][history_rows][finite[history_rows]],
                           scores["base"][history_rows][finite[history_rows]])
    np.testing.assert_array_equal(scores["global"][fresh_rows], scores["base"][fresh_rows])
    np.testing.assert_array_equal(scores["pool_first"][history_rows], scores["base"][history_rows])
    assert not np.allclose(scores["pool_first"][fresh_rows][finite[fresh_rows]],
                           scores["base"][fresh_rows][finite[fresh_rows]])


def test_select_slots_matches_numpy_top_k():
    rng = seeded_rng()
    batch, hkv, n, keep = 3, 4, 40, 24
    scores = rng.standard_normal((batch, LAYERS, hkv, n)).astype(np.float32)
    scores[..., ::5] = np.round(scores[..., ::5])  # ties
    scores[..., n - WINDOW:] = np.inf
    scores[..., :2] = np.inf
    scores[1, ..., 32:n - WINDOW] = -np.inf  # a shorter request: padding slots
    got = np.asarray(select_slots(jnp.asarray(scores), keep))
    assert got.shape == (batch, LAYERS, hkv, keep) and got.dtype == np.int32
    for index in np.ndindex(batch, LAYERS, hkv):
        want = np_top_k(scores[index], keep)
        np.testing.assert_array_equal(got[index], want)
        assert np.all(np.diff(got[index]) > 0)
        assert set(np.nonzero(np.isposinf(scores[index]))[0]) <= set(got[index])
        assert not np.isneginf(scores[index][got[index]]).any()
    with pytest.raises(ValueError, match="keep"):
        select_slots(jnp.asarray(scores), n + 1)


@pytest.mark.parametrize("keep", [1, 7, 39, 40])
def test_select_slots_breaks_ties_by_slot(keep):
    """Plateaus of equal scores (signed zeros count as equal) and -inf padding: the earlier slot always wins."""
    rng = seeded_rng()
    values = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, np.inf], np.float32)
    scores = rng.choice(values, size=(5, 40)).astype(np.float32)
    got = np.asarray(select_slots(jnp.asarray(scores), keep))
    for row in range(scores.shape[0]):
        np.testing.assert_array_equal(got[row], np_top_k(scores[row], keep))


def dense_attention(q, keys, values):
    """q [Hq, D]; keys/values per KV head ``[Hkv, n, D]`` → [Hq, D] (float64)."""
    hq, hkv = q.shape[0], keys.shape[0]
    return np.stack([np_softmax(keys[h // (hq // hkv)] @ q[h] * SCALE) @ values[h // (hq // hkv)]
                     for h in range(hq)])


COMPRESS_CASES = [  # (cfg, query group, max_pages): half of them compress every layer in one group
    (DEFAULT, 4, ALL_LAYERS),
    (ScoringConfig(window=WINDOW, redundancy="full", sink_tokens=3, pooling_first_only=False), 1, None),
    (ScoringConfig(window=WINDOW, global_score=False, redundancy="off", pooling=False), 4, None),
    (ScoringConfig(window=WINDOW, eviction_policy="window", sink_tokens=2), 1, ALL_LAYERS),
]


@pytest.mark.parametrize("cfg,group,max_pages", COMPRESS_CASES)
def test_compress_end_to_end(cfg, group, max_pages):
    rng = seeded_rng()
    hkv = 2
    k_pool, v_pool, score_cache, query_cache, batch = make_problem(rng, hkv=hkv, group=group, rows=3, padding=1)
    scores = device_scores(k_pool, score_cache, query_cache, batch, cfg)
    _, glob = oracle_scores(k_pool, score_cache, query_cache, batch, cfg)
    keep = BUDGET * PAGE
    new_k, new_v, new_scores = map(np.asarray, jitted_compress(cfg, max_pages)(
        jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(score_cache), jnp.asarray(query_cache),
        device_batch(batch)))

    valid_rows = np.nonzero(batch["valid"])[0]
    written = set(batch["dst_tables"][valid_rows].ravel().tolist())
    untouched = np.array(sorted(set(range(k_pool.shape[1])) - written))
    # other requests' pages, recent pages, copy-on-write sources, padding rows' pages, the null page
    np.testing.assert_array_equal(new_k[:, untouched], k_pool[:, untouched])
    np.testing.assert_array_equal(new_v[:, untouched], v_pool[:, untouched])
    np.testing.assert_array_equal(new_scores[:, untouched], score_cache[:, untouched])
    if not cfg.tracks_history:
        np.testing.assert_array_equal(new_scores, score_cache)

    q = rng.standard_normal((len(batch["valid"]), hkv * group, DIM)).astype(np.float32)
    for layer in range(LAYERS):
        attn = np.asarray(paged_decode_ref(q, new_k, new_v, layer, np.full(len(q), keep, np.int32),
                                           batch["dst_tables"], SCALE))
        for b in valid_rows:
            n, src, dst = batch["num_src_pages"][b] * PAGE, batch["src_tables"][b], batch["dst_tables"][b]
            old_k, old_v = slot_values(k_pool, layer, src, n), slot_values(v_pool, layer, src, n)
            kept = np.stack([np_top_k(scores[b, layer, h], keep) for h in range(hkv)])  # [Hkv, keep]
            heads = np.arange(hkv)[:, None]
            np.testing.assert_array_equal(slot_values(new_k, layer, dst, keep), old_k[heads, kept])
            np.testing.assert_array_equal(slot_values(new_v, layer, dst, keep), old_v[heads, kept])
            if cfg.tracks_history:
                np.testing.assert_allclose(slot_values(new_scores, layer, dst, keep), glob[b, layer][heads, kept],
                                           rtol=2e-4, atol=2e-6)
            if cfg.sink_tokens:
                assert np.all(kept[:, :cfg.sink_tokens] == np.arange(cfg.sink_tokens))
            assert np.all(kept[:, -WINDOW:] == np.arange(n - WINDOW, n))
            want = dense_attention(q[b].astype(np.float64), old_k[heads, kept], old_v[heads, kept])
            np.testing.assert_allclose(attn[b], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group,max_pages", [(4, None), (1, ALL_LAYERS)])
def test_consecutive_compressions_carry_the_kept_history(group, max_pages):
    """Rounds of compress → fresh page of K/V and queries → compress, tracked independently in numpy (layer by
    layer, or all layers in one group)."""
    rng = seeded_rng()
    hkv, hq, rounds = 2, 2 * group, 4
    cfg = ScoringConfig(window=WINDOW, sink_tokens=1, redundancy="lightning")
    k_pool, v_pool, score_cache, query_cache, batch = make_problem(rng, hkv=hkv, group=group, rows=2, padding=1)
    row = int(np.nonzero(batch["valid"] & ~batch["compressed_before"])[0][0]) if \
        (batch["valid"] & ~batch["compressed_before"]).any() else int(np.nonzero(batch["valid"])[0][0])
    batch["compressed_before"][row] = False
    n = batch["num_src_pages"][row] * PAGE
    src = batch["src_tables"][row]
    # numpy state of the request, per (layer, head): keys, values, score history
    keys = np.stack([slot_values(k_pool, layer, src, n) for layer in range(LAYERS)])
    values = np.stack([slot_values(v_pool, layer, src, n) for layer in range(LAYERS)])
    history = np.zeros((LAYERS, hkv, n), np.float32)
    keep = BUDGET * PAGE
    kdev, vdev, sdev = jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(score_cache)
    qcache = query_cache.copy()
    slot = batch["query_rows"][row]
    for round_index in range(rounds):
        logical = batch["logical_lens"][row]
        queries = window_queries(qcache, slot, logical).astype(np.float64)
        want, glob = np_request_scores(keys.astype(np.float64), queries, history, batch["compressed_before"][row],
                                       cfg, PAGE)
        got = device_scores(kdev, sdev, qcache, batch, cfg)
        assert_scores_close(got[row, :, :, :n], want)
        kdev, vdev, sdev = jitted_compress(cfg, max_pages)(kdev, vdev, sdev, jnp.asarray(qcache),
                                                           device_batch(batch))
        kept = np.stack([[np_top_k(got[row, layer, h], keep) for h in range(hkv)] for layer in range(LAYERS)])
        keys = np.take_along_axis(keys, kept[..., None], axis=2)
        values = np.take_along_axis(values, kept[..., None], axis=2)
        history = np.take_along_axis(glob, kept, axis=2).astype(np.float32)
        dst = batch["dst_tables"][row]
        k_np, v_np, s_np = map(np.asarray, (kdev, vdev, sdev))
        for layer in range(LAYERS):
            np.testing.assert_array_equal(slot_values(k_np, layer, dst, keep), keys[layer])
            np.testing.assert_array_equal(slot_values(v_np, layer, dst, keep), values[layer])
            np.testing.assert_allclose(slot_values(s_np, layer, dst, keep), history[layer], rtol=2e-4, atol=2e-6)
        # the request now owns dst + its old last page (recent page), refilled with one page of new tokens
        recent = src[batch["num_src_pages"][row] - 1]
        fresh_k = rng.standard_normal((LAYERS, hkv, PAGE, DIM)).astype(np.float32)
        fresh_v = rng.standard_normal((LAYERS, hkv, PAGE, DIM)).astype(np.float32)
        kdev, vdev = kdev.at[:, recent].set(fresh_k), vdev.at[:, recent].set(fresh_v)
        for position in range(logical, logical + PAGE):
            qcache[:, slot, position % WINDOW] = rng.standard_normal((LAYERS, hq, DIM))
        keys, values = np.concatenate([keys, fresh_k], axis=2), np.concatenate([values, fresh_v], axis=2)
        history = np.concatenate([history, np.zeros((LAYERS, hkv, PAGE), np.float32)], axis=2)
        src = np.zeros_like(src)
        src[:BUDGET + 1] = list(dst) + [recent]
        n = (BUDGET + 1) * PAGE
        batch["src_tables"][row], batch["num_src_pages"][row] = src, BUDGET + 1
        batch["logical_lens"][row] = logical + PAGE
        batch["compressed_before"][row] = True
        batch["dst_tables"][row] = src[:BUDGET]
    # decode over the final state: attention over exactly the tracked tokens of each head
    q = rng.standard_normal((len(batch["valid"]), hq, DIM)).astype(np.float32)
    tables = batch["src_tables"]
    lens = np.where(np.arange(len(q)) == row, n, 0).astype(np.int32)
    for layer in range(LAYERS):
        attn = np.asarray(paged_decode_ref(q, kdev, vdev, layer, lens, tables, SCALE))
        want = dense_attention(q[row].astype(np.float64), keys[layer].astype(np.float64),
                               values[layer].astype(np.float64))
        np.testing.assert_allclose(attn[row], want, rtol=1e-4, atol=1e-5)


def test_compress_rejects_bad_shapes():
    rng = seeded_rng()
    k_pool, v_pool, score_cache, query_cache, batch = make_problem(rng, hkv=2, group=2, rows=1, padding=0)
    args = (jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(score_cache))
    with pytest.raises(ValueError, match="query_cache"):
        compress(*args, jnp.asarray(query_cache[:, :, :2]), device_batch(batch), DEFAULT, SCALE, REFERENCE)
    with pytest.raises(ValueError, match="score_cache"):
        compress(*args[:2], args[2][:, :, :1], jnp.asarray(query_cache), device_batch(batch), DEFAULT, SCALE, REFERENCE)
    wide = dict(batch, dst_tables=batch["src_tables"])
    with pytest.raises(ValueError, match="dst_tables"):
        compress(*args, jnp.asarray(query_cache), device_batch(wide), DEFAULT, SCALE, REFERENCE)


def test_layer_groups_divide_the_layers_within_the_reserved_pages():
    """The most layers that divide the model's and fit the source pages the memory plan reserved; one layer when
    even that is over (a wide first compression), or with no reservation."""
    assert layer_group(36, rows=1, width=9, max_pages=576) == 36
    assert layer_group(36, rows=4, width=9, max_pages=576) == 12  # 16 would fit, but does not divide 36
    assert layer_group(36, rows=16, width=9, max_pages=576) == 4
    assert layer_group(36, rows=64, width=9, max_pages=576) == 1
    assert layer_group(36, rows=1, width=128, max_pages=576) == 4
    assert layer_group(36, rows=1, width=1024, max_pages=576) == 1
    assert layer_group(36, rows=1, width=9, max_pages=None) == 1
    assert layer_group(28, rows=2, width=9, max_pages=576) == 28
