"""Paged decode attention as a Mosaic GPU (Hopper) kernel.

One CTA handles one (request, KV head, KV split). The query heads of the KV head's group are the rows of a
64-row wgmma tile (only the group's rows are loaded; the others are computed and dropped), so both ``q @ k^T`` and ``p @ v`` run on the tensor
cores while the kernel stays bound by the KV stream (the probabilities go through shared memory, the wgmma
operand form that interpret mode can also run). KV blocks of ``block_kv`` slots are fetched by TMA
straight from the pool pages named in the page table, ``num_stages`` blocks in flight. A block spanning
several small pages is filled by one copy per page; pages past the request's live slots are never read (the
last live page is loaded again in their place, and masked). Each split writes its normalised partial output
and log-sum-exp; a small XLA reduce merges the splits (flash-decoding). ``attend_pages`` is the paged flash
loop. Defaults (64-slot blocks, 2 stages): the fastest of the variants the kernel bench times (BENCHMARKS.md).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import is_fp8, quantize_queries, upcast

TILE_ROWS = 64  # wgmma M: one warpgroup's tile of query rows.
Q_ROW_TILE = 8  # rows of the shared-memory tiling: the query rows a CTA loads are padded to a multiple of it
FP8_QK_HEAD_DIMS = (64, 128)  # an FP8 q @ k^T reads rows of D bytes under a D-byte swizzle (the lowering tests')
_LOG2E = math.log2(math.e)


def swizzled():
    """The shared-memory tiling wgmma reads bf16 operands from (64-element rows, 128-byte swizzle)."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def swizzled_bytes(row_bytes):
    """The tiling wgmma reads 8-bit operands from: rows of ``row_bytes`` (the head dim: 64 or 128), swizzled."""
    return plgpu.TilingTransform((8, row_bytes)), plgpu.SwizzleTransform(row_bytes)


def upcast_block(staged, buffer, piece_rows=None):
    """An FP8 pool's staged 8-bit block (``staged [rows, D]``), exactly, as a 16-bit wgmma operand in ``buffer``
    (its first ``rows`` rows); loaded in the wgmma layout, whole or ``piece_rows`` rows at a time (fewer live
    registers beside an accumulator). Returns the operand."""
    rows = staged.shape[0]
    step = piece_rows or rows
    for start in range(0, rows, step):
        part = pl.ds(start, step)
        raw = plgpu.load(staged.at[part] if piece_rows else staged, layout=plgpu.Layout.WGMMA, optimized=False)
        (buffer.at[part] if piece_rows else buffer)[...] = upcast(raw, buffer.dtype)
    plgpu.commit_smem()
    return buffer if rows == buffer.shape[0] else buffer.at[pl.ds(0, rows)]


