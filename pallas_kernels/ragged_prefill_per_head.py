"""The previous ragged paged prefill kernel (one CTA per query head and 64-row tile), kept only as the baseline
of the prefill benchmarks (``pallas_kernels.bench``, ``zipage_jax.bench ttft``): the engine runs
``pallas_kernels.ragged_prefill``. Delete it once BENCHMARKS.md records the new kernel against it.

The packed query rows are cut into 64-row tiles, each serving one request (a request's chunk starts a new
tile, at the 8-aligned row at or before its first row), so the grid is ``(Hq, cdiv(T + 7R, 64) + R)`` whatever
the mix of chunk lengths. Each CTA runs the same paged flash loop as decode (``paged_decode.attend_pages``: TMA
page loads from the page table, wgmma for ``q @ k^T`` and ``p @ v``) with a causal mask. Tiles are written
whole to a tile-shaped buffer; one XLA gather puts the rows back in packed order and zeroes the padding rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_decode import TILE_ROWS, attend_pages, check_block_kv, swizzled
from pallas_kernels.ragged_prefill import _check_inputs

_ROW_ALIGN = 8  # rows of one tile of the swizzled shared-memory layout


def query_tiles(cu_q_lens, num_tokens):
    """Static-size tiling of the packed rows into 64-row tiles, each inside one request's chunk.

    A tile starts on a packed row that is a multiple of 8 (the TMA box of the swizzled query tile needs it),
    so a request's first tile begins ``cu_q_lens[r] % 8`` rows early; those rows (and rows past the chunk) are
    computed but never read back. Returns ``(tile_request [N], tile_row0 [N], tile_start [R])`` with
    ``N = cdiv(T + 7R, 64) + R``: ``tile_row0`` counts from the aligned start, unused tiles get one at or past their
    request's ``shift + q_len`` (the kernel skips them).
    """
    num_requests = cu_q_lens.shape[0] - 1
    num_tiles = pl.cdiv(num_tokens + (_ROW_ALIGN - 1) * num_requests, TILE_ROWS) + num_requests
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    shifted_lens = jnp.where(q_lens > 0, q_lens + cu_q_lens[:-1] % _ROW_ALIGN, 0)
    tiles_per_request = (shifted_lens + TILE_ROWS - 1) // TILE_ROWS
    tile_end = jnp.cumsum(tiles_per_request)
    tile_start = tile_end - tiles_per_request
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_request = jnp.clip(jnp.searchsorted(tile_end, tiles, side="right"), 0, num_requests - 1).astype(jnp.int32)
    tile_row0 = ((tiles - tile_start[tile_request]) * TILE_ROWS).astype(jnp.int32)
    return tile_request, tile_row0, tile_start.astype(jnp.int32)


def _prefill_kernel(layer_ref, cu_ref, kv_lens_ref, page_tables_ref, tile_request_ref, tile_row0_ref, q_ref, k_ref,
                    v_ref, o_ref, q_smem, q_bar, *, group, num_tokens, **tile_params):
    head = lax.axis_index("h")
    tile = lax.axis_index("t")
    request = tile_request_ref[tile]
    row0 = tile_row0_ref[tile]
    chunk_start = cu_ref[request]
    shift = chunk_start % _ROW_ALIGN
    q_len = cu_ref[request + 1] - chunk_start
    kv_len = kv_lens_ref[request]
    pos0 = kv_len - q_len - shift + row0  # position of the tile's first row
    last_pos = lax.min(pos0 + TILE_ROWS - 1, kv_len - 1)
    num_blocks = jnp.where(row0 < q_len + shift, pl.cdiv(last_pos + 1, tile_params["block_kv"]), 0)
    first_row = lax.min(chunk_start - shift + row0, num_tokens - num_tokens % _ROW_ALIGN)
    q_rows = pl.ds(pl.multiple_of(first_row, _ROW_ALIGN), TILE_ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], q_smem, q_bar)
    acc, _, l_i = attend_pages(q_smem, q_bar, k_ref, v_ref, page_tables_ref, request, layer_ref[0],
                               head // group, kv_len, 0, num_blocks, pos0, causal=True, **tile_params)

    def store(o_smem):
        # Rows past the chunk (and whole unused tiles) hold junk; the gather after the kernel never reads them.
        o_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[tile, :, head])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((TILE_ROWS, q_smem.shape[-1]), q_smem.dtype, transforms=swizzled()))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_stages", "interpret"))
def ragged_prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale, *, block_kv=64,
                   num_stages=2, interpret=False):
    """Causal attention of packed chunks ``q [T, Hq, D]`` over their requests' pages; same result as
    ``ragged_prefill_ref``. ``interpret`` may be ``plgpu.InterpretGPUParams()`` to run on CPU."""
    _check_inputs(q, k_pool, v_pool, cu_q_lens, kv_lens, page_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    check_block_kv(block_kv, page_size, num_stages)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_request, tile_row0, tile_start = query_tiles(cu_q_lens, num_tokens)
    num_tiles = tile_request.shape[0]
    # A whole number of 8-row tiles, plus one query tile of slack so the last tile's TMA box stays inside.
    q_padded = jnp.pad(q, ((0, -num_tokens % _ROW_ALIGN + TILE_ROWS), (0, 0), (0, 0)))
    kernel = functools.partial(
        _prefill_kernel, sm_scale=float(sm_scale), block_kv=block_kv, num_stages=num_stages,
        page_size=page_size, group=num_q_heads // num_kv_heads, num_tokens=num_tokens)
    o_tiles = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, TILE_ROWS, num_q_heads, head_dim), q.dtype),
        grid=(num_q_heads, num_tiles),
        grid_names=("h", "t"),
        scratch_types=(plgpu.SMEM((TILE_ROWS, head_dim), q.dtype, transforms=swizzled()), plgpu.Barrier()),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), cu_q_lens, kv_lens.astype(jnp.int32),
      page_tables.astype(jnp.int32), tile_request, tile_row0, q_padded,
      k_pool, v_pool)

    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(cu_q_lens, tokens, side="right") - 1, 0, cu_q_lens.shape[0] - 2)
    local = tokens - cu_q_lens[owner] + cu_q_lens[owner] % _ROW_ALIGN
    flat_row = (tile_start[owner] + local // TILE_ROWS) * TILE_ROWS + local % TILE_ROWS
    out = o_tiles.reshape(num_tiles * TILE_ROWS, num_q_heads, head_dim)[flat_row]
    return jnp.where((tokens < cu_q_lens[-1])[:, None, None], out, jnp.zeros((), q.dtype))
