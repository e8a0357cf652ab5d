"""Ragged paged prefill attention as a Mosaic GPU (Hopper) kernel with the FlashAttention-3 structure.

The work items are (query tile, KV head) pairs. An item's 128 rows stack the query heads of the KV head's GQA
group (or a slab of them, see ``gqa_tiling``) head-major over ``tile_tokens`` consecutive tokens of one
request, so every KV block it loads serves all of them. The kernel is persistent: one CTA per SM runs its share
of the items (the item order below). Three warpgroups: a producer issues the TMA loads of the KV blocks from the
pages the page table names (``num_stages`` blocks in flight, running on into the next item; a block spanning
several small pages is one copy per page), and two consumer warpgroups of 64 rows each run ``q @ k^T``, the
online softmax and ``p @ v`` on the tensor cores, ping-ponging on a shared barrier so one warpgroup's softmax
overlaps the other's matmuls; each loads the next item's queries while it writes the current one's output.
Query ``i`` of request ``r`` sits at position ``kv_lens[r] - q_len + i`` and sees the request's cached prefix
plus the earlier rows of its own chunk: KV blocks wholly below the tile's first position run unmasked, the
diagonal blocks masked, and blocks past the tile's last position are never loaded. With blocks of 128 keys, the
last block runs at half width (``q @ k^T``, softmax and ``p @ v`` over its first 64 keys, in a loop of its own
of trip count 0 or 1) when the tile's last position is in its first half: on prompts of ~1k tokens, whose items
run ~6 blocks, that diagonal block is one in six, and half of the tiles need only its first half.

Tiles are cut per request (many short prompts cost what one long one does, up to one partial tile each) and
start on 8-aligned packed rows (the swizzled TMA box of the query tile needs it), so a request's first tile may
begin up to 7 rows early. Each warpgroup writes its rows straight to their packed places: through an unswizzled
staging buffer, as TMA boxes cut (in power-of-two row counts) to the rows that are the tile's own, so
neighbouring requests' rows are never touched. The padding rows past ``cu_q_lens[R]`` are tiles with no KV:
they write zeros.

FP8 pools (``kv_quant``: unit-scale values, the scales applied outside) are fetched into 8-bit staging buffers, half
the bytes of a 16-bit block, and each consumer warpgroup upcasts the block (exactly) into a 16-bit buffer of its
own that its wgmmas read (8-bit wgmma operands must be K-major, which V is not): K's before ``q @ k^T``, V's
while the other warpgroup's ``q @ k^T`` runs. K and V take turns in that buffer (K's scores are read before V is
written), and the staging slot is released as soon as the block is in registers.

Item order: the tiles, listed as cut (each request's last-first, its slabs side by side), are dealt in snake
order: round ``k`` gives items ``[k num_ctas, (k + 1) num_ctas)`` to CTAs ``0, 1, ...`` when ``k`` is even and
``..., 1, 0`` when odd, so the CTA that got a round's largest item of a long prompt gets the next round's
smallest: on one long prompt the busiest CTA ends near the mean, where round-robin leaves one well above it
(``python -m zipage_jax.bench prefill-work``; BENCHMARKS.md, prefill). Round-robin stays as
``item_order="round_robin"``: uniform batches of mid-length prompts favour it. Sorting the tiles of all requests by
their blocks balances further but scatters each request's KV over the whole run (L2 reuse lost), so the order keeps
a request's tiles together.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.paged_decode import check_block_kv, swizzled, upcast_block

ROW_ALIGN = 8  # rows of one tile of the swizzled shared-memory layout: query tiles start on multiples of it
WG_ROWS = 64  # wgmma M: the rows of one consumer warpgroup
CONSUMERS = 2  # consumer warpgroups per CTA (ping-pong)
CTA_ROWS = CONSUMERS * WG_ROWS
MIN_FILL = 112  # stack a whole GQA group when it fills at least this many of the CTA's 128 rows
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per CTA
_LOG2E = math.log2(math.e)


def _check_inputs(q, k_pool, v_pool, cu_q_lens, kv_lens, page_tables):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool/v_pool must both be [L, pages, Hkv, S, D], got {k_pool.shape}, {v_pool.shape}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    if k_pool.shape[4] != head_dim or head_dim not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128 and match the pool, got q {head_dim}, pool {k_pool.shape[4]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    if page_size % 8 or not 8 <= page_size <= 256:
        raise ValueError(f"page size must be a multiple of 8 in [8, 256], got {page_size}")
    num_requests = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if num_requests < 1:
        raise ValueError(f"kv_lens must be [R] with R >= 1, got {kv_lens.shape}")
    if cu_q_lens.shape != (num_requests + 1,):
        raise ValueError(f"cu_q_lens must be [R+1]={num_requests + 1}, got {cu_q_lens.shape}")
    if page_tables.ndim != 2 or page_tables.shape[0] != num_requests:
        raise ValueError(f"page_tables must be [R, P], got {page_tables.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pool.dtype != v_pool.dtype or (
            k_pool.dtype != q.dtype and not is_fp8(k_pool.dtype)):
        raise ValueError(f"q must be a 16-bit float and the pools q's dtype or FP8, got {q.dtype}, {k_pool.dtype}, "
                         f"{v_pool.dtype}")


def gqa_tiling(group):
    """``(heads_per_cta, tile_tokens)``: how many query heads of a GQA group of ``group`` one CTA stacks, over how
    many tokens (a multiple of 8, heads x tokens <= 128 rows).

    The whole group when it fills at least ``MIN_FILL`` rows (groups 1, 2, 4, 8, 16 fill all 128; 3, 5, 7 fill
    120 or 112), else the largest divisor of the group that does (group 6 stacks 3 heads of 40 tokens, group 12
    4 heads of 32); a single head always fills 128 rows.
    """
    def rows(heads):
        return heads * ROW_ALIGN * (CTA_ROWS // ROW_ALIGN // heads)

    heads = max(h for h in range(1, min(group, CTA_ROWS // ROW_ALIGN) + 1) if group % h == 0 and rows(h) >= MIN_FILL)
    return heads, rows(heads) // heads


def warpgroup_runs(heads, tile_tokens):
    """For each consumer warpgroup, the runs ``(head, first token, end token, first row)`` its 64 rows hold: CTA
    row ``h * tile_tokens + t`` is token ``t`` of the CTA's head ``h``; rows past ``heads * tile_tokens`` are
    padding (computed, never loaded nor stored). Every run is a multiple of 8 rows."""
    runs = []
    for wg in range(CONSUMERS):
        lo, hi = wg * WG_ROWS, (wg + 1) * WG_ROWS
        wg_runs = []
        for h in range(heads):
            start, stop = max(lo, h * tile_tokens), min(hi, (h + 1) * tile_tokens)  # head h's rows in [lo, hi)
            if start < stop:
                wg_runs.append((h, start - h * tile_tokens, stop - h * tile_tokens, start - lo))
        runs.append(tuple(wg_runs))
    return tuple(runs)


def query_tiles(cu_q_lens, num_tokens, tile_tokens):
    """Static-size tiling of the packed rows into ``tile_tokens``-token tiles, each inside one request's chunk.

    The padding rows ``[cu_q_lens[R], num_tokens)`` are one more chunk, request ``R`` (no KV: its tiles write
    zeros). A chunk's tiles start ``cu_q_lens[r] % 8`` rows before it, on an 8-aligned packed row, and are
    listed last-first. Returns ``(tile_request [N], tile_row [N])``, the request and first packed row of each tile,
    with ``N = cdiv(T + 7 (R + 1), tile_tokens) + R + 1``; unused tiles get request ``R`` and row ``T`` (no rows).
    """
    num_requests = cu_q_lens.shape[0] - 1
    num_tiles = pl.cdiv(num_tokens + (ROW_ALIGN - 1) * (num_requests + 1), tile_tokens) + num_requests + 1
    starts = cu_q_lens
    ends = jnp.append(cu_q_lens[1:], num_tokens)
    shift = starts % ROW_ALIGN
    tiles_per_chunk = jnp.where(ends > starts, (ends - starts + shift + tile_tokens - 1) // tile_tokens, 0)
    tile_end = jnp.cumsum(tiles_per_chunk)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    request = jnp.clip(jnp.searchsorted(tile_end, tiles, side="right"), 0, num_requests).astype(jnp.int32)
    last_first = tile_end[request] - 1 - tiles  # the chunk's last tile first
    row = starts[request] - shift[request] + last_first * tile_tokens
    used = tiles < tile_end[-1]
    return (jnp.where(used, request, num_requests).astype(jnp.int32),
            jnp.where(used, row, num_tokens).astype(jnp.int32))


def _issue_kv(ref, smem, barrier, page_tables_ref, request, layer, kv_head, block, last_live_page, *, block_kv,
              page_size):
    """TMA copies of KV block ``block`` of ``request`` (one copy per page it spans) into ``smem``."""
    token0 = block * block_kv
    if block_kv <= page_size:  # The block is a slice of one page.
        page = page_tables_ref[request, token0 // page_size]
        rows = pl.ds(token0 % page_size, block_kv)
        plgpu.copy_gmem_to_smem(ref.at[layer, page, kv_head, rows], smem, barrier)
        return
    for j in range(block_kv // page_size):  # Pages past the live ones: the last live page again (masked).
        page = page_tables_ref[request, lax.min(token0 // page_size + j, last_live_page)]
        plgpu.copy_gmem_to_smem(ref.at[layer, page, kv_head], smem.at[pl.ds(j * page_size, page_size)], barrier)


def tile_span(row0, chunk_start, chunk_end, kv_len, *, tile_tokens, block_kv):
    """``(pos0, first, end, last_pos, num_blocks, unmasked)`` of the tile whose token 0 is packed row ``row0``:
    token 0's position, the tile's own tokens ``[first, end)``, the last own token's position, the KV blocks it
    runs and how many of them lie wholly below every own token's position (run unmasked). Kernel scalars or jnp
    arrays of tiles alike, so the tests of the item order count the blocks the kernel runs."""
    pos0 = kv_len - (chunk_end - chunk_start) + (row0 - chunk_start)
    first = jnp.clip(chunk_start - row0, 0, tile_tokens)
    end = jnp.clip(chunk_end - row0, 0, tile_tokens)
    last_pos = jnp.minimum(pos0 + end - 1, kv_len - 1)
    num_blocks = jnp.where(end > first, jnp.maximum(last_pos + 1, 0) + block_kv - 1, 0) // block_kv
    unmasked = jnp.clip(jnp.maximum(pos0 + first + 1, 0) // block_kv, 0, num_blocks)
    return pos0, first, end, last_pos, num_blocks, unmasked


def cta_item(cta, k, num_ctas, snake):
    """The index of the ``k``-th item of CTA ``cta``: round ``k`` deals items ``[k num_ctas, (k + 1) num_ctas)``
    to CTAs 0, 1, ... (round-robin), or with ``snake`` in odd rounds to CTAs ..., 1, 0."""
    if not snake:
        return k * num_ctas + cta
    return k * num_ctas + jnp.where(lax.rem(k, 2) == 0, cta, num_ctas - 1 - cta)


def cta_item_count(cta, num_items, num_ctas, snake):
    """How many of the ``num_items`` items ``cta_item`` deals CTA ``cta``: the whole rounds, and one of the last
    partial round when it reaches that CTA (the first CTAs in an even round, the last ones in an odd one)."""
    rounds, rest = divmod(num_items, num_ctas)
    gets_one = cta >= num_ctas - rest if snake and rounds % 2 else cta < rest
    return rounds + jnp.where(gets_one, 1, 0)


class _Item:
    """One work item of a CTA, a (query tile, head slab) pair, read off the tile tables: its request, rows,
    positions and the KV blocks it runs (the scalars every warpgroup derives the same way)."""

    def __init__(self, index, refs, *, num_slabs, slabs, heads, tile_tokens, block_kv, narrow_keys):
        layer_ref, bounds_ref, kv_lens_ref, tile_request_ref, tile_row_ref = refs
        tile, slab = index // num_slabs, index % num_slabs  # the slabs of one tile run side by side
        self.kv_head, self.head0 = slab // slabs, slab * heads
        self.layer = layer_ref[0]
        self.request = tile_request_ref[tile]
        self.row0 = tile_row_ref[tile]  # packed row of the tile's token 0 (a multiple of 8)
        self.kv_len = kv_lens_ref[self.request]
        self.pos0, self.first, self.end, last_pos, self.num_blocks, self.unmasked = tile_span(
            self.row0, bounds_ref[self.request], bounds_ref[self.request + 1], self.kv_len,
            tile_tokens=tile_tokens, block_kv=block_kv)
        # 1 when the last block is needed below key narrow_keys only (it is then masked: past the first position).
        self.narrow = 0 if not narrow_keys else jnp.where(
            (self.num_blocks > 0) & (lax.rem(last_pos, block_kv) < narrow_keys), 1, 0)


def _prefill_kernel(layer_ref, bounds_ref, kv_lens_ref, page_tables_ref, tile_request_ref, tile_row_ref, q_ref,
                    k_ref, v_ref, o_ref, *, q_smem, k_smem, v_smem, o_stage, q_bars, k_bars, v_bars, k_consumed,
                    v_consumed, schedule, p_smem=None, wide=None, heads, tile_tokens, slabs, num_slabs, num_items,
                    num_ctas, snake, sm_scale, block_kv, narrow_keys, num_stages, page_size, p_in_registers):
    cta = lax.axis_index("c")
    wg = lax.axis_index("wg")
    my_items = cta_item_count(cta, num_items, num_ctas, snake)
    runs = warpgroup_runs(heads, tile_tokens)
    head_dim, dtype = q_smem.shape[-1], q_smem.dtype
    refs = (layer_ref, bounds_ref, kv_lens_ref, tile_request_ref, tile_row_ref)

    def item(k):
        return _Item(cta_item(cta, k, num_ctas, snake), refs, num_slabs=num_slabs, slabs=slabs, heads=heads,
                     tile_tokens=tile_tokens, block_kv=block_kv, narrow_keys=narrow_keys)

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def load_q(it):
        """This warpgroup's rows of the item's query tile, one TMA copy per run of rows (signals its q barrier)."""
        for w in range(CONSUMERS):
            @pl.when((wg == w) & (it.num_blocks > 0))
            @jax.named_scope("load_q")  # the regions of the profiler trace (ragged_prefill's profile_dir)
            def _():
                for h, t0, t1, r in runs[w]:
                    rows = pl.ds(pl.multiple_of(it.row0 + t0, ROW_ALIGN), t1 - t0)
                    plgpu.copy_gmem_to_smem(q_ref.at[rows, it.head0 + h], q_smem.at[w, pl.ds(r, t1 - t0)],
                                            q_bars[w])

    def wait_q(it):
        for w in range(CONSUMERS):
            @pl.when((wg == w) & (it.num_blocks > 0))
            def _():
                plgpu.barrier_wait(q_bars[w])

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        my_q = q_smem.at[wg]

        @pl.when(my_items > 0)
        def _():
            load_q(item(0))

        def one_item(k, step0):  # step0: KV blocks this CTA ran before (its slots and barrier phases go on)
            it = item(k)
            wait_q(it)
            m_i = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((WG_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((WG_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(it.num_blocks > 0)
            def _():
                plgpu.barrier_wait(k_bars.at[lax.rem(step0, num_stages)])

            pl.when(wg == 1)(schedule_barrier)  # warpgroup 1 starts one phase behind: the ping-pong
            # Row r is token (64 wg + r) % tile_tokens of its head.
            rows = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
            row_pos = it.pos0 + lax.rem(rows + wg * WG_ROWS, tile_tokens)

            def step(block, carry, *, masked, keys=block_kv):  # keys: the block's first keys it computes
                acc, m_i, l_i = carry
                slot = lax.rem(step0 + block, num_stages)
                k_block, v_block = k_smem.at[slot], v_smem.at[slot]
                if keys < block_kv:
                    k_block, v_block = k_block.at[pl.ds(0, keys)], v_block.at[pl.ds(0, keys)]
                if wide is not None:  # FP8: this warpgroup's 16-bit copy of the block, the 8-bit slot released
                    with jax.named_scope("upcast"):
                        k_block = upcast_block(k_block, wide.at[wg], WG_ROWS)
                    plgpu.barrier_arrive(k_consumed.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, my_q, k_block.T)
                    schedule_barrier()  # the other warpgroup's p @ v runs while ours is in flight
                    return acc_ref[...]

                with jax.named_scope("qk"):
                    s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, keys), jnp.float32))
                if wide is None:
                    plgpu.barrier_arrive(k_consumed.at[slot])
                with jax.named_scope("softmax"):
                    if masked:  # each row sees the slots up to its position
                        cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                        limit = lax.broadcast_in_dim(row_pos - block * block_kv, s.shape, [0])
                        s = jnp.where(cols <= limit, s, -jnp.inf)
                    scale = sm_scale * _LOG2E  # m_i and the exponents are in base 2, the scale folded into an FMA
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                with jax.named_scope("wait_v"):
                    plgpu.barrier_arrive(schedule)  # softmax done
                    plgpu.barrier_wait(v_bars.at[slot])
                    if wide is not None:  # K's scores are read: V takes the buffer while the other's q @ k^T runs
                        v_block = upcast_block(v_block, wide.at[wg], WG_ROWS)
                        plgpu.barrier_arrive(v_consumed.at[slot])
                    plgpu.barrier_wait(schedule)  # the tensor cores are ours

                def wait_next_k():
                    @pl.when(block + 1 < it.num_blocks)
                    def _():
                        plgpu.barrier_wait(k_bars.at[lax.rem(step0 + block + 1, num_stages)])

                with jax.named_scope("pv"):
                    if p_in_registers:  # FA3's form: p stays in registers, p @ v accumulates into acc in place
                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, v_block)
                            wait_next_k()

                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    else:  # the form interpret mode runs: p through shared memory, a fresh accumulator
                        my_p = p_smem.at[wg, :, pl.ds(0, keys)]
                        my_p[...] = p16
                        plgpu.commit_smem()

                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, my_p, v_block)
                            wait_next_k()
                            return acc_ref[...]

                        acc = acc + pl.run_scoped(pv, plgpu.ACC((WG_ROWS, head_dim), jnp.float32))
                if wide is None:
                    plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, it.unmasked, functools.partial(step, masked=False), (acc, m_i, l_i))
            narrow_from = it.num_blocks - it.narrow
            carry = lax.fori_loop(it.unmasked, narrow_from, functools.partial(step, masked=True), carry)
            if narrow_keys:  # the last block at half width (trip count 0 or 1) when no own row sees its upper half
                carry = lax.fori_loop(narrow_from, it.num_blocks,
                                      functools.partial(step, masked=True, keys=narrow_keys), carry)
            acc, _, l_i = carry
            pl.when(wg == 0)(schedule_barrier)

            @pl.when(k + 1 < my_items)
            def _():  # the query tile is free: the next item's loads run under this one's epilogue
                load_q(item(k + 1))

            @pl.when(it.end > it.first)
            @jax.named_scope("store")
            def _():
                # The padding tiles' rows attend to nothing (acc = 0, l = 0): they become zeros.
                inv_l = jnp.where(l_i > 0, 1.0 / l_i, 0.0)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's stores have left the staging
                o_stage.at[wg][...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
                plgpu.commit_smem()
                for w in range(CONSUMERS):
                    @pl.when(wg == w)
                    def _():
                        for h, t0, t1, r in runs[w]:
                            _store_rows(o_stage.at[w], o_ref, h + it.head0, it.row0, t0, t1, r, it.first, it.end)

            return step0 + it.num_blocks

        lax.fori_loop(0, my_items, one_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def one_item(k, step0):
            it = item(k)
            issue = jax.named_scope("load_kv")(functools.partial(
                _issue_kv, page_tables_ref=page_tables_ref, request=it.request, layer=it.layer,
                kv_head=it.kv_head, last_live_page=lax.max(it.kv_len - 1, 0) // page_size, block_kv=block_kv,
                page_size=page_size))

            @pl.loop(0, it.num_blocks)
            def _(block):
                step = step0 + block
                slot = lax.rem(step, num_stages)

                @pl.when(step >= num_stages)
                def _():
                    plgpu.barrier_wait(k_consumed.at[slot])
                issue(k_ref, k_smem.at[slot], k_bars.at[slot], block=block)

                @pl.when(step >= num_stages)
                def _():
                    plgpu.barrier_wait(v_consumed.at[slot])
                issue(v_ref, v_smem.at[slot], v_bars.at[slot], block=block)

            return step0 + it.num_blocks

        steps = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        @pl.loop(lax.max(steps - num_stages, 0), steps)
        def _(step):  # observe the last releases too, so every barrier phase is waited for
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])


def _store_rows(stage, o_ref, head, row0, t0, t1, stage_row0, first, end):
    """TMA-store the tile's own tokens ``[first, end)`` of the run holding tokens ``[t0, t1)`` of ``head`` (staged
    from row ``stage_row0``): the whole run at once, else in power-of-two row counts, so no other row is written."""
    lo, hi = jnp.clip(first, t0, t1), jnp.clip(end, t0, t1)

    def store(token, size):
        plgpu.copy_smem_to_gmem(stage.at[pl.ds(stage_row0 + token - t0, size)],
                                o_ref.at[pl.ds(row0 + token, size), head])

    @pl.when((lo == t0) & (hi == t1))
    def _whole():
        store(t0, t1 - t0)

    @pl.when(((lo > t0) | (hi < t1)) & (hi > lo))
    def _pieces():
        token, count = lo, hi - lo
        size = 1 << ((t1 - t0).bit_length() - 1)
        while size:
            pl.when((count & size) != 0)(functools.partial(store, token, size))
            token = token + (count & size)
            size //= 2


def _smem_bytes(head_dim, block_kv, num_stages, itemsize, kv_itemsize, p_in_registers, profile_space):
    tiles = CONSUMERS * WG_ROWS * head_dim * 2  # query tiles and output staging
    kv = 2 * num_stages * block_kv * head_dim * kv_itemsize
    wide = CONSUMERS * block_kv * head_dim if kv_itemsize < itemsize else 0  # FP8: the upcast buffers
    p = 0 if p_in_registers else CONSUMERS * WG_ROWS * block_kv
    profile = (CONSUMERS + 1) * profile_space * 4 * 4  # a range: 2 events of 2 int32 entries, per warpgroup
    return (tiles + wide + p) * itemsize + kv + profile


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_stages", "num_ctas", "item_order",
                                             "half_diagonal", "interpret", "profile_dir"))
def ragged_prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale, *, block_kv=128,
                   num_stages=2, num_ctas=None, item_order="snake", half_diagonal=True, interpret=False,
                   profile_dir=None):
    """Causal attention of packed chunks ``q [T, Hq, D]`` over their requests' pages; same result as
    ``ragged_prefill_ref``. The pools are q's dtype or FP8 (unit-scale values: ``kv_quant``). ``num_ctas``:
    persistent CTAs (default: one per SM of the GPU, 4 elsewhere).
    ``item_order``: how the items are dealt to the CTAs, ``snake`` (the module docstring) or ``round_robin``
    (``cta, cta + num_ctas, ...``).
    ``half_diagonal``: with ``block_kv`` 128, an item's last block runs on its first 64 keys when no own token
    sees past them, else (and always with other block sizes) at full width.
    ``interpret`` may be ``plgpu.InterpretGPUParams()`` to run on CPU; ``profile_dir``
    makes each call write a Mosaic GPU profiler trace there (Perfetto JSON; per warpgroup, the regions load_q,
    upcast (FP8), qk, softmax, wait_v, pv, store, load_kv of every CTA: profile small problems)."""
    _check_inputs(q, k_pool, v_pool, cu_q_lens, kv_lens, page_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pool.shape[2], k_pool.shape[3]
    check_block_kv(block_kv, page_size, num_stages)
    p_in_registers = not interpret  # interpret mode runs wgmma on shared-memory operands only
    # Profiler ranges per warpgroup: 4 a KV block for the consumers (2 for the producer), and a few more.
    profile_space = 4 * pl.cdiv(page_tables.shape[1] * page_size, block_kv) + 4 if profile_dir else 0
    fp8 = is_fp8(k_pool.dtype)
    if _smem_bytes(head_dim, block_kv, num_stages, q.dtype.itemsize, k_pool.dtype.itemsize, p_in_registers,
                   profile_space) > SMEM_BYTES:
        raise ValueError(f"block_kv {block_kv} x num_stages {num_stages} needs more shared memory than a CTA has")
    group = num_q_heads // num_kv_heads
    heads, tile_tokens = gqa_tiling(group)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    bounds = jnp.append(cu_q_lens, num_tokens)  # the padding rows are one more chunk, with no KV
    kv_lens = jnp.append(kv_lens.astype(jnp.int32), 0)
    tile_request, tile_row = query_tiles(cu_q_lens, num_tokens, tile_tokens)
    if item_order not in ("snake", "round_robin"):
        raise ValueError(f"item_order must be snake or round_robin, got {item_order!r}")
    # The swizzled query box needs a whole number of 8-row tiles (rows past T are zero-filled by the TMA unit;
    # interpret mode has no such unit, so it gets them as padding).
    pad = -num_tokens % ROW_ALIGN + (tile_tokens if interpret else 0)
    q_padded = jnp.pad(q, ((0, pad), (0, 0), (0, 0))) if pad else q
    runs = warpgroup_runs(heads, tile_tokens)
    num_slabs = num_q_heads // heads
    num_items = tile_request.shape[0] * num_slabs
    if num_ctas is None:
        device = jax.devices()[0]
        num_ctas = device.core_count if device.platform == "gpu" else 4
    num_ctas = min(num_ctas, num_items)
    kernel = functools.partial(
        _prefill_kernel, heads=heads, tile_tokens=tile_tokens, slabs=group // heads, num_slabs=num_slabs,
        num_items=num_items, num_ctas=num_ctas, snake=item_order == "snake", sm_scale=float(sm_scale),
        block_kv=block_kv, narrow_keys=block_kv // 2 if half_diagonal and block_kv == 128 else 0,
        num_stages=num_stages, page_size=page_size, p_in_registers=p_in_registers)
    copies = max(block_kv // page_size, 1)
    wg_tiles = (CONSUMERS, WG_ROWS, head_dim)
    kv_buf = plgpu.SMEM((num_stages, block_kv, head_dim), k_pool.dtype, transforms=() if fp8 else swizzled())
    scratch = dict(
        q_smem=plgpu.SMEM(wg_tiles, q.dtype, transforms=swizzled()),
        k_smem=kv_buf, v_smem=kv_buf,
        o_stage=plgpu.SMEM(wg_tiles, q.dtype),  # unswizzled: a TMA box may start on any of its rows
        q_bars=[plgpu.Barrier(num_arrivals=len(r)) for r in runs],
        k_bars=plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        v_bars=plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        k_consumed=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        v_consumed=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        schedule=plgpu.Barrier(num_arrivals=CONSUMERS))
    if fp8:
        scratch["wide"] = plgpu.SMEM((CONSUMERS, block_kv, head_dim), q.dtype, transforms=swizzled())
    if not p_in_registers:
        scratch["p_smem"] = plgpu.SMEM((CONSUMERS, WG_ROWS, block_kv), q.dtype, transforms=swizzled())
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_ctas,),
        grid_names=("c",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, profile_space=profile_space,
                                             profile_dir=profile_dir or "", profile_bounds_check=bool(profile_dir)),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), bounds, kv_lens, page_tables.astype(jnp.int32), tile_request,
      tile_row, q_padded, k_pool, v_pool)
