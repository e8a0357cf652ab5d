"""Ragged paged prefill attention as a Triton kernel called through jax-triton: the Ampere (sm_80) path.

The packed query rows are cut into ``block_m``-row tiles, each inside one request's chunk (at most one partial
tile per request, so ``cdiv(T, block_m) + R`` tiles bound any mix of chunk lengths). One program handles one
(tile, query head): query ``i`` of request ``r`` sits at position ``kv_lens[r] - q_len + i`` and attends
causally to the request's pages (cached prefix, earlier chunks and its own rows). KV blocks wholly below the
tile's first position run without masks; only the blocks on the diagonal are masked; blocks past the tile's
last position are never loaded. Rows are stored straight to their packed places; padding rows are zeroed
before the launch. Imported only when the ``triton`` backend is used.
"""

import functools
import math

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from pallas_kernels.ragged_prefill import _check_inputs
from pallas_kernels.triton_sizing import check_block, chunk_tiles

_LOG2E = math.log2(math.e)


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_ref, v_ref, tables_ref, request, layer, kv_head, kv_len, start, pos,
                  num_pages: tl.constexpr, num_kv_heads: tl.constexpr, page_size: tl.constexpr,
                  head_dim: tl.constexpr, table_width: tl.constexpr, block_n: tl.constexpr,
                  scale_log2: tl.constexpr, masked: tl.constexpr):
    n = start + tl.arange(0, block_n)
    d = tl.arange(0, head_dim)
    if masked:
        live = n < kv_len
        page = tl.load(tables_ref + request * table_width + n // page_size, mask=live, other=0)
    else:
        page = tl.load(tables_ref + request * table_width + n // page_size)
    head_page = (layer * num_pages + page).to(tl.int64) * num_kv_heads + kv_head
    offsets = (head_page * page_size + n % page_size)[:, None] * head_dim + d[None, :]
    if masked:
        k = tl.load(k_ref + offsets, mask=live[:, None], other=0.0)
    else:
        k = tl.load(k_ref + offsets)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if masked:
        s = tl.where((n[None, :] <= pos[:, None]) & live[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if masked:
        v = tl.load(v_ref + offsets, mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_ref + offsets)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(layer_ref, cu_ref, lens_ref, tables_ref, tile_request_ref, tile_row0_ref, q_ref, k_ref, v_ref,
                    o_ref, num_pages: tl.constexpr, num_kv_heads: tl.constexpr, num_q_heads: tl.constexpr,
                    page_size: tl.constexpr, head_dim: tl.constexpr, table_width: tl.constexpr,
                    block_m: tl.constexpr, block_n: tl.constexpr, scale_log2: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(tile_request_ref + tile)
    row0 = tl.load(tile_row0_ref + tile)
    chunk_start = tl.load(cu_ref + request)
    q_len = tl.load(cu_ref + request + 1) - chunk_start
    if row0 < q_len:  # unused tiles do nothing
        kv_len = tl.load(lens_ref + request)
        layer = tl.load(layer_ref)
        kv_head = head // (num_q_heads // num_kv_heads)
        m = row0 + tl.arange(0, block_m)
        d = tl.arange(0, head_dim)
        rows = (chunk_start + m).to(tl.int64) * num_q_heads + head
        valid = m < q_len
        q = tl.load(q_ref + rows[:, None] * head_dim + d[None, :], mask=valid[:, None], other=0.0)
        pos = kv_len - q_len + m
        first_pos = kv_len - q_len + row0
        last_pos = tl.minimum(first_pos + block_m - 1, kv_len - 1)
        full_end = (first_pos + 1) // block_n * block_n  # blocks every row sees whole
        m_i = tl.full([block_m], float("-inf"), tl.float32)
        l_i = tl.zeros([block_m], tl.float32)
        acc = tl.zeros([block_m, head_dim], tl.float32)
        for start in range(0, full_end, block_n):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ref, v_ref, tables_ref, request, layer, kv_head,
                                          kv_len, start, pos, num_pages, num_kv_heads, page_size, head_dim,
                                          table_width, block_n, scale_log2, False)
        for start in range(full_end, last_pos + 1, block_n):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ref, v_ref, tables_ref, request, layer, kv_head,
                                          kv_len, start, pos, num_pages, num_kv_heads, page_size, head_dim,
                                          table_width, block_n, scale_log2, True)
        out = acc / l_i[:, None]
        tl.store(o_ref + rows[:, None] * head_dim + d[None, :], out.to(o_ref.dtype.element_ty), mask=valid[:, None])


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_m", "block_n", "num_warps", "num_stages",
                                             "compute_capability"))
def ragged_prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale, *, block_m=128,
                   block_n=64, num_warps=8, num_stages=3, compute_capability=None):
    """Causal attention of packed chunks, same contract as ``pallas_kernels.ragged_prefill.ragged_prefill``.

    ``compute_capability`` (e.g. 80) compiles for an older GPU than the one present; None targets the device.
    """
    _check_inputs(q, k_pool, v_pool, cu_q_lens, kv_lens, page_tables)
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_request, tile_row0 = chunk_tiles(cu_q_lens, num_tokens, block_m)
    return jt.triton_call(
        jnp.asarray(layer, jnp.int32).reshape(1), cu_q_lens, kv_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32), tile_request, tile_row0, q, k_pool, v_pool,
        kernel=_prefill_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tile_request.shape[0], num_q_heads),
        zeroed_outputs=(0,),
        num_warps=num_warps, num_stages=num_stages, compute_capability=compute_capability,
        num_pages=k_pool.shape[1], num_kv_heads=num_kv_heads, num_q_heads=num_q_heads, page_size=page_size,
        head_dim=head_dim, table_width=page_tables.shape[1], block_m=block_m, block_n=block_n,
        scale_log2=float(sm_scale) * _LOG2E)
