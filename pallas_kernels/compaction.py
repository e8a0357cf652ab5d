"""In-place stable compaction of kept KV slots as a Mosaic GPU (Hopper) kernel (docs/ARCHITECTURE.md,
Compression: trigger and pages).

The kernel does what ``scatter_slots(pool, layer, gather_slots(pool, layer, kept, src), dst, valid)`` does
(the engine's jnp compaction) for the K and the V pool at once, but writes into the pools
themselves: no ``[B, Hkv, K, D]`` scratch, no XLA scatter, and no copy of the (GB-sized) pools. The pools
enter the kernel as mutable refs (``jax.new_ref``), which ``plgpu.kernel`` lowers to a custom call whose
outputs alias its inputs; under a jit that donates the pools (or inside a loop carrying them) XLA then
updates them in place.

One CTA handles one (request, KV head, pool) and walks its output blocks of ``block_rows`` slots in ascending order.
The walk is serial (the order is what makes it safe in place, below), so with fewer CTAs than multiprocessors a
layer takes one walk's time whatever the batch: K and V, independent, get a CTA each (``split_pools``), twice the
CTAs with half the walk each. Hopper TMA has no row gather, so a block's sources arrive as TMA copies of runs of
consecutive source rows (its pool rows precomputed from the kept index and the page table; the indices of
``row_group`` rows are read before their copies are issued, so the reads overlap) into plain SMEM, all on one
barrier. A TMA box has a static shape, so runs are found by halving: an aligned span of ``max_run`` kept rows that
is one run inside one source page goes as one copy, else each half is tried the same way, down to single rows: with
the few slots a compression evicts, a fraction of the copies of row by row, which is bound by copy issue
(BENCHMARKS.md, compression cost). Every span makes up its skipped copies' barrier arrivals; the block then leaves
as one TMA store (a block lies inside one destination page). ``stages`` staging buffers: the next ``stages - 1``
blocks' gathers are in flight while the current block is stored.

Why this is safe in place, given what the page manager guarantees:

* ``dst_tables[b, i]`` is either ``src_tables[b, i]`` (in place) or a page nobody reads in this call
  (copy-on-write), and a row's own source pages are distinct: writing output slot ``j`` can only destroy
  source slot ``j`` of the same row.
* ``kept`` is strictly ascending, so ``kept[j] >= j``: source slot ``j`` is read only by outputs ``<= j``.
  Block ``n`` reads slots ``>= n * block_rows`` and writes slots ``[n, n + 1) * block_rows``; all of its reads
  complete before its store is issued, and later blocks' stores touch only slots above it. Reads in flight
  for any later block never meet the store of block ``n``.
* The valid rows' destination pages are distinct and in-place pages belong to one request only (shared
  pages are copied on write), so different (request, head, pool) CTAs touch disjoint memory.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.reference import row_layers

SMEM_LIMIT = 227 * 1024  # Hopper's per-CTA dynamic shared memory


def default_block_rows(page_size):
    """16-row blocks (the page size if smaller), four in flight: 32 KiB of staging at D = 128 bf16, the fastest
    of the shapes measured (BENCHMARKS.md, compression cost)."""
    return min(page_size, 16)


DEFAULT_MAX_RUN = 4  # longest run moved by one TMA copy (1: row by row); longer runs measured no faster
DEFAULT_STAGES = 4  # blocks whose gathers are in flight; more measured no faster (BENCHMARKS.md, compression cost)


def smem_bytes(block_rows, head_dim, itemsize=2, stages=DEFAULT_STAGES):
    """Shared memory of one CTA moving both pools (``split_pools=False``; half that with a CTA a pool):
    ``stages`` staging buffers for each of K and V."""
    return 2 * stages * block_rows * head_dim * itemsize


def _check_inputs(k_pool, v_pool, kept, src_tables, dst_tables, valid, block_rows, stages, max_run):
    if k_pool.ndim != 5:
        raise ValueError(f"k_pool must be [L, pages, Hkv, S, D], got {k_pool.shape}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool must match k_pool {k_pool.shape} {k_pool.dtype}, got {v_pool.shape} {v_pool.dtype}")
    if k_pool.dtype not in (jnp.bfloat16, jnp.float16) and not is_fp8(k_pool.dtype):
        raise ValueError(f"k_pool must be bfloat16, float16 or FP8 (bytes moved as they are), got {k_pool.dtype}")
    num_kv_heads, page_size, head_dim = k_pool.shape[2:]
    if head_dim not in (64, 128):
        raise ValueError(f"k_pool head dim must be 64 or 128, got {head_dim}")
    if dst_tables.ndim != 2:
        raise ValueError(f"dst_tables must be [B, M], got {dst_tables.shape}")
    batch, num_dst_pages = dst_tables.shape
    if kept.ndim != 3 or kept.shape[:2] != (batch, num_kv_heads) or kept.shape[2] != num_dst_pages * page_size:
        raise ValueError(f"kept must be [B, Hkv, M * S] = [{batch}, {num_kv_heads}, {num_dst_pages * page_size}], "
                         f"got {kept.shape}")
    if src_tables.ndim != 2 or src_tables.shape[0] != batch or src_tables.shape[1] < num_dst_pages:
        raise ValueError(f"src_tables must be [B, P] with B = {batch}, P >= M = {num_dst_pages}, "
                         f"got {src_tables.shape}")
    if valid.shape != (batch,):
        raise ValueError(f"valid must be [B] = [{batch}], got {valid.shape}")
    for name, x in (("kept", kept), ("src_tables", src_tables), ("dst_tables", dst_tables)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    if block_rows < 1 or page_size % block_rows:
        raise ValueError(f"block_rows {block_rows} must divide the page size {page_size}")
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    if max_run < 1 or max_run & (max_run - 1):
        raise ValueError(f"max_run must be a power of two, got {max_run}")
    if smem_bytes(block_rows, head_dim, k_pool.dtype.itemsize, stages) > SMEM_LIMIT:
        raise ValueError(f"block_rows {block_rows} x stages {stages}: staging exceeds {SMEM_LIMIT} bytes of "
                         f"shared memory")


def _compact_kernel(layer_ref, rows_ref, dst_ref, valid_ref, k_ref, v_ref, *scratch, split_pools, **walk):
    """With ``split_pools`` a CTA moves one pool (grid axis ``p``: 0 = K, 1 = V), else both."""
    if not split_pools:
        k_stage, v_stage, bars = scratch
        _compact_walk(layer_ref, rows_ref, dst_ref, valid_ref, ((k_ref, k_stage), (v_ref, v_stage)), bars, **walk)
        return
    stage, bars = scratch
    for which, pool in enumerate((k_ref, v_ref)):
        @pl.when(lax.axis_index("p") == which)
        def _one_pool(pool=pool):
            _compact_walk(layer_ref, rows_ref, dst_ref, valid_ref, ((pool, stage),), bars, **walk)


def _compact_walk(layer_ref, rows_ref, dst_ref, valid_ref, pools, bars, *, block_rows, page_size, num_blocks,
                  row_group, max_run):
    """One (request, KV head)'s output blocks in ascending order, for each ``(pool ref, staging SMEM)`` of
    ``pools``; every block's copies arrive on one barrier."""
    head, row = lax.axis_index("h"), lax.axis_index("b")
    layer = layer_ref[row]
    group = math.gcd(block_rows, row_group)
    run = math.gcd(group, max_run)
    stages = pools[0][1].shape[0]

    def copy_rows(pool_row, count, at, buf):  # ``count`` consecutive rows of one page, one TMA per pool
        page, offset = pool_row // page_size, pool_row % page_size
        for pool, stage in pools:
            plgpu.copy_gmem_to_smem(pool.at[layer, page, head, pl.ds(offset, count)],
                                    stage.at[buf, pl.ds(at, count)], bars.at[buf])

    def copy_runs(pool_rows, at, buf):
        """Rows ``at ..`` of staging buffer ``buf``: one copy if the pool rows are one run inside a page, else
        each half on its own. A run's missing arrivals are made up, so every block arrives
        ``len(pools) * block_rows`` times."""
        count = len(pool_rows)
        if count == 1:
            copy_rows(pool_rows[0], 1, at, buf)
            return
        first, last = pool_rows[0], pool_rows[-1]
        one_run = (last - first == count - 1) & (first % page_size + count <= page_size)

        @pl.when(one_run)
        def _run():
            copy_rows(first, count, at, buf)
            for _ in range(len(pools) * (count - 1)):
                plgpu.barrier_arrive(bars.at[buf])

        @pl.when(~one_run)
        def _halves():
            half = count // 2
            copy_runs(pool_rows[:half], at, buf)
            copy_runs(pool_rows[half:], at + half, buf)

    def gather(block, buf):  # every kept slot of the block into ``buf``, all arriving on ``bars[buf]``
        def rows(i, _):  # the group's pool rows are loaded first, so their latencies overlap
            first = block * block_rows + i * group
            pool_rows = [rows_ref[row, head, first + r] for r in range(group)]
            for r in range(0, group, run):
                copy_runs(pool_rows[r:r + run], i * group + r, buf)

        lax.fori_loop(0, block_rows // group, rows, None)

    def step(block, _):
        buf = lax.rem(block, stages)
        plgpu.barrier_wait(bars.at[buf])  # this block's sources are all in SMEM
        ahead = block + stages - 1

        @pl.when(ahead < num_blocks)
        def _prefetch():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's store has read its buffer
            gather(ahead, lax.rem(ahead, stages))

        slot0 = block * block_rows
        page, offset = dst_ref[row, slot0 // page_size], slot0 % page_size
        plgpu.commit_smem()  # proxy fence before the store reads the staged rows: cheap, and safe either way
        for i, (pool, stage) in enumerate(pools):
            plgpu.copy_smem_to_gmem(stage.at[buf], pool.at[layer, page, head, pl.ds(offset, block_rows)],
                                    commit_group=i == len(pools) - 1)

    @pl.when(valid_ref[row] != 0)
    def _compact():
        for block in range(min(stages - 1, num_blocks)):
            gather(block, block)
        lax.fori_loop(0, num_blocks, step, None)
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block_rows", "row_group", "stages", "max_run", "split_pools",
                                             "interpret"),
                   donate_argnames=("k_pool", "v_pool"))
