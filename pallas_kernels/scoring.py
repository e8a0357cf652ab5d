"""Window-query attention scores of compression as a Mosaic GPU (Hopper) kernel (docs/ARCHITECTURE.md,
Compression: scores).

One CTA handles one (request, KV head) of one layer. Its W window queries times the G query heads of the
group are the rows of 64-row wgmma tiles (row ``g * W + w``; rows past ``G * W`` are zero padding). Key
blocks of ``block_kv`` slots are fetched by TMA straight from the pool pages named in the page table (as in
``paged_decode``), ``num_stages`` blocks in flight, over two passes of the request's live blocks, streamed as
one pipeline (pass 2 walks the blocks backwards, so it starts on blocks pass 1 has just left in L2):

1. ``Q K^T`` per row tile: online row max / sum (base 2) → each row's log-sum-exp, kept in shared memory.
2. ``K Q_g^T`` per group head ``g`` (slots are the rows, the W queries the columns): the normalised
   probabilities, their max over ``g`` and mean over the W columns (a row reduction) → one score per slot,
   written per block.

Window query ``w`` sits at slot ``num_live - W + w`` and sees the slots up to it. Scratch is the query tile,
the key blocks and ``G * W`` f32 statistics per CTA; global memory holds only the ``[B, Hkv, N]`` f32 result:
O(slots) per (layer, request, head), never ``W * Hq * N`` logits. Redundancy, pooling, the global score and
top-k stay in the engine's jnp: they are O(slots) elementwise or per-page work.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.paged_decode import TILE_ROWS, check_block_kv, swizzled, upcast_block
from pallas_kernels.reference import row_layers

_LOG2E = math.log2(math.e)
_NEG_BIG = -1e30  # finite start of the running max: a row with nothing visible yet stays NaN-free
MAX_QUERY_ROWS = 512  # G * W, padded to 64: the query tile must fit shared memory next to the key blocks


def padded_query_rows(group, window):
    """Rows of the query tiles: the ``group * window`` (head, query) pairs rounded up to whole 64-row tiles."""
    return -(-group * window // TILE_ROWS) * TILE_ROWS


def default_block_kv(page_size):
    """128-slot key blocks where they tile the page size (faster than 64 on an H200, see BENCHMARKS.md), else 64."""
    return 128 if page_size % 128 == 0 or 128 % page_size == 0 else 64


def _check_inputs(k_pool, page_tables, num_live, queries):
    if k_pool.ndim != 5:
        raise ValueError(f"k_pool must be [L, pages, Hkv, S, D], got {k_pool.shape}")
    num_kv_heads, page_size, head_dim = k_pool.shape[2:]
    if queries.ndim != 4 or queries.shape[0] != page_tables.shape[0] or queries.shape[3] != head_dim:
        raise ValueError(f"queries must be [B, W, Hq, {head_dim}] with B = {page_tables.shape[0]}, got {queries.shape}")
    batch, window, num_q_heads, _ = queries.shape
    if head_dim not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128, got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    if window % 8 or not 8 <= window <= 256:
        raise ValueError(f"window must be a multiple of 8 in [8, 256] (the wgmma N of pass 2), got {window}")
    if padded_query_rows(num_q_heads // num_kv_heads, window) > MAX_QUERY_ROWS:
        raise ValueError(f"window * group = {window * num_q_heads // num_kv_heads} exceeds {MAX_QUERY_ROWS} rows")
    if page_size % 8 or not 8 <= page_size <= 256:
        raise ValueError(f"page size must be a multiple of 8 in [8, 256], got {page_size}")
    if num_live.shape != (batch,):
        raise ValueError(f"num_live must be [B]={batch}, got {num_live.shape}")
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables must be [B, P], got {page_tables.shape}")
    if k_pool.dtype not in (jnp.bfloat16, jnp.float16) and not is_fp8(k_pool.dtype):
        raise ValueError(f"k_pool must be a 16-bit float dtype or FP8, got {k_pool.dtype}")


def _scores_kernel(layer_ref, num_live_ref, page_tables_ref, q_ref, k_ref, o_ref, q_smem, q_bar, k_smem, k_bar,
                   lse_smem, out_smem, *wide, window, group, sm_scale, block_kv, num_stages, page_size):
    """``wide``: with an FP8 pool, the 16-bit buffer each staged 8-bit key block is upcast into for the wgmmas."""
    kv_head, row = lax.axis_index("h"), lax.axis_index("b")
    layer, num_live = layer_ref[row], num_live_ref[row]
    num_tiles = q_smem.shape[0] // TILE_ROWS
    num_blocks = pl.cdiv(num_live, block_kv)
    last_live_page = lax.max(num_live - 1, 0) // page_size
    pages_per_block = max(block_kv // page_size, 1)
    scale = sm_scale * _LOG2E
    first_query = num_live - window  # slot of window query 0

    def block_of(step):  # the block of stream step ``step`` (pass 2 runs backwards)
        return jnp.where(step < num_blocks, step, 2 * num_blocks - 1 - step)

    def issue(step):  # load step ``step`` of the two-pass stream
        slot, token0 = lax.rem(step, num_stages), block_of(step) * block_kv
        if block_kv <= page_size:
            page = page_tables_ref[row, token0 // page_size]
            src = k_ref.at[layer, page, kv_head, pl.ds(token0 % page_size, block_kv)]
            plgpu.copy_gmem_to_smem(src, k_smem.at[slot], k_bar.at[slot])
            return
        for j in range(pages_per_block):
            page = page_tables_ref[row, lax.min(token0 // page_size + j, last_live_page)]
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, kv_head], k_smem.at[slot, pl.ds(j * page_size, page_size)],
                                    k_bar.at[slot])

    def keys(slot):  # the wgmma operand of a staged block
        return upcast_block(k_smem.at[slot], wide[0]) if wide else k_smem.at[slot]

    def refill(step):
        @pl.when(step + num_stages < 2 * num_blocks)
        def _():
            issue(step + num_stages)

    for s in range(num_stages):
        @pl.when(s < 2 * num_blocks)
        def _prologue():
            issue(s)

    plgpu.copy_gmem_to_smem(q_ref.at[row, kv_head], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)

    # Pass 1: per query row, the log-sum-exp (base 2) over its visible slots.
    def stats_step(step, carry):
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(k_bar.at[slot])
        k_block = keys(slot)
        new_carry = []
        for t in range(num_tiles):
            m_i, l_i = carry[t]

            def qk(acc_ref, t=t):
                plgpu.wgmma(acc_ref, q_smem.at[pl.ds(t * TILE_ROWS, TILE_ROWS)], k_block.T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, block_kv), jnp.float32)) * scale
            rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            w = lax.rem(rows + t * TILE_ROWS, window)
            s = jnp.where(cols <= first_query - step * block_kv + w, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            new_carry.append((m_new, l_i * jnp.exp2(m_i - m_new) + p.sum(axis=1)))
        refill(step)
        return tuple(new_carry)

    reduced = plgpu.Layout.WGMMA.reduce(1)
    init = tuple((plgpu.layout_cast(jnp.full((TILE_ROWS,), _NEG_BIG, jnp.float32), reduced),
                  plgpu.layout_cast(jnp.full((TILE_ROWS,), 0.0, jnp.float32), reduced)) for _ in range(num_tiles))
    stats = lax.fori_loop(0, num_blocks, stats_step, init)
    for t, (m_i, l_i) in enumerate(stats):  # rows with nothing visible get +inf: probability 0, as in jnp
        lse_smem[pl.ds(t * TILE_ROWS, TILE_ROWS)] = jnp.where(l_i > 0, m_i + jnp.log2(l_i), jnp.inf)
    plgpu.commit_smem()

    # Pass 2: per slot, mean over w of the max over g of the normalised probabilities.
    def score_step(step, _):
        slot, block = lax.rem(step, num_stages), block_of(step)
        plgpu.barrier_wait(k_bar.at[slot])
        k_block = keys(slot)
        best = None
        for g in range(group):
            def kq(acc_ref, g=g):
                plgpu.wgmma(acc_ref, k_block, q_smem.at[pl.ds(g * window, window)].T)
                return acc_ref[...]

            s = pl.run_scoped(kq, plgpu.ACC((block_kv, window), jnp.float32)) * scale
            lse = plgpu.load(lse_smem.at[pl.ds(g * window, window)], layout=plgpu.Layout.WGMMA.reduce(0))
            slots = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            w = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))
            p = jnp.where(slots <= first_query - block * block_kv + w, p, 0.0)
            best = p if best is None else jnp.maximum(best, p)
        refill(step)
        score = best.sum(axis=1) / window
        buf = lax.rem(block, 2)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy that last read this buffer is done
        out_smem.at[buf][...] = score
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[buf], o_ref.at[row, kv_head, pl.ds(block * block_kv, block_kv)])

    lax.fori_loop(num_blocks, 2 * num_blocks, score_step, None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_stages", "interpret"))
def window_scores(k_pool, layer, page_tables, num_live, queries, sm_scale, *, block_kv=None, num_stages=2,
                  interpret=False):
    """A ``[B, Hkv, N]`` f32 (N = P * S): what the engine's jnp ``window_attention`` computes
    from ``gather_request_kv(k_pool, layer, page_tables)``; slots ``>= num_live`` are 0.

    ``queries [B, W, Hq, D]``: the window queries in order. Only the ``num_live`` live slots are read. ``layer``:
    one for every row, or one per row ``[B]`` (the rows of several layers scored together).
    ``block_kv`` defaults to ``default_block_kv(S)``. ``interpret`` may be ``plgpu.InterpretGPUParams()`` to
    run on CPU.
    """
    _check_inputs(k_pool, page_tables, num_live, queries)
    batch, window, num_q_heads, head_dim = queries.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    group = num_q_heads // num_kv_heads
    block_kv = block_kv or default_block_kv(page_size)
    check_block_kv(block_kv, page_size, num_stages)
    num_slots = page_tables.shape[1] * page_size
    padded_slots = pl.cdiv(num_slots, block_kv) * block_kv
    rows, padded_rows = group * window, padded_query_rows(group, window)
    q_rows = queries.reshape(batch, window, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    fp8 = is_fp8(k_pool.dtype)  # its K scale is in the queries already (``kv_quant``)
    dtype = queries.dtype if fp8 else k_pool.dtype  # of the wgmma operands
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim).astype(dtype)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    num_live = jnp.asarray(num_live, jnp.int32)
    kernel = functools.partial(_scores_kernel, window=window, group=group, sm_scale=float(sm_scale),
                               block_kv=block_kv, num_stages=num_stages, page_size=page_size)
    copies = max(block_kv // page_size, 1)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, padded_slots), jnp.float32),
        grid=(num_kv_heads, batch),
        grid_names=("h", "b"),
        scratch_types=(
            plgpu.SMEM((padded_rows, head_dim), dtype, transforms=swizzled()),
            plgpu.Barrier(),
            plgpu.SMEM((num_stages, block_kv, head_dim), k_pool.dtype, transforms=() if fp8 else swizzled()),
            plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
            plgpu.SMEM((padded_rows,), jnp.float32),
            plgpu.SMEM((2, block_kv), jnp.float32),
            *([plgpu.SMEM((block_kv, head_dim), dtype, transforms=swizzled())] if fp8 else []),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(row_layers(layer, batch), num_live, page_tables.astype(jnp.int32), q_rows, k_pool)
    live = jnp.arange(num_slots)[None, None, :] < num_live[:, None, None]
    return jnp.where(live, out[..., :num_slots], 0.0)


def scratch_bytes(batch, num_kv_heads, num_slots, num_q_heads, window, head_dim, itemsize=2):
    """Global-memory scratch of one ``window_scores`` call: the reordered queries and the f32 scores."""
    rows = padded_query_rows(num_q_heads // num_kv_heads, window)
    return batch * num_kv_heads * (rows * head_dim * itemsize + num_slots * 4)


def smem_bytes(group, window, head_dim, block_kv, num_stages, itemsize=2):
    """Shared memory of one CTA: query tiles, key blocks, row statistics, two output blocks."""
    rows = padded_query_rows(group, window)
    return (rows + num_stages * block_kv) * head_dim * itemsize + rows * 4 + 2 * block_kv * 4
