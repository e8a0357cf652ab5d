"""Lightning (within-page) key redundancy of compression as a Mosaic GPU (Hopper) kernel (docs/ARCHITECTURE.md,
Compression: scores).

One CTA handles one block of ``R = max(S, 64)`` slots (one page, or ``64 / S`` whole pages) of one (request,
KV head) of one layer, fetched by TMA straight from the pool pages named in the page table: a CTA per block
rather than a loop over a request's blocks: thousands of short CTAs fill the multiprocessors evenly, where one
CTA per (request, head) left a ragged last wave (BENCHMARKS.md). With ``s(m, n)`` the cosine similarity of
keys m, n of the same page (0 on the diagonal and off the live range), per block:

- pass 0: the key norms, from the keys in shared memory;
- pass 1: a loop over the 64-row tiles, each against every 64x128 tile of ``K K^T``: each row's sum of ``s`` and its latest column with ``s`` above the
  threshold, packed with that ``s`` into one int32 so a single max reduction finds both. ``s`` is
  symmetric, so row n's latest match is column n's latest row.

The latest-match rule takes ``s(m*(n), n)`` off row ``m*(n)``'s sum: a scatter-add of one value per slot, done
in jnp on the kernel's packed matches (``_matched_similarity``), so no tile is computed twice. Thresholds
compare ``K K^T * inv_norm[n]`` with ``threshold * norm[m]``. This is the "lightning" row sum of
the engine's jnp ``redundancy_row_sums`` (before its softmax, which is O(slots) jnp). Scratch per
CTA: the key block and a few ``R``-vectors in shared memory; global memory holds two ``[B, Hkv, N]`` vectors.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.paged_decode import TILE_ROWS, swizzled, upcast_block
from pallas_kernels.reference import NORM_FLOOR, row_layers  # NORM_FLOOR: the jnp reference's clamp of the key norms


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
    if k_pool.dtype not in (jnp.bfloat16, jnp.float16) and not is_fp8(k_pool.dtype):
        raise ValueError(f"k_pool must be a 16-bit float dtype or FP8, got {k_pool.dtype}")


# A row's latest match and its similarity s, packed into one int32 so a single max reduction finds both:
# (column << 23) + round((s + 1 + 2^-8) * 2^21), columns < 256. The quantised s is formed by one fma into
# [2^23, 2^24), where an f32's low 23 bits are that integer, so a bitcast replaces a (quarter-rate) conversion.
_COL_SHIFT = 23
_SIM_SCALE = float(2 ** 21)  # 4.8e-7 resolution of the matched similarity
_SIM_OFFSET = 1.0 + 2.0 ** -8  # keeps s + offset > 0 for |s| rounding past 1
_F32_2_23_BITS = 0x4B000000  # bits of 2.0**23: the integer in the low mantissa bits sits on top of these


COLUMN_TILE = 128  # wgmma N of the K K^T tiles: faster than 64 and 256 (BENCHMARKS.md)


def _row_sums_kernel(layer_ref, num_pages_ref, page_tables_ref, k_ref, col_bits_ref, sums_ref, match_ref, k_smem,
                     col_bits_smem, barrier, inv_smem, sums_smem, match_smem, *staging, threshold, page_size):
    """``staging``: an FP8 pool's 8-bit buffer, which the pages arrive in before their upcast into ``k_smem``."""
    kv_head, row, block = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("p")
    layer, num_pages = layer_ref[row], num_pages_ref[row]
    slots = k_smem.shape[0]
    width = min(COLUMN_TILE, slots)
    num_tiles, num_cols, pages_per_block = slots // TILE_ROWS, slots // width, slots // page_size
    masked = page_size < TILE_ROWS  # several pages per tile, the last block possibly part live
    wgmma_layout = plgpu.Layout.WGMMA
    row_vector, col_vector = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    tile = (TILE_ROWS, width)
    live = num_pages * page_size - block * slots

    def rows_of(ref, t, size=TILE_ROWS):
        return ref.at[pl.ds(t * size, size)]

    def iota(dim):  # a fresh iota per use: sharing one across the passes defeats Mosaic's layout inference
        return plgpu.broadcasted_iota(jnp.int32, tile, dim, layout=wgmma_layout)

    def col_chunk(ref, c):
        return lax.broadcast_in_dim(plgpu.load(rows_of(ref, c, width), layout=col_vector), tile, [1])

    def norms():  # pass 0: inverse key norms, from the keys themselves
        for t in range(num_tiles):
            k = plgpu.load(rows_of(k_smem, t), layout=wgmma_layout).astype(jnp.float32)
            rows_of(inv_smem, t)[...] = 1.0 / jnp.maximum(jnp.sqrt((k * k).sum(axis=1)), NORM_FLOOR)

    def sums_and_matches(t):  # pass 1, per row tile: the rows' sums of ``s`` and packed latest matches
        inv_rows = plgpu.load(rows_of(inv_smem, t), layout=row_vector)
        above_at = lax.broadcast_in_dim(threshold / inv_rows, tile, [0])  # s > threshold, before row scaling
        sim_scale = lax.broadcast_in_dim(inv_rows * _SIM_SCALE, tile, [0])
        # Column tiles from the one holding the diagonal on, so that one is known statically to be the first.
        diagonal = t * TILE_ROWS // width
        columns = [(diagonal + j) % num_cols for j in range(num_cols)]

        def pair_mask(j):  # the tile's real pairs: None where a tile cannot hold the diagonal, other pages or dead slots
            if not masked and j > 0:
                return None
            rows, cols = iota(0) + (t * TILE_ROWS - columns[j] * width), iota(1)
            if masked:
                return (rows != cols) & (rows // page_size == cols // page_size) & (rows < live) & (cols < live)
            return rows != cols

        def column_tile(j, gram, carry):
            x = gram * col_chunk(inv_smem, columns[j])  # s(m, n) * norm[m]
            ok = pair_mask(j)
            above = x > above_at
            if ok is not None:
                x, above = jnp.where(ok, x, 0.0), above & ok
            quantised = lax.bitcast_convert_type(x * sim_scale + (_SIM_OFFSET * _SIM_SCALE + 2.0 ** 23), jnp.int32)
            matches = jnp.where(above, quantised + col_chunk(col_bits_smem, columns[j]), -1)
            total, latest = x.sum(axis=1), matches.max(axis=1)
            return (total, latest) if carry is None else (carry[0] + total, jnp.maximum(carry[1], latest))

        def gram(j):
            def mma(acc):
                plgpu.wgmma(acc, rows_of(k_smem, t), rows_of(k_smem, columns[j], width).T)
                return acc[...]

            return pl.run_scoped(mma, plgpu.ACC(tile, jnp.float32))

        carry = None
        for j in range(num_cols):  # one wgmma at a time: overlapping the next with this reduction measured no faster
            carry = column_tile(j, gram(j), carry)
        total, latest = carry
        rows_of(sums_smem, t)[...] = inv_rows * total
        rows_of(match_smem, t)[...] = latest

    @pl.when(live > 0)
    def _block():
        for j in range(pages_per_block):
            page = page_tables_ref[row, lax.min(block * pages_per_block + j, num_pages - 1)]
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, kv_head],
                                    (staging[0] if staging else k_smem).at[pl.ds(j * page_size, page_size)], barrier)
        plgpu.copy_gmem_to_smem(col_bits_ref, col_bits_smem, barrier)
        plgpu.barrier_wait(barrier)
        if staging:  # the cosine does not see the pool's per-head scale: the raw values upcast are enough
            upcast_block(staging[0], k_smem)
        norms()
        plgpu.commit_smem()
        # A loop, not unrolled: unrolled, the row tiles used all 255 registers and spilled; looped nothing spills
        # and the kernel is faster (BENCHMARKS.md).
        pl.loop(0, num_tiles)(sums_and_matches)
        plgpu.commit_smem()
        out = pl.ds(block * slots, slots)
        plgpu.copy_smem_to_gmem(sums_smem, sums_ref.at[row, kv_head, out])
        plgpu.copy_smem_to_gmem(match_smem, match_ref.at[row, kv_head, out])
        plgpu.wait_smem_to_gmem(0)


