"""Per-slot eviction scores of Compressed PagedAttention for one layer of a batch of requests
(docs/ARCHITECTURE.md, Compression: scores).

Every function but ``paged_window_attention`` (which reads the pool pages, like the backends' fused kernel)
works on a layer's already-gathered request data: keys ``[B, Hkv, N, D]`` over ``N = P * S``
physical slots, of which the first ``num_live = num_src_pages * S`` are live (the rest is table padding).
Scores are f32; whatever the knobs, the last ``window`` live slots and the first ``sink_tokens`` are
protected (+inf) and everything outside the live range, or in a padding row, is -inf.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.reference import NORM_FLOOR, gather_request_kv
from zipage_jax.config import ScoringConfig


def _live_mask(num_live, num_slots):
    return jnp.arange(num_slots)[None, :] < num_live[:, None]  # [B, N]


def _masked_softmax(logits, mask):
    """Softmax over the last axis restricted to ``mask``; rows with no live entry give zeros."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(denom > 0, denom, 1.0)


def window_attention(keys, queries, num_live, sm_scale):
    """A ``[B, Hkv, N]``: mean over the W window queries of the max over each GQA group of their softmax.

    ``queries [B, W, Hq, D]`` are the post-RoPE queries of the last W live slots in order; window query ``w``
    sits at physical slot ``num_live - W + w`` and sees the slots up to it (softmax in f32 over those).
    Loops over the W queries so the scratch is one query's logits ``[B, Hq, N]`` f32, not W of them.
    """
    batch, num_kv_heads, num_slots, head_dim = keys.shape
    window, num_q_heads = queries.shape[1], queries.shape[2]
    group = num_q_heads // num_kv_heads
    slots = jnp.arange(num_slots)

    def one_query(w, total):
        q = jax.lax.dynamic_index_in_dim(queries, w, axis=1, keepdims=False)
        q = q.reshape(batch, num_kv_heads, group, head_dim)
        logits = jnp.einsum("bhgd,bhnd->bhgn", q, keys, preferred_element_type=jnp.float32) * sm_scale
        visible = slots[None, :] <= (num_live - window + w)[:, None]  # [B, N]; always inside the live range
        probs = _masked_softmax(logits, visible[:, None, None, :])
        return total + jnp.max(probs, axis=2)

    total = jax.lax.fori_loop(0, window, one_query, jnp.zeros((batch, num_kv_heads, num_slots), jnp.float32))
    return total / window


def paged_window_attention(k_pool, layer, page_tables, num_live, queries, sm_scale):
    """``window_attention`` of the requests in ``page_tables [B, P]`` of one pool layer: the jnp path (CPU and
    oracle) of the backends' fused ``window_scores`` kernel, same signature."""
    return window_attention(gather_request_kv(k_pool, layer, page_tables), queries, num_live, sm_scale)


def global_scores(attention, history, has_history, decay):
    """G = max(A, decay * G_old) where the slot has history (``has_history [B, N]``), else A."""
    return jnp.where(has_history[:, None, :], jnp.maximum(attention, decay * history), attention)


def max_pool(scores, num_live, width):
    """Max over ``width`` neighbouring slots ('same' alignment), never reaching outside the live range."""
    live = _live_mask(num_live, scores.shape[-1])[:, None, :]
    padded = jnp.where(live, scores, -jnp.inf)
    left, right = (width - 1) // 2, width // 2
    pooled = jax.lax.reduce_window(
        padded, -jnp.inf, jax.lax.max, (1, 1, width), (1, 1, 1), ((0, 0), (0, 0), (left, right))
    )
    return jnp.where(live, pooled, scores)


def redundancy_row_sums(keys, num_live, page_size, cfg: ScoringConfig):
    """``_row_sums`` with the knobs of ``cfg``."""
    return _row_sums(keys, num_live, page_size, cfg.similarity_threshold, cfg.redundancy == "full")


def _row_sums(keys, num_live, page_size, threshold, full: bool):
    """Raw R-KV style key redundancy ``[B, Hkv, N]``: each live slot's similarity row sum over its candidates.

    Cosine similarity s(m, n) of the keys over a candidate set U (the slot's own page for "lightning", all
    live slots for "full"), diagonal 0; for each column n the latest row m with s(m, n) > threshold is
    zeroed (a key's most recent near-duplicate gets no credit from it); then row sums over U. Loops over
    column pages, so the similarity scratch is ``[B, Hkv, S, S]`` (lightning) or ``[B, Hkv, N, S]`` (full)
    f32 per step. The jnp path and oracle of the backends' ``lightning_row_sums`` kernel.
    """
    batch, num_kv_heads, num_slots, _ = keys.shape
    slots = jnp.arange(num_slots)
    live = _live_mask(num_live, num_slots)
    norms = jnp.sqrt(jnp.sum(jnp.square(keys.astype(jnp.float32)), axis=-1))
    inv_norms = 1.0 / jnp.maximum(norms, NORM_FLOOR)  # [B, Hkv, N]

    def page_slice(x, start, axis):
        return jax.lax.dynamic_slice_in_dim(x, start, page_size, axis=axis)

    def column_page(page, raw):
        start = page * page_size
        cols, inv_cols = page_slice(keys, start, 2), page_slice(inv_norms, start, 2)
        col_ids, live_cols = start + jnp.arange(page_size), page_slice(live, start, 1)
        if full:
            rows, inv_rows, row_ids, live_rows = keys, inv_norms, slots, live
        else:
            rows, inv_rows, row_ids, live_rows = cols, inv_cols, col_ids, live_cols
        sim = jnp.einsum("bhmd,bhnd->bhmn", rows, cols, preferred_element_type=jnp.float32)
        sim = sim * inv_rows[..., :, None] * inv_cols[..., None, :]
        pair = live_rows[:, None, :, None] & live_cols[:, None, None, :] & (row_ids[:, None] != col_ids[None, :])
        sim = jnp.where(pair, sim, 0.0)
        latest = jnp.max(jnp.where(pair & (sim > threshold), row_ids[:, None], -1), axis=2)
        sim = jnp.where(row_ids[:, None] == latest[:, :, None, :], 0.0, sim)
        row_sums = jnp.sum(sim, axis=-1)
        if full:
            return raw + row_sums
        return jax.lax.dynamic_update_slice_in_dim(raw, row_sums, start, axis=2)

    return jax.lax.fori_loop(0, num_slots // page_size, column_page,
                             jnp.zeros((batch, num_kv_heads, num_slots), jnp.float32))