def _check_inputs(q, k_pool, v_pool, kv_lens, page_tables):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool/v_pool must both be [L, pages, Hkv, S, D], got {k_pool.shape}, {v_pool.shape}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    if k_pool.shape[4] != head_dim or head_dim not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128 and match the pool, got q {head_dim}, pool {k_pool.shape[4]}")
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > TILE_ROWS:
        raise ValueError(f"q heads {num_q_heads} must be a multiple of kv heads {num_kv_heads} (group <= 64)")
    if page_size % 8 or not 8 <= page_size <= 256:
        raise ValueError(f"page size must be a multiple of 8 in [8, 256], got {page_size}")
    if kv_lens.shape != (batch,):
        raise ValueError(f"kv_lens must be [B]={batch}, got {kv_lens.shape}")
    if page_tables.ndim != 2 or page_tables.shape[0] != batch:
        raise ValueError(f"page_tables must be [B, P], got {page_tables.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or (k_pool.dtype != q.dtype and not is_fp8(k_pool.dtype)):
        raise ValueError(f"q must be a 16-bit float and the pools q's dtype or FP8, got {q.dtype}, {k_pool.dtype}")


def check_block_kv(block_kv, page_size, num_stages):
    """A KV block is a 64-multiple that is either a slice of one page or a whole number of pages."""
    tiles_page = page_size % block_kv == 0 if block_kv <= page_size else block_kv % page_size == 0
    if block_kv % 64 or not tiles_page:
        raise ValueError(f"block_kv {block_kv} must be a multiple of 64 that tiles the page size {page_size}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")


def attend_pages(q_smem, q_bar, k_ref, v_ref, page_tables_ref, request, layer, kv_head, kv_len, first_block,
                 num_blocks, pos0, *, causal, sm_scale, block_kv, num_stages, page_size, q_scale=None):
    """Online-softmax attention of the 64-row query tile in ``q_smem`` (its TMA load signals ``q_bar``) over KV
    blocks ``[first_block, first_block + num_blocks)`` of ``request``'s pages.

    Row ``i`` attends to slots ``<= pos0 + i`` when ``causal``, else to slots ``<= pos0``; ``kv_len`` bounds the
    pages that are read. Returns the unnormalised f32 accumulator and the row max / row sum (base 2).

    An FP8 pool (``kv_quant``: its scales are applied outside) is fetched into 8-bit staging buffers, half the
    bytes; each block is upcast (exactly) into one 16-bit buffer that the wgmmas read (8-bit wgmma operands must
    be K-major, which V is not). K and V take turns in it: reading a wgmma's accumulator waits for the wgmma, so
    K's block is done with before V's is written, and the shared memory saved keeps two CTAs on an SM at more
    stages (more bytes in flight: an 8-bit block carries half of a 16-bit one's). The 8-bit tiles are staged
    unswizzled and loaded in the wgmma layout. ``q_scale`` (FP8 queries in ``q_smem``, ``quantize_queries``):
    ``q @ k^T`` runs as an FP8 wgmma straight off the staged K (K-major, as 8-bit operands must be, its tiles
    swizzled by the TMA), so only V is upcast, and the scores are scaled by ``q_scale`` after it. On an H100 that
    reads at 89-90 % of the 16-bit kernel's bandwidth, where upcasting K too reached 73-77 %, a 128-byte swizzle read
    by 32-bit loads 65-68 %, and upcasts moved under the wgmmas (a buffer each for K and V) no faster
    (docs/lab-notes/fp8-kv.md).
    """
    head_dim = q_smem.shape[-1]
    dtype = jnp.bfloat16 if is_fp8(q_smem.dtype) else q_smem.dtype  # the 16-bit operands' (upcast V, p)
    last_live_page = lax.max(kv_len - 1, 0) // page_size
    pages_per_block = max(block_kv // page_size, 1)

    def issue(step, slot, k_smem, v_smem, k_bar, v_bar):
        token0 = (first_block + step) * block_kv
        if block_kv <= page_size:  # The block is a slice of one page.
            page = page_tables_ref[request, token0 // page_size]
            rows = pl.ds(token0 % page_size, block_kv)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, kv_head, rows], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, page, kv_head, rows], v_smem.at[slot], v_bar.at[slot])
            return
        for j in range(pages_per_block):
            page = page_tables_ref[request, lax.min(token0 // page_size + j, last_live_page)]
            dst = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, kv_head], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, page, kv_head], v_smem.at[slot, dst], v_bar.at[slot])

    fp8 = is_fp8(k_ref.dtype)
    k_direct = fp8 and q_scale is not None  # q @ k^T in FP8: K is never upcast

    def attend(k_smem, v_smem, p_smem, k_bar, v_bar, *wide):
        def upcast_into(smem, slot, buffer):  # a staged 8-bit block, exactly, as a 16-bit wgmma operand
            return upcast_block(smem.at[slot], buffer)

        def block(smem, slot):  # the wgmma operand of a staged block
            return upcast_into(smem, slot, wide[0]) if fp8 else smem.at[slot]

        for s in range(num_stages):
            @pl.when(s < num_blocks)
            def _prologue():
                issue(s, s, k_smem, v_smem, k_bar, v_bar)

        plgpu.barrier_wait(q_bar)
        m_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((TILE_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step_fn(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_bar.at[slot])
            k_block = k_smem.at[slot] if k_direct else block(k_smem, slot)

            def qk_fn(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_block.T)
                return acc_ref[...]

            s = pl.run_scoped(qk_fn, plgpu.ACC((TILE_ROWS, block_kv), jnp.float32)) * (sm_scale * _LOG2E)
            if k_direct:
                s = s * q_scale
            slot_ids = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
            limit = pos0 - (first_block + step) * block_kv
            if causal:
                limit = limit + plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, block_kv), 0,
                                                       layout=plgpu.Layout.WGMMA)
            s = jnp.where(slot_ids <= limit, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            v_block = block(v_smem, slot)

            def pv_fn(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_block)
                return acc_ref[...]

            pv = pl.run_scoped(pv_fn, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

            @pl.when(step + num_stages < num_blocks)
            def _refill():
                issue(step + num_stages, slot, k_smem, v_smem, k_bar, v_bar)

            return acc, m_new, l_i

        return lax.fori_loop(0, num_blocks, step_fn, (acc, m_i, l_i))

    copies = pages_per_block if block_kv > page_size else 1
    if fp8:
        v_buf = plgpu.SMEM((num_stages, block_kv, head_dim), k_ref.dtype)
        k_buf = plgpu.SMEM((num_stages, block_kv, head_dim), k_ref.dtype,
                           transforms=swizzled_bytes(head_dim)) if k_direct else v_buf
        wide = (plgpu.SMEM((block_kv, head_dim), dtype, transforms=swizzled()),)
    else:
        k_buf = v_buf = plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=swizzled())
        wide = ()
    return pl.run_scoped(
        attend, k_buf, v_buf, plgpu.SMEM((TILE_ROWS, block_kv), dtype, transforms=swizzled()),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages), *wide,
    )


