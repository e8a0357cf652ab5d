"""Pallas kernels under Mosaic GPU interpret mode (CPU) against the pure-jnp references.

Fresh random inputs each run (the seed is in the failure message); interpret mode fills every buffer it
allocates (outputs included) with NaN, so a row the kernel never writes fails the comparison.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # the race detector's state
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.bench import PREFILL_FORMS, decode_variants, prefill_lengths, prefill_variants
from pallas_kernels.paged_decode import merge_splits, paged_decode
from pallas_kernels.ragged_prefill import (cta_item, cta_item_count, gqa_tiling, query_tiles,
                                           ragged_prefill, tile_span, warpgroup_runs)
from pallas_kernels.reference import paged_decode_ref, ragged_prefill_ref
from zipage_jax.benchmarks import prefill_work
from helpers import assert_close, shuffled_page_tables
from seeds import fresh_seed, seeded_rng

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan")


def random_pool(rng, num_layers, num_pages, num_kv_heads, page_size, head_dim):
    shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))


def random_page_tables(rng, kv_lens, pages_per_row, page_size, num_pages):
    """Distinct random pages per live slot; unused entries point at the null page 0."""
    return shuffled_page_tables(rng, [-(-int(n) // page_size) for n in kv_lens], pages_per_row, num_pages)


DECODE_CASES = [
    # group, head_dim, page_size, block_kv, num_stages, num_splits, kv_lens
    (1, 64, 16, 64, 2, 2, [70, 0, 33]),         # a block spans 4 pages; empty padding row; 2 splits
    (4, 128, 128, 64, 3, 1, [200, 129]),        # a block is half a page
    (8, 64, 64, 64, 2, 3, [150, 0, 64, 1]),     # one page per block; splits past a row's end are empty
    (4, 64, 16, 64, 2, 1, [40, 0, 17]),         # one split: no merge, the empty row still 0
]


@pytest.mark.parametrize("group,head_dim,page_size,block_kv,num_stages,num_splits,kv_lens", DECODE_CASES)
def test_paged_decode_matches_reference(group, head_dim, page_size, block_kv, num_stages, num_splits, kv_lens):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_kv_heads, layer = 2, 1
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1  # one spare null entry per row
    num_pages = len(kv_lens) * pages_per_row + 2
    k_pool, v_pool = random_pool(rng, 2, num_pages, num_kv_heads, page_size, head_dim)
    tables = random_page_tables(rng, kv_lens, pages_per_row, page_size, num_pages)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), num_kv_heads * group, head_dim)), jnp.bfloat16)
    lens = jnp.asarray(kv_lens, jnp.int32)
    scale = head_dim ** -0.5
    out = paged_decode(q, k_pool, v_pool, layer, lens, tables, scale, block_kv=block_kv,
                       num_stages=num_stages, num_splits=num_splits, interpret=INTERPRET)
    ref = paged_decode_ref(q, k_pool, v_pool, layer, lens, tables, scale)
    assert_close(out, ref, seed)
    empty = np.asarray(kv_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all()


def test_merge_splits_equals_softmax_over_all_slots():
    rng = seeded_rng()
    scores = rng.standard_normal((2, 3, 12)).astype(np.float32)  # [rows, heads, slots] in log2 units
    values = rng.standard_normal((2, 3, 12, 5)).astype(np.float32)
    weights = np.exp2(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("rhk,rhkd->rhd", weights / weights.sum(-1, keepdims=True), values)
    parts, lses = [], []
    for chunk in np.split(np.arange(12), 3):
        s = scores[..., chunk]
        w = np.exp2(s - s.max(-1, keepdims=True))
        parts.append(np.einsum("rhk,rhkd->rhd", w / w.sum(-1, keepdims=True), values[..., chunk, :]))
        lses.append(s.max(-1) + np.log2(w.sum(-1)))
    parts.append(np.full_like(parts[0], np.nan))  # an empty split: NaN output, -inf lse
    lses.append(np.full_like(lses[0], -np.inf))
    out = merge_splits(jnp.asarray(np.stack(parts, 1)[:, None]), jnp.asarray(np.stack(lses, 1)[:, None]))
    np.testing.assert_allclose(np.asarray(out)[:, 0], expected, rtol=1e-5, atol=1e-5)
    # one split is its own output; a row whose only split is empty comes out 0, not NaN
    one = merge_splits(jnp.asarray(np.stack([parts[0], parts[-1]])[:, :, None]),  # [B=2, Hkv, 1, G, D]
                       jnp.asarray(np.stack([lses[0], lses[-1]])[:, :, None]))
    assert one.shape == (2,) + parts[0].shape
    np.testing.assert_array_equal(np.asarray(one)[0], parts[0])
    assert (np.asarray(one)[1] == 0).all()


@pytest.mark.parametrize("bad", ["head_dim", "group", "kv_lens", "block_kv"])
def test_paged_decode_rejects_bad_input(bad):
    rng = seeded_rng()
    k_pool, v_pool = random_pool(rng, 1, 4, 2, 16, 64)
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    lens = jnp.asarray([3, 5], jnp.int32)
    tables = jnp.ones((2, 2), jnp.int32)
    kwargs = {}
    if bad == "head_dim":
        q = jnp.zeros((2, 4, 32), jnp.bfloat16)
    elif bad == "group":
        q = jnp.zeros((2, 3, 64), jnp.bfloat16)
    elif bad == "kv_lens":
        lens = jnp.asarray([3], jnp.int32)
    else:
        kwargs["block_kv"] = 48
    with pytest.raises(ValueError, match=bad.split("_")[0]):
        paged_decode(q, k_pool, v_pool, 0, lens, tables, 0.1, interpret=INTERPRET, **kwargs)


BEFORE = PREFILL_FORMS["before"]  # the previous forms, the bench's mosaic_before row
# With KV blocks of 128, a tile whose last position p has p % 128 < 64 runs its last block at half width.
HALVES = ([100, 0, 45, 77], [300, 2, 45, 77])  # last tiles end in both halves of a block (positions 299, 295, 263,
#   231; 44, 27; 76, 62, 30), behind a prefix (300 keys for 100 queries: unmasked, full masked and half blocks in
#   one tile), an idle request, chunks at unaligned rows
PREFILL_CASES = [
    # group, head_dim, page_size, block_kv, CTAs, q_lens, kv_lens, padding rows, options; the race detector on the
    # first two
    (4, 64, 16, 64, 2, [70, 0, 5], [90, 3, 5], 5, {}),   # chunk behind a prefix; idle request; chunk at row 70
    (4, 128, 64, 128, 3, *HALVES, 3, {}),
    (1, 128, 64, 64, 1, [3, 70], [130, 70], 0, {}),      # one head: a 128-token tile split across the warpgroups
    (8, 64, 128, 64, 3, [40, 1], [40, 200], 3, {}),      # block inside a page; single-token chunk at position 199
    (5, 64, 32, 128, 4, [30, 17], [30, 60], 2, {}),      # odd group: 5 heads x 24 tokens; a block spans 4 pages
    (1, 64, 32, 128, 2, [150, 5], [150, 40], 2, {}),     # one head: last positions 127 (full), 149 and 39 (half)
    (8, 128, 128, 128, 4, [40, 33], [40, 100], 0, {}),   # 8 heads x 16 tokens: last positions 39 .. 15, 99 .. 82
    (4, 128, 64, 128, 3, *HALVES, 3, BEFORE),
    (8, 128, 128, 128, 4, [40, 33], [40, 100], 0, dict(item_order="round_robin")),
]  # the previous forms differ from today's only in the item order and, at block_kv 128, the diagonal block's width


@pytest.mark.parametrize("group,head_dim,page_size,block_kv,num_ctas,q_lens,kv_lens,padding,options", PREFILL_CASES)
def test_ragged_prefill_matches_reference(group, head_dim, page_size, block_kv, num_ctas, q_lens, kv_lens, padding,
                                          options):
    """Each persistent CTA runs several (tile, head slab) items, its KV pipeline going on across them."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_kv_heads, layer = 1, 1
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1
    num_pages = len(kv_lens) * pages_per_row + 2
    k_pool, v_pool = random_pool(rng, 2, num_pages, num_kv_heads, page_size, head_dim)
    tables = random_page_tables(rng, kv_lens, pages_per_row, page_size, num_pages)
    num_tokens = sum(q_lens) + padding
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    scale = head_dim ** -0.5
    races = PREFILL_CASES.index((group, head_dim, page_size, block_kv, num_ctas, q_lens, kv_lens, padding,
                                 options)) < 2
    interpret = INTERPRET
    if races:
        gpu_interpret.reset_gpu_interpret_mode_state()
        interpret = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
    out = ragged_prefill(q, k_pool, v_pool, layer, cu, lens, tables, scale, block_kv=block_kv, num_ctas=num_ctas,
                         interpret=interpret, **options)
    ref = ragged_prefill_ref(q, k_pool, v_pool, layer, cu, lens, tables, scale)
    assert_close(out, ref, seed)
    assert (np.asarray(out, np.float32)[sum(q_lens):] == 0).all()
    assert not (races and gpu_interpret.get_races().races_found), "data race between warpgroups or TMA copies"


