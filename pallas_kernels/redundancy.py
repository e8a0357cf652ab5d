"""Lightning (within-page) key redundancy of compression (DESIGN §3.4) as a Mosaic GPU (Hopper) kernel.

One CTA handles one (request, KV head) of one layer and loops over its live blocks of ``R = max(S, 64)`` slots
(one page, or ``64 / S`` whole pages), ``num_stages`` blocks in flight by TMA straight from the pool pages named
in the page table. With ``s(m, n)`` the cosine similarity of keys m, n of the same page (0 on the diagonal and
off the live range), per block:

- pass 0: the key norms, from the diagonal of ``K K^T`` (64x64 wgmma tiles);
- pass 1: per 64x64 tile of ``K K^T``: each row's latest column with ``s`` above the threshold (``s`` is
  symmetric, so row n's latest match is column n's latest row);
- pass 2: the same tiles again (recomputing a wgmma is cheaper than keeping them): each row's sum of ``s`` less
  the similarities of the columns whose latest match it is.

Thresholds compare ``K K^T * inv_norm[n]`` with ``threshold * norm[m]``, so a tile costs a handful of vector
ops per element. This is the "lightning" row sum of ``zipage_jax.compression.scoring.redundancy_row_sums``
(before its softmax, which is O(slots) jnp). Scratch per CTA: the key blocks and a few ``R``-vectors of f32 in
shared memory; global memory holds only the ``[B, Hkv, N]`` f32 result.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_decode import TILE_ROWS, swizzled
from zipage_jax.compression.scoring import NORM_FLOOR  # the jnp reference's clamp of the key norms


def block_slots(page_size):
    """Slots per CTA: one page, or whole pages filling one 64-row wgmma tile."""
    return max(page_size, TILE_ROWS)


def _check_inputs(k_pool, page_tables, num_pages):
    if k_pool.ndim != 5:
        raise ValueError(f"k_pool must be [L, pages, Hkv, S, D], got {k_pool.shape}")
    page_size, head_dim = k_pool.shape[3:]
    if head_dim not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128, got {head_dim}")
    if page_size % 8 or not 8 <= page_size <= 256 or (page_size % TILE_ROWS and TILE_ROWS % page_size):
        raise ValueError(f"page size must be a multiple of 8 up to 256 that divides or is divided by 64, "
                         f"got {page_size}")
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables must be [B, P], got {page_tables.shape}")
    if num_pages.shape != page_tables.shape[:1]:
        raise ValueError(f"num_pages must be [B]={page_tables.shape[0]}, got {num_pages.shape}")
    if k_pool.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"k_pool must be a 16-bit float dtype, got {k_pool.dtype}")


def _row_sums_kernel(layer_ref, num_pages_ref, page_tables_ref, k_ref, o_ref, k_smem, k_bar, inv_smem, latest_smem,
                     out_smem, *, threshold, page_size, num_stages):
    kv_head, row = lax.axis_index("h"), lax.axis_index("b")
    layer, num_pages = layer_ref[0], num_pages_ref[row]
    slots = k_smem.shape[1]
    num_tiles, pages_per_block = slots // TILE_ROWS, slots // page_size
    num_blocks = pl.cdiv(num_pages * page_size, slots)
    masked = page_size < TILE_ROWS  # several pages per tile, the last block possibly part live
    wgmma_layout = plgpu.Layout.WGMMA
    row_vector, col_vector = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    tile = (TILE_ROWS, TILE_ROWS)

    def issue(block):
        for j in range(pages_per_block):
            page = page_tables_ref[row, lax.min(block * pages_per_block + j, num_pages - 1)]
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, kv_head],
                                    k_smem.at[lax.rem(block, num_stages), pl.ds(j * page_size, page_size)],
                                    k_bar.at[lax.rem(block, num_stages)])

    for s in range(num_stages):
        @pl.when(s < num_blocks)
        def _prologue():
            issue(s)

    def block_step(block, _):
        stage = lax.rem(block, num_stages)
        keys = k_smem.at[stage]
        live = num_pages * page_size - block * slots
        plgpu.barrier_wait(k_bar.at[stage])

        def gram(t, c):  # K[tile t] @ K[tile c]^T in f32
            def mma(acc_ref):
                rows, cols = keys.at[pl.ds(t * TILE_ROWS, TILE_ROWS)], keys.at[pl.ds(c * TILE_ROWS, TILE_ROWS)]
                plgpu.wgmma(acc_ref, rows, cols.T)
                return acc_ref[...]
            return pl.run_scoped(mma, plgpu.ACC(tile, jnp.float32))

        def iota(dim):  # a fresh iota per use: sharing one across the passes defeats Mosaic's layout inference
            return plgpu.broadcasted_iota(jnp.int32, tile, dim, layout=wgmma_layout)

        def pairs(t, c):  # the tile's real pairs: None where a tile cannot hold the diagonal, other pages or dead slots
            rows, cols = iota(0), iota(1)
            if masked:
                return (rows != cols) & (rows // page_size == cols // page_size) & (rows < live) & (cols < live)
            return rows != cols if t == c else None

        def col_chunk(ref, c):
            return lax.broadcast_in_dim(plgpu.load(ref.at[pl.ds(c * TILE_ROWS, TILE_ROWS)], layout=col_vector),
                                        tile, [1])

        def row_chunk(ref, t):
            return plgpu.load(ref.at[pl.ds(t * TILE_ROWS, TILE_ROWS)], layout=row_vector)

        plgpu.commit_smem()  # every warp is done with the previous block's vectors
        for t in range(num_tiles):  # pass 0: inverse key norms
            rows, cols = iota(0), iota(1)
            norm_sq = jnp.where(rows == cols, gram(t, t), 0.0).sum(axis=1)
            inv_smem[pl.ds(t * TILE_ROWS, TILE_ROWS)] = 1.0 / jnp.maximum(jnp.sqrt(norm_sq), NORM_FLOOR)
        plgpu.commit_smem()

        for t in range(num_tiles):  # pass 1: each row's latest column above the threshold (-1: none)
            inv_rows = lax.broadcast_in_dim(row_chunk(inv_smem, t), tile, [0])
            latest = None
            for c in range(num_tiles):
                above = gram(t, c) * col_chunk(inv_smem, c) * inv_rows > threshold
                ok = pairs(t, c)
                above = above if ok is None else above & ok
                cols_f = (iota(1) + c * TILE_ROWS).astype(jnp.float32)
                found = jnp.where(above, cols_f, -1.0).max(axis=1)
                latest = found if latest is None else jnp.maximum(latest, found)
            latest_smem[pl.ds(t * TILE_ROWS, TILE_ROWS)] = latest
        plgpu.commit_smem()

        buf = lax.rem(block, 2)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy that last read this buffer is done
        for t in range(num_tiles):  # pass 2: row sums less the similarities of the columns matched to the row
            rows_f = (iota(0) + t * TILE_ROWS).astype(jnp.float32)
            total = lost = None
            for c in range(num_tiles):
                x, ok = gram(t, c) * col_chunk(inv_smem, c), pairs(t, c)
                x = x if ok is None else jnp.where(ok, x, 0.0)
                x_sum, x_lost = x.sum(axis=1), jnp.where(col_chunk(latest_smem, c) == rows_f, x, 0.0).sum(axis=1)
                total, lost = (x_sum, x_lost) if total is None else (total + x_sum, lost + x_lost)
            out_smem[buf, pl.ds(t * TILE_ROWS, TILE_ROWS)] = row_chunk(inv_smem, t) * (total - lost)

        @pl.when(block + num_stages < num_blocks)
        def _refill():  # every wgmma reading this stage has completed
            issue(block + num_stages)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[buf], o_ref.at[row, kv_head, pl.ds(block * slots, slots)])

    lax.fori_loop(0, num_blocks, block_step, None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("threshold", "num_stages", "interpret"))
def lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold, *, num_stages=1, interpret=False):
    """Raw lightning redundancy ``[B, Hkv, P * S]`` f32 of the requests' first ``num_pages [B]`` (full) pages
    in ``page_tables [B, P]`` of pool layer ``layer``: what ``redundancy_row_sums`` gives on their gathered keys
    with ``redundancy="lightning"``; slots past the live pages are 0. One stage (the default) beats two on an
    H200 (0.72 vs 1.01 ms a layer at Qwen3-8B shapes, B=64): the kernel is ALU-bound, so three CTAs a
    multiprocessor beat a prefetched page. ``interpret`` may be
    ``plgpu.InterpretGPUParams()`` to run on CPU."""
    num_pages = jnp.asarray(num_pages, jnp.int32)
    _check_inputs(k_pool, page_tables, num_pages)
    batch, table_pages = page_tables.shape
    num_kv_heads, page_size, head_dim = k_pool.shape[2:]
    slots = block_slots(page_size)
    num_slots = table_pages * page_size
    num_blocks = pl.cdiv(num_slots, slots)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    kernel = functools.partial(_row_sums_kernel, threshold=float(threshold), page_size=page_size,
                               num_stages=num_stages)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks * slots), jnp.float32),
        grid=(num_kv_heads, batch),
        grid_names=("h", "b"),
        scratch_types=(
            plgpu.SMEM((num_stages, slots, head_dim), k_pool.dtype, transforms=swizzled()),
            plgpu.Barrier(num_arrivals=slots // page_size, num_barriers=num_stages),
            plgpu.SMEM((slots,), jnp.float32),
            plgpu.SMEM((slots,), jnp.float32),
            plgpu.SMEM((2, slots), jnp.float32),
        ),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), num_pages, page_tables.astype(jnp.int32), k_pool)
    live = jnp.arange(num_slots)[None, None, :] < (num_pages * page_size)[:, None, None]
    return jnp.where(live, out[..., :num_slots], 0.0)


def smem_bytes(page_size, head_dim, num_stages=1, itemsize=2):
    """Shared memory of one CTA: the key blocks in flight and four f32 slot vectors."""
    slots = block_slots(page_size)
    return num_stages * slots * head_dim * itemsize + 4 * slots * 4