def _matched_similarity(match, slots):
    """Per slot m, the sum of s(n, m) over the slots n whose latest match m is (``match`` packs n's latest
    column within its block of ``slots`` and s): what the latest-match rule takes off m's row sum."""
    batch, heads, num_slots = match.shape
    found = match >= 0
    column = match >> _COL_SHIFT
    sim = (match & ((1 << _COL_SHIFT) - 1)).astype(jnp.float32) / _SIM_SCALE - _SIM_OFFSET
    slot = jnp.arange(num_slots)
    target = jnp.where(found, slot - slot % slots + column, slot)
    flat = (jnp.arange(batch * heads)[:, None] * num_slots + target.reshape(batch * heads, num_slots)).ravel()
    lost = jnp.zeros(batch * heads * num_slots, jnp.float32).at[flat].add(jnp.where(found, sim, 0.0).ravel())
    return lost.reshape(batch, heads, num_slots)


@functools.partial(jax.jit, static_argnames=("threshold", "interpret"))
def lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold, *, interpret=False):
    """Raw lightning redundancy ``[B, Hkv, P * S]`` f32 of the requests' first ``num_pages [B]`` (full) pages
    in ``page_tables [B, P]`` of pool layer ``layer`` (or one per row ``[B]``): what ``redundancy_row_sums`` gives
    on their gathered keys with ``redundancy="lightning"``; slots past the live pages are 0. ``interpret`` may be
    ``plgpu.InterpretGPUParams()`` to run on CPU."""
    num_pages = jnp.asarray(num_pages, jnp.int32)
    _check_inputs(k_pool, page_tables, num_pages)
    batch, table_pages = page_tables.shape
    num_kv_heads, page_size, head_dim = k_pool.shape[2:]
    slots = block_slots(page_size)
    num_slots = table_pages * page_size
    num_blocks = pl.cdiv(num_slots, slots)
    vector = lambda dtype: jax.ShapeDtypeStruct((batch, num_kv_heads, num_blocks * slots), dtype)  # noqa: E731
    fp8 = is_fp8(k_pool.dtype)
    sums, match = plgpu.kernel(
        functools.partial(_row_sums_kernel, threshold=float(threshold), page_size=page_size),
        out_type=(vector(jnp.float32), vector(jnp.int32)),
        grid=(num_kv_heads, batch, num_blocks),
        grid_names=("h", "b", "p"),
        scratch_types=(
            plgpu.SMEM((slots, head_dim), jnp.bfloat16 if fp8 else k_pool.dtype, transforms=swizzled()),
            plgpu.SMEM((slots,), jnp.int32),
            plgpu.Barrier(num_arrivals=slots // page_size + 1),
            plgpu.SMEM((slots,), jnp.float32),
            plgpu.SMEM((slots,), jnp.float32),
            plgpu.SMEM((slots,), jnp.int32),
            *([plgpu.SMEM((slots, head_dim), k_pool.dtype)] if fp8 else []),
        ),
        interpret=interpret,
    )(row_layers(layer, page_tables.shape[0]), num_pages, page_tables.astype(jnp.int32), k_pool,
      (jnp.arange(slots, dtype=jnp.int32) << _COL_SHIFT) - _F32_2_23_BITS)
    live = jnp.arange(num_blocks * slots)[None, None, :] < (num_pages * page_size)[:, None, None]
    row_sums = sums - _matched_similarity(jnp.where(live, match, -1), slots)
    return jnp.where(live, row_sums, 0.0)[..., :num_slots]


def smem_bytes(page_size, head_dim, itemsize=2):
    """Shared memory of one CTA: its key block and four 4-byte slot vectors."""
    slots = block_slots(page_size)
    return slots * head_dim * itemsize + 4 * slots * 4