def test_query_tiles_cover_every_row_once_last_tile_first():
    q_lens = np.array([70, 0, 5, 128, 1, 63])
    num_tokens, tile_tokens = int(q_lens.sum()) + 7, 32
    cu_np = np.concatenate([[0], np.cumsum(q_lens)])
    bounds = np.append(cu_np, num_tokens)  # the padding rows are one more chunk
    tile_request, tile_row = map(np.asarray, query_tiles(jnp.asarray(cu_np, jnp.int32), num_tokens, tile_tokens))
    covered = []
    for r, row in zip(tile_request, tile_row):
        own = range(max(row, bounds[r]), min(row + tile_tokens, bounds[r + 1]))
        if own:
            assert row % 8 == 0 and row > bounds[r] - 8
        covered += list(own)
    assert sorted(covered) == list(range(num_tokens))
    for r in range(len(q_lens) + 1):  # a chunk's tiles run last-first
        rows = tile_row[(tile_request == r) & (tile_row < num_tokens)]
        assert (np.diff(rows) < 0).all()


@pytest.mark.parametrize("snake", [False, True])
def test_cta_items_deal_every_item_to_one_cta(snake):
    for num_ctas in range(1, 7):
        for num_items in range(num_ctas, 4 * num_ctas + 2):
            dealt = []
            for cta in range(num_ctas):
                count = int(cta_item_count(jnp.int32(cta), num_items, num_ctas, snake))
                dealt += [int(cta_item(jnp.int32(cta), jnp.int32(k), num_ctas, snake)) for k in range(count)]
            assert sorted(dealt) == list(range(num_items)), (num_ctas, num_items)
    # the snake: round 1 runs backwards
    assert [int(cta_item(jnp.int32(c), jnp.int32(1), 3, snake)) for c in range(3)] == ([5, 4, 3] if snake
                                                                                       else [3, 4, 5])