def _decode_kernel(layer_ref, kv_lens_ref, page_tables_ref, q_ref, k_ref, v_ref, *refs, blocks_per_split, group,
                   fp8_qk, **tile_params):
    q_scale_ref, (o_ref, lse_ref, q_smem, q_bar) = (refs[0], refs[1:]) if fp8_qk else (None, refs)
    kv_head = lax.axis_index("h")
    split = lax.axis_index("s")
    row = lax.axis_index("b")
    kv_len = kv_lens_ref[row]
    head_dim = q_smem.shape[-1]
    first_block = split * blocks_per_split
    num_blocks = jnp.clip(pl.cdiv(kv_len, tile_params["block_kv"]) - first_block, 0, blocks_per_split)
    # Only the group's rows (padded to a whole 8-row tile) are loaded; the tile's other rows hold whatever
    # shared memory held, and every row's softmax and output stay its own, so they never reach a real row.
    plgpu.copy_gmem_to_smem(q_ref.at[row, kv_head], q_smem.at[pl.ds(0, q_ref.shape[2])], q_bar)
    acc, m_i, l_i = attend_pages(q_smem, q_bar, k_ref, v_ref, page_tables_ref, row, layer_ref[0], kv_head, kv_len,
                                 first_block, num_blocks, kv_len - 1, causal=False,
                                 q_scale=q_scale_ref[row, kv_head] if fp8_qk else None, **tile_params)

    def store(o_smem, lse_smem):
        # Empty splits keep l_i == 0: their output is NaN here and dropped by the merge (lse = -inf).
        o_smem[...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
        lse_smem[...] = m_i + jnp.log2(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[row, kv_head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, kv_head, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((TILE_ROWS, head_dim), jnp.float32), plgpu.SMEM((TILE_ROWS,), jnp.float32))


def merge_splits(o_parts, lse_parts):
    """Combine per-split outputs ``[B, Hkv, splits, G, D]`` with their base-2 LSE ``[B, Hkv, splits, G]``.

    An empty split (lse -inf) adds nothing; a row with no keys at all comes out 0. One split (large batches) is
    its own output: one select, none of the merge's reductions."""
    if o_parts.shape[2] == 1:
        return jnp.where(jnp.isfinite(lse_parts)[..., None], o_parts, 0.0)[:, :, 0]
    lse_max = jnp.max(lse_parts, axis=2, keepdims=True)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.where(jnp.isfinite(lse_parts), jnp.exp2(lse_parts - lse_max), 0.0)
    parts = jnp.where(weights[..., None] > 0, o_parts, 0.0)
    total = jnp.sum(weights, axis=2)
    out = jnp.sum(weights[..., None] * parts, axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def default_num_splits(batch, num_kv_heads, max_blocks, num_sms=132):
    """Enough splits that the grid fills about two waves of the GPU, never more than there are blocks."""
    ctas = batch * num_kv_heads
    return int(max(1, min(max_blocks, -(-2 * num_sms // ctas))))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_stages", "num_splits", "fp8_qk",
                                             "interpret"))
def paged_decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale, *, block_kv=None, num_stages=2,
                 num_splits=None, fp8_qk=None, interpret=False):
    """Decode attention: ``q [B, Hq, D]`` over slots ``[0, kv_lens[b])`` of its pages; same result as
    ``paged_decode_ref``. The pools are q's dtype or FP8 (unit-scale values: ``kv_quant``). ``fp8_qk`` quantizes the
    queries to e4m3 (``quantize_queries``) for an FP8 ``q @ k^T`` (``attend_pages``); by default on FP8 pools of
    the head dims an FP8 wgmma takes (``FP8_QK_HEAD_DIMS``), where the result is ``paged_decode_ref`` over
    ``kv_quant.round_queries(q)``. ``interpret`` may be ``plgpu.InterpretGPUParams()`` to run on CPU."""
    _check_inputs(q, k_pool, v_pool, kv_lens, page_tables)
    batch, num_q_heads, head_dim = q.shape
    fp8_wgmma_fits = is_fp8(k_pool.dtype) and head_dim in FP8_QK_HEAD_DIMS
    if fp8_qk is None:
        fp8_qk = fp8_wgmma_fits
    if fp8_qk and not fp8_wgmma_fits:
        raise ValueError(f"fp8_qk: needs FP8 pools of a head dim in {FP8_QK_HEAD_DIMS}, got {k_pool.dtype} pools "
                         f"of head dim {head_dim}")
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    group = num_q_heads // num_kv_heads
    if block_kv is None:
        block_kv = 64
    check_block_kv(block_kv, page_size, num_stages)
    max_blocks = pl.cdiv(page_tables.shape[1] * page_size, block_kv)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_blocks)
    if not 1 <= num_splits <= max_blocks:
        raise ValueError(f"num_splits must be in [1, {max_blocks}], got {num_splits}")
    blocks_per_split = pl.cdiv(max_blocks, num_splits)

    q_tiles = q.reshape(batch, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, -group % Q_ROW_TILE), (0, 0)))
    q_scales = ()
    if fp8_qk:
        q_tiles, q_scale = quantize_queries(q_tiles)
        q_scales = (q_scale,)
    kernel = functools.partial(
        _decode_kernel, sm_scale=float(sm_scale), block_kv=block_kv, num_stages=num_stages,
        blocks_per_split=blocks_per_split, group=group, page_size=page_size, fp8_qk=fp8_qk)
    o_parts, lse_parts = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, group, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, TILE_ROWS), jnp.float32)),
        grid=(num_kv_heads, num_splits, batch),
        grid_names=("h", "s", "b"),
        scratch_types=(
            plgpu.SMEM((TILE_ROWS, head_dim), q_tiles.dtype,
                       transforms=swizzled_bytes(head_dim) if fp8_qk else swizzled()),
            plgpu.Barrier(),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32),
      q_tiles, k_pool, v_pool, *q_scales)
    out = merge_splits(o_parts, lse_parts[..., :group])
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
