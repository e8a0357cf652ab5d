"""Pure-jnp references for the paged attention kernels.

They are the CPU execution path of the engine and the oracle of every kernel test. Semantics (shared by the
kernels, see docs/ARCHITECTURE.md): the KV pool is ``[L, num_pages, Hkv, S, D]``; a request's token at
physical index ``i`` lives at ``(page_tables[r, i // S], i % S)``; query head ``h`` reads KV head
``h // (Hq // Hkv)``; softmax runs in f32; rows with nothing to attend to return zeros.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import upcast

NORM_FLOOR = 1e-6  # key norms are clamped here before the cosine similarity of compression's key redundancy


def write_kv_ref(k_pool, v_pool, layer, slot_mapping, k, v):
    """Scatter new K/V rows ``[T, Hkv, D]`` into flat slots ``page * S + offset`` of one layer (in place under donation)."""
    page_size = k_pool.shape[3]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    k_pool = k_pool.at[layer, pages, :, offsets].set(k.astype(k_pool.dtype))
    v_pool = v_pool.at[layer, pages, :, offsets].set(v.astype(v_pool.dtype))
    return k_pool, v_pool


def row_layers(layer, rows: int):
    """``layer`` (one layer for every row, or one per row ``[R]``) as an index over the rows' leading axis: a
    compression batch may carry the rows of several layers (``compression.step.compress``)."""
    layer = jnp.asarray(layer, jnp.int32)
    return layer if layer.ndim else jnp.broadcast_to(layer, (rows,))


def gather_request_kv(pool, layer, page_table):
    """KV of the requests in ``page_table [R, P]`` as ``[R, Hkv, P * S, D]`` (one gather, no per-layer slice); an FP8
    pool's values upcast exactly to bf16 (its scales are applied outside: ``kv_quant``). ``layer``: one for every
    row, or one per row ``[R]``."""
    layer = jnp.asarray(layer)
    index = layer[:, None] if layer.ndim else layer
    pages = upcast(jnp.asarray(pool)[index, page_table])  # [R, P, Hkv, S, D]
    r, p, h, s, d = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(r, h, p * s, d)


def masked_attention(q, k, v, mask, sm_scale):
    """Softmax attention in f32 with a boolean mask; fully masked rows give zeros.

    q ``[..., Hkv, G, Q, D]``, k/v ``[..., Hkv, K, D]``, mask broadcastable to ``[..., Hkv, G, Q, K]``.
    """
    scores = jnp.einsum("...hgqd,...hkd->...hgqk", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("...hgqk,...hkd->...hgqd", weights, v.astype(jnp.float32))
    return out / jnp.where(denom > 0, denom, 1.0)


def paged_decode_ref(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
    """One query token per row ``q [B, Hq, D]`` attending to physical slots ``[0, kv_lens[b])``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    k = gather_request_kv(k_pool, layer, page_tables)
    v = gather_request_kv(v_pool, layer, page_tables)
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, 1, head_dim)
    mask = jnp.arange(k.shape[2])[None, :] < kv_lens[:, None]  # [B, K]
    out = masked_attention(qg, k, v, mask[:, None, None, None, :], sm_scale)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def token_owners(cu_q_lens, num_tokens):
    """Request row of each packed query token, and whether the token is real (not bucket padding)."""
    tokens = jnp.arange(num_tokens)
    owner = jnp.searchsorted(cu_q_lens, tokens, side="right") - 1
    valid = tokens < cu_q_lens[-1]
    return jnp.clip(owner, 0, cu_q_lens.shape[0] - 2), valid


def ragged_prefill_ref(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
    """Packed query chunks ``q [T, Hq, D]``, causal over each request's cached slots plus the chunk itself.

    Request ``r`` owns query tokens ``[cu_q_lens[r], cu_q_lens[r+1])``: the last ``q_len`` of its ``kv_lens[r]``
    tokens (their K/V already written). Loops over requests so scratch stays ``O(T * K)`` per request, and skips
    the rows without tokens (a bucket's spare rows: most of them when few prompts are prefilled).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    cu_q_lens, kv_lens, page_tables = map(jnp.asarray, (cu_q_lens, kv_lens, page_tables))
    group = num_q_heads // num_kv_heads
    owner, valid = token_owners(cu_q_lens, num_tokens)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    positions = kv_lens[owner] - q_lens[owner] + (jnp.arange(num_tokens) - cu_q_lens[owner])
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    slots = jnp.arange(page_tables.shape[1] * k_pool.shape[3])

    def attend(r, out):
        k = gather_request_kv(k_pool, layer, page_tables[r][None])[0]  # [Hkv, K, D]
        v = gather_request_kv(v_pool, layer, page_tables[r][None])[0]
        mine = valid & (owner == r)
        mask = mine[:, None] & (slots[None, :] <= positions[:, None]) & (slots[None, :] < kv_lens[r])
        o = masked_attention(qg, k, v, mask[None, None], sm_scale)  # [Hkv, G, T, D]
        return jnp.where(mine[None, None, :, None], o, out)

    def one_request(r, out):
        return jax.lax.cond(q_lens[r] > 0, attend, lambda r, out: out, r, out)

    out = jax.lax.fori_loop(0, kv_lens.shape[0], one_request, jnp.zeros(qg.shape, jnp.float32))
    return out.transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
