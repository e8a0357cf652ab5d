"""Paged decode attention as a Triton kernel called through jax-triton: the Ampere (sm_80) path.

Mosaic GPU's TMA page pipelines need Hopper; Triton compiles the same flash-decoding loop for older GPUs.
One program handles one (request, KV head, KV split): the group's query heads are the rows of a tile padded
to 16 (``tl.dot``'s smallest M), each KV block of ``block_n`` slots is gathered row by row from the pages the
page table names (so any page size works, one page or many per block), and slots past the request's live
length are masked, never loaded. Each split writes its normalised partial output and base-2 log-sum-exp; the
same XLA merge as the Mosaic kernel combines them. Imported only when the ``triton`` backend is used.
"""

import functools
import math

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from pallas_kernels.paged_decode import _check_inputs, merge_splits
from pallas_kernels.triton_sizing import decode_splits, group_rows

_LOG2E = math.log2(math.e)


@triton.jit
def _decode_kernel(layer_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                   num_pages: tl.constexpr, num_kv_heads: tl.constexpr, page_size: tl.constexpr,
                   head_dim: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr,
                   table_width: tl.constexpr, block_n: tl.constexpr, split_slots: tl.constexpr,
                   num_splits: tl.constexpr, scale_log2: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ref + row)
    layer = tl.load(layer_ref)
    g = tl.arange(0, group_pad)
    d = tl.arange(0, head_dim)
    q_rows = row * (num_kv_heads * group) + kv_head * group + g
    q = tl.load(q_ref + q_rows[:, None] * head_dim + d[None, :], mask=(g < group)[:, None], other=0.0)
    first = split * split_slots
    end = tl.minimum(kv_len, first + split_slots)
    m_i = tl.full([group_pad], float("-inf"), tl.float32)
    l_i = tl.zeros([group_pad], tl.float32)
    acc = tl.zeros([group_pad, head_dim], tl.float32)
    for start in range(first, end, block_n):
        n = start + tl.arange(0, block_n)
        live = n < kv_len
        page = tl.load(tables_ref + row * table_width + n // page_size, mask=live, other=0)
        head_page = (layer * num_pages + page).to(tl.int64) * num_kv_heads + kv_head
        offsets = (head_page * page_size + n % page_size)[:, None] * head_dim + d[None, :]
        k = tl.load(k_ref + offsets, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ref + offsets, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # An empty split keeps l_i == 0: NaN output and -inf lse here, dropped by the merge.
    part = (row * num_kv_heads + kv_head) * num_splits + split
    out_rows = part * group + g
    keep = g < group
    tl.store(o_ref + out_rows[:, None] * head_dim + d[None, :], acc / l_i[:, None], mask=keep[:, None])
    tl.store(lse_ref + out_rows, m_i + tl.log2(l_i), mask=keep)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_n", "num_splits", "num_warps", "num_stages",
                                             "compute_capability"))
def paged_decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale, *, block_n=64, num_splits=None,
                 num_warps=4, num_stages=2, compute_capability=None):
    """Decode attention, same contract as ``pallas_kernels.paged_decode.paged_decode``.

    ``compute_capability`` (e.g. 80) compiles for an older GPU than the one present (the Ampere code on Hopper);
    None targets the device.
    """
    _check_inputs(q, k_pool, v_pool, kv_lens, page_tables)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    group = num_q_heads // num_kv_heads
    num_splits, split_slots = decode_splits(batch, num_kv_heads, page_tables.shape[1], page_size, block_n,
                                            num_splits)
    o_parts, lse_parts = jt.triton_call(
        jnp.asarray(layer, jnp.int32).reshape(1), kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32),
        q, k_pool, v_pool,
        kernel=_decode_kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group), jnp.float32)),
        grid=(batch, num_kv_heads, num_splits),
        num_warps=num_warps, num_stages=num_stages, compute_capability=compute_capability,
        num_pages=k_pool.shape[1], num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim,
        group=group, group_pad=group_rows(group),
        table_width=page_tables.shape[1], block_n=block_n, split_slots=split_slots, num_splits=num_splits,
        scale_log2=float(sm_scale) * _LOG2E)
    return merge_splits(o_parts, lse_parts).reshape(batch, num_q_heads, head_dim).astype(q.dtype)