def test_snake_order_evens_one_long_prompt():
    """One 8k prompt's tiles as cut (last-first, so most blocks first), dealt in snake order: the busiest of 132
    CTAs within 1 % of the mean, as the greedy longest-first (`bench prefill-work`), where round-robin
    gives the first CTAs the largest item of every round (~6 % above)."""
    lengths = prefill_lengths("1x8192")
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    num_tokens, tile_tokens, block_kv, num_slabs, num_ctas = int(cu[-1]), 32, 128, 8, 132
    bounds, kv_lens = jnp.append(cu, num_tokens), jnp.append(jnp.asarray(lengths), 0)
    tile_request, tile_row = query_tiles(cu, num_tokens, tile_tokens)
    blocks = tile_span(tile_row, bounds[tile_request], bounds[tile_request + 1], kv_lens[tile_request],
                       tile_tokens=tile_tokens, block_kv=block_kv)[4]
    blocks = np.repeat(np.asarray(blocks), num_slabs)  # a tile's slabs side by side

    def busiest_over_mean(snake):
        ctas = jnp.arange(num_ctas)[:, None]
        rounds = jnp.arange(-(-len(blocks) // num_ctas))[None]
        items = np.asarray(cta_item(ctas, rounds, num_ctas, snake))
        dealt = np.asarray(rounds < cta_item_count(ctas, len(blocks), num_ctas, snake))
        loads = np.where(dealt, blocks[np.where(dealt, items, 0)], 0).sum(1)
        return loads.max() / loads.mean()

    greedy = prefill_work.busiest_over_mean(blocks, num_ctas, "longest-first")
    assert busiest_over_mean(snake=True) < min(1.01, greedy + 0.01)
    assert busiest_over_mean(snake=False) > 1.05


def test_bench_decode_rows_name_their_knobs():
    rows = decode_variants(["128:3:0", "64:2:4:upcast"])
    assert rows == {"mosaic": {}, "mosaic_b128_s3_k0": dict(block_kv=128, num_stages=3, num_splits=None),
                    "mosaic_b64_s2_k4_upcast": dict(block_kv=64, num_stages=2, num_splits=4, fp8_qk=False)}
    with pytest.raises(ValueError, match="variants"):
        decode_variants(["64:2:0:overlap"])


def test_bench_prefill_rows_switch_each_lever_off():
    rows = prefill_variants(["round_robin", "wide_diagonal", "before", "64:2"])
    assert list(rows) == ["mosaic", "mosaic_round_robin", "mosaic_wide_diagonal", "mosaic_before", "mosaic_b64_s2"]
    assert rows["mosaic"] == {} and rows["mosaic_before"] == rows["mosaic_round_robin"] | rows["mosaic_wide_diagonal"]


@pytest.mark.parametrize("group", range(1, 33))
def test_gqa_tiling_stacks_heads_in_runs_of_whole_row_tiles(group):
    heads, tile_tokens = gqa_tiling(group)
    assert group % heads == 0 and tile_tokens % 8 == 0 and 112 <= heads * tile_tokens <= 128
    rows = []
    for wg, runs in enumerate(warpgroup_runs(heads, tile_tokens)):
        for head, t0, t1, row in runs:
            assert t0 % 8 == 0 and t1 % 8 == 0 and row % 8 == 0
            rows += [(head, t, wg * 64 + row + t - t0) for t in range(t0, t1)]
    assert sorted(rows) == [(h, t, h * tile_tokens + t) for h in range(heads) for t in range(tile_tokens)]


@pytest.mark.parametrize("bad", ["cu_q_lens", "page_tables", "head dim", "item_order"])
def test_ragged_prefill_rejects_bad_input(bad):
    rng = seeded_rng()
    k_pool, v_pool = random_pool(rng, 1, 4, 1, 16, 64)
    q = jnp.zeros((8, 2, 64), jnp.bfloat16)
    cu, lens, tables = jnp.asarray([0, 3, 8], jnp.int32), jnp.asarray([3, 5], jnp.int32), jnp.ones((2, 2), jnp.int32)
    if bad == "cu_q_lens":
        cu = jnp.asarray([0, 8], jnp.int32)
    elif bad == "page_tables":
        tables = jnp.ones((3, 2), jnp.int32)
    elif bad == "head dim":
        q = jnp.zeros((8, 2, 32), jnp.bfloat16)
    order = "sorted" if bad == "item_order" else "snake"
    with pytest.raises(ValueError, match=bad):
        ragged_prefill(q, k_pool, v_pool, 0, cu, lens, tables, 0.1, item_order=order, interpret=INTERPRET)


LOWERING_CASES = [
    # kernel, group, head_dim, page_size, block_kv; "prefill" with block_kv 128 lowers the half-width diagonal block
    ("decode", 4, 128, 16, 128),
    ("decode", 8, 64, 256, 64),
    ("decode", 1, 64, 64, 64),
    ("prefill", 4, 128, 128, 128),
    ("prefill", 1, 64, 32, 128),
    ("prefill", 5, 128, 256, 64),
    ("prefill_before", 4, 128, 128, 128),  # the previous forms, timed against (BEFORE)
]


@pytest.mark.parametrize("kernel,group,head_dim,page_size,block_kv", LOWERING_CASES)
def test_kernels_lower_for_hopper(kernel, group, head_dim, page_size, block_kv):
    """Mosaic GPU layout inference runs at lowering, so layout errors show up on CPU without a GPU."""
    pool = jax.ShapeDtypeStruct((2, 33, 2, page_size, head_dim), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    if kernel == "decode":
        fn = functools.partial(paged_decode, layer=1, sm_scale=0.1, block_kv=block_kv)
        args = (jax.ShapeDtypeStruct((4, 2 * group, head_dim), jnp.bfloat16), pool, pool)
        kwargs = dict(kv_lens=i32(4), page_tables=i32(4, 8))
    else:
        kernel_fn = dict(prefill=ragged_prefill, prefill_before=functools.partial(ragged_prefill, **BEFORE))[kernel]
        fn = functools.partial(kernel_fn, layer=1, sm_scale=0.1, block_kv=block_kv)
        args = (jax.ShapeDtypeStruct((100, 2 * group, head_dim), jnp.bfloat16), pool, pool)
        kwargs = dict(cu_q_lens=i32(3), kv_lens=i32(2), page_tables=i32(2, 8))
    lowered = jax.jit(lambda *a, **kw: fn(*a, **kw)).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