def compact_slots(k_pool, v_pool, layer, kept, src_tables, dst_tables, valid, *, block_rows=None, row_group=8,
                  stages=DEFAULT_STAGES, max_run=DEFAULT_MAX_RUN, split_pools=True, interpret=False):
    """``(k_pool, v_pool)`` with, per valid row ``b`` and KV head ``h``, output slot ``j`` (page
    ``dst_tables[b, j // S]``, offset ``j % S``) of layer ``layer`` set to source slot ``kept[b, h, j]`` (page
    ``src_tables[b, kept // S]``); everything else is untouched. Bit-exact ``gather_slots`` + ``scatter_slots``.

    ``k_pool, v_pool [L, pages, Hkv, S, D]`` (bf16 / f16, or FP8 with static scales that stay put: ``kv_quant``;
    D = 64 or 128) are donated and updated in place: do
    not use the arrays passed in afterwards. Inside an outer jit the donation is the outer jit's business (a
    ``fori_loop`` carry or donated arguments, as in ``compress``); the kernel's outputs alias its inputs either
    way. ``layer`` is a (traced) int32 scalar, or one per row ``[B]`` (the rows of several layers compacted
    together); ``kept [B, Hkv, M * S]`` strictly ascending per (row, head) and
    in ``[0, P * S)`` (traced, so not checked); ``dst_tables [B, M]``, ``src_tables [B, P]``, ``valid [B]``, with
    the page guarantees of the module docstring. ``block_rows`` (default ``default_block_rows(S)``) must
    divide S; ``stages`` (>= 2) blocks are staged at once; ``row_group`` kept rows have their indices read
    together before their copies are issued, so the reads overlap; ``max_run`` (a power of two) bounds the runs
    of consecutive source rows moved by one copy (runs span at most ``gcd(block_rows, row_group)`` rows).
    ``split_pools`` gives K and V a CTA each (twice the CTAs, each with half the walk), else one CTA moves both.
    ``interpret`` may be ``plgpu.InterpretGPUParams()`` to run on CPU.
    """
    page_size = k_pool.shape[3]
    block_rows = block_rows or default_block_rows(page_size)
    _check_inputs(k_pool, v_pool, kept, src_tables, dst_tables, valid, block_rows, stages, max_run)
    if row_group < 1:
        raise ValueError(f"row_group must be >= 1, got {row_group}")
    batch, num_kv_heads, keep = kept.shape
    head_dim, dtype = k_pool.shape[4], k_pool.dtype
    kernel = functools.partial(_compact_kernel, split_pools=split_pools, block_rows=block_rows, page_size=page_size,
                               num_blocks=keep // block_rows, row_group=row_group, max_run=max_run)
    # each kept slot's pool row (page * S + offset): one scalar load per row in the kernel, not two dependent ones
    kept = kept.astype(jnp.int32)
    pages = jnp.take_along_axis(src_tables.astype(jnp.int32)[:, None, :], kept // page_size, axis=2)
    pool_rows = pages * page_size + kept % page_size
    k_ref, v_ref = jax.new_ref(k_pool), jax.new_ref(v_pool)
    pools_per_cta = 1 if split_pools else 2
    stage = plgpu.SMEM((stages, block_rows, head_dim), dtype)
    plgpu.kernel(
        kernel,
        out_type=(),
        grid=(2, num_kv_heads, batch) if split_pools else (num_kv_heads, batch),
        grid_names=("p", "h", "b") if split_pools else ("h", "b"),
        scratch_types=(*[stage] * pools_per_cta,
                       plgpu.Barrier(num_arrivals=pools_per_cta * block_rows, num_barriers=stages)),
        interpret=interpret,
    )(row_layers(layer, batch), pool_rows, dst_tables.astype(jnp.int32), valid.astype(jnp.int32),
      k_ref, v_ref)
    return jax.freeze(k_ref), jax.freeze(v_ref)