def redundancy_softmax(row_sums, num_live, page_size, cfg: ScoringConfig):
    """R ``[B, Hkv, N]``: ``softmax(row_sums / (temperature * |U|))`` over the live slots."""
    candidates = num_live if cfg.redundancy == "full" else jnp.full_like(num_live, page_size)
    temperature = cfg.redundancy_temperature * jnp.maximum(candidates, 1).astype(jnp.float32)
    live = _live_mask(num_live, row_sums.shape[-1])
    return _masked_softmax(row_sums / temperature[:, None, None], live[:, None, :])


def redundancy_scores(keys, num_live, page_size, cfg: ScoringConfig):
    """R ``[B, Hkv, N]`` of gathered ``keys [B, Hkv, N, D]``: the softmax of their redundancy row sums."""
    return redundancy_softmax(redundancy_row_sums(keys, num_live, page_size, cfg), num_live, page_size, cfg)


def paged_lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold):
    """Lightning ``redundancy_row_sums`` of the requests' first ``num_pages`` full pages in ``page_tables`` of one
    pool layer: the jnp path (CPU and oracle) of the backends' fused ``lightning_row_sums`` kernel, same
    signature."""
    page_size = k_pool.shape[3]
    keys = gather_request_kv(k_pool, layer, page_tables)
    return _row_sums(keys, num_pages * page_size, page_size, threshold, full=False)


def paged_redundancy_scores(k_pool, layer, page_tables, num_src_pages, cfg: ScoringConfig,
                            lightning_row_sums=paged_lightning_row_sums):
    """R of the requests' first ``num_src_pages`` full pages in ``page_tables`` of one pool layer: "lightning" row
    sums by ``lightning_row_sums`` (a backend's kernel or the jnp path), "full" ones from gathered keys."""
    page_size = k_pool.shape[3]
    num_live = num_src_pages * page_size
    if cfg.redundancy == "lightning":
        row_sums = lightning_row_sums(k_pool, layer, page_tables, num_src_pages, cfg.similarity_threshold)
    else:
        row_sums = redundancy_row_sums(gather_request_kv(k_pool, layer, page_tables), num_live, page_size, cfg)
    return redundancy_softmax(row_sums, num_live, page_size, cfg)


def zipage_scores(attention, redundancy, history, num_src_pages, compressed_before, page_size, cfg):
    """``(score, G)``, each ``[B, Hkv, N]``, of the "zipage" policy before protection.

    ``attention`` is A (``window_attention``); ``redundancy`` is R (``paged_redundancy_scores``; None when it
    is off). ``history [B, Hkv, N]`` is the score cache at the request's slots, used only where it is
    meaningful: the request was compressed before and the slot is not in its last, fresh page. G is the
    global score (before pooling and redundancy): what the score cache keeps for the next compression.
    """
    num_slots = attention.shape[2]
    num_live = num_src_pages * page_size
    if cfg.global_score:
        fresh_from = (num_src_pages - 1) * page_size
        has_history = compressed_before[:, None] & (jnp.arange(num_slots)[None, :] < fresh_from[:, None])
        attention = global_scores(attention, history, has_history, cfg.decay)
    score = attention
    if cfg.pooling:
        pooled = max_pool(score, num_live, cfg.pooling_width)
        if cfg.pooling_first_only:
            pooled = jnp.where(compressed_before[:, None, None], score, pooled)
        score = pooled
    if cfg.redundancy != "off":
        score = (1.0 - cfg.redundancy_weight) * score - cfg.redundancy_weight * redundancy
    return score, attention


def recency_scores(batch, num_kv_heads, num_slots):
    """Policy "window": the slot index, so the most recent slots win (the sliding-window baseline)."""
    return jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.float32), (batch, num_kv_heads, num_slots))


def protect(score, num_src_pages, valid, page_size, cfg):
    """+inf on the last ``window`` live slots and the first ``sink_tokens``; -inf off the live range / padding rows."""
    slots = jnp.arange(score.shape[-1])[None, None, :]
    live_n = (num_src_pages * page_size)[:, None, None]
    protected = (slots >= live_n - cfg.window) | (slots < cfg.sink_tokens)
    score = jnp.where(protected, jnp.inf, score)
    return jnp.where((slots < live_n) & valid[:, None, None], score, -jnp.inf)
