"""The in-place compaction kernel against ``gather_slots`` + ``scatter_slots`` (bit-exact: it is a copy).

CPU tests run the kernel under Mosaic GPU interpret mode, whose staging SMEM starts as NaN, so a row the
kernel never gathers fails. The interpreter runs each TMA copy synchronously at issue, so the ordering of
in-flight copies (the double buffering) is only exercised by the ``gpu`` tests, which run the compiled
kernel on a Hopper GPU. Fresh random inputs each run; the seed is in the failure message.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compaction import compact_slots
from zipage_jax.compression.step import CompressionBatch, compress, slot_scores
from zipage_jax.config import ScoringConfig
from zipage_jax.compression.selection import select_slots
from zipage_jax.compression.compaction import gather_slots, scatter_slots
from zipage_jax.layers.attention import REFERENCE, XLA_COMPACTION_MAX_ROWS, compaction_by_rows, resolve_backend
from helpers import random_problem as scoring_problem
from seeds import fresh_seed, seeded_rng

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan")


def random_problem(rng, rows, page_size, head_dim, num_dst, num_src, dtype=jnp.bfloat16, layers=3, num_kv_heads=2,
                   shuffled=True):
    """Pools, tables and kept slots for ``rows``: (target, selection) pairs.

    target: "inplace" (dst = the row's first source pages), "cow" (some dst pages fresh, the rest in place)
    or "padding" (valid False; its dst are its own source pages, so a write would show). selection: "random"
    (per head), "first" or "last" K source slots, or "runs" (per head: one evicted range at a random offset plus
    scattered single slots, so long runs of kept rows straddle source pages at unaligned offsets). Source pages
    are distinct and shuffled (``shuffled``; else consecutive, so a run's pool rows can cross into the next
    page); page 0 is unused.
    """
    batch, keep = len(rows), num_dst * page_size
    num_pages = 1 + batch * (num_src + num_dst) + 2  # spare pages nobody references
    shape = (layers, num_pages, num_kv_heads, page_size, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    ids = rng.permutation(np.arange(1, num_pages)) if shuffled else np.arange(1, num_pages)
    src = ids[:batch * num_src].reshape(batch, num_src)
    fresh = iter(ids[batch * num_src:])
    dst = src[:, :num_dst].copy()
    kept = np.empty((batch, num_kv_heads, keep), np.int32)
    num_slots = num_src * page_size
    for b, (target, selection) in enumerate(rows):
        if target == "cow":  # at least one fresh page, and one in place when there are two or more
            for i in rng.permutation(num_dst)[:max(1, num_dst // 2)]:
                dst[b, i] = next(fresh)
        for h in range(num_kv_heads):
            kept[b, h] = {"first": lambda: np.arange(keep), "last": lambda: np.arange(num_slots - keep, num_slots),
                          "random": lambda: np.sort(rng.choice(num_slots, keep, replace=False)),
                          "runs": lambda: runs_selection(rng, num_slots, keep)}[selection]()
    valid = np.array([target != "padding" for target, _ in rows])
    return (k_pool, v_pool, jnp.asarray(kept), jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32),
            jnp.asarray(valid))


def runs_selection(rng, num_slots, keep):
    """``keep`` ascending slots: all but one evicted range at a random offset and a few scattered slots."""
    evict = num_slots - keep
    span = evict - evict // 4
    start = int(rng.integers(0, num_slots - span + 1))
    ranged = np.arange(start, start + span)
    rest = rng.choice(np.setdiff1d(np.arange(num_slots), ranged), evict - span, replace=False)
    return np.setdiff1d(np.arange(num_slots), np.concatenate([ranged, rest])).astype(np.int32)


def oracle(pool, layer, kept, src, dst, valid):
    return np.asarray(scatter_slots(pool, layer, gather_slots(pool, layer, kept, src), dst, valid))


def bits(x):
    return np.asarray(x).view(np.uint16)


def check_against_oracle(seed, k_pool, v_pool, layer, kept, src, dst, valid, **kwargs):
    want = [oracle(p, layer, kept, src, dst, valid) for p in (k_pool, v_pool)]
    before = [np.asarray(p) for p in (k_pool, v_pool)]
    got = compact_slots(jnp.copy(k_pool), jnp.copy(v_pool), layer, kept, src, dst, valid, **kwargs)
    for name, g, w, b in zip("KV", got, want, before):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert not np.array_equal(bits(w), bits(b)), f"seed {seed}: the case moves nothing"
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"seed {seed}: {name} pool")
        other = np.arange(b.shape[0]) != layer
        np.testing.assert_array_equal(bits(g[other]), bits(b[other]), err_msg=f"seed {seed}: other layers")
        padding_pages = np.asarray(src)[~np.asarray(valid)]
        np.testing.assert_array_equal(bits(g[layer, padding_pages]), bits(b[layer, padding_pages]),
                                      err_msg=f"seed {seed}: padding rows")


CASES = [
    # page_size, head_dim, dtype, block_rows, stages, max_run, num_dst, num_src, rows
    (16, 64, jnp.bfloat16, 8, 3, 8, 2, 4,
     [("inplace", "random"), ("cow", "first"), ("padding", "runs"), ("inplace", "last")]),
    (64, 128, jnp.float16, None, 2, 4, 1, 2, [("inplace", "last"), ("padding", "first"), ("cow", "runs")]),
    (64, 64, jnp.bfloat16, 16, 4, 8, 2, 3, [("cow", "runs"), ("inplace", "random")]),   # 8 blocks per CTA
    (16, 128, jnp.bfloat16, None, 2, 1, 3, 4, [("inplace", "first"), ("cow", "runs")]),  # row by row
    (32, 64, jnp.bfloat16, None, 3, 2, 3, 4, [("inplace", "runs"), ("cow", "runs"), ("inplace", "random")]),
]
UNSHUFFLED = (16, 64, jnp.bfloat16, 8, 2, 8, 3, 4, [("inplace", "runs"), ("cow", "runs"), ("inplace", "last")])


@pytest.mark.parametrize("page_size,head_dim,dtype,block_rows,stages,max_run,num_dst,num_src,rows", CASES)
def test_compaction_matches_gather_scatter(page_size, head_dim, dtype, block_rows, stages, max_run, num_dst, num_src,
                                           rows):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, rows, page_size, head_dim, num_dst, num_src, dtype)
    layer = int(rng.integers(1, problem[0].shape[0]))
    k_pool, v_pool, kept, src, dst, valid = problem
    check_against_oracle(seed, k_pool, v_pool, layer, kept, src, dst, valid, block_rows=block_rows, stages=stages,
                         max_run=max_run, interpret=INTERPRET)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_one_cta_moving_both_pools_matches_gather_scatter(case):
    """``split_pools=False`` (K and V in one CTA, one barrier for both) against the same oracle."""
    page_size, head_dim, dtype, block_rows, stages, max_run, num_dst, num_src, rows = case
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k_pool, v_pool, kept, src, dst, valid = random_problem(rng, rows, page_size, head_dim, num_dst, num_src, dtype)
    check_against_oracle(seed, k_pool, v_pool, 2, kept, src, dst, valid, block_rows=block_rows, stages=stages,
                         max_run=max_run, split_pools=False, interpret=INTERPRET)


def test_small_dispatches_compact_through_xla_and_larger_ones_through_the_kernel():
    """The kernel backends' ``compact_slots``: up to ``XLA_COMPACTION_MAX_ROWS`` rows XLA's gather-then-scatter, more
    the in-place kernel; either way the oracle's result, bit for bit."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    calls = []

    def kernel(*args):
        calls.append(args[3].shape[0])
        return compact_slots(*args, interpret=INTERPRET)

    by_rows = compaction_by_rows(kernel)
    targets = [("inplace", "random"), ("cow", "runs"), ("padding", "first"), ("inplace", "last"), ("cow", "first")]
    for rows in (XLA_COMPACTION_MAX_ROWS, XLA_COMPACTION_MAX_ROWS + 1):
        k_pool, v_pool, kept, src, dst, valid = random_problem(rng, targets[:rows], 16, 64, 2, 3)
        want = [oracle(p, 1, kept, src, dst, valid) for p in (k_pool, v_pool)]
        got = jax.jit(by_rows)(jnp.copy(k_pool), jnp.copy(v_pool), 1, kept, src, dst, valid)
        for name, g, w in zip("KV", got, want):
            np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"seed {seed}: {rows} rows, {name} pool")
    assert calls == [XLA_COMPACTION_MAX_ROWS + 1]
    # the mosaic backend is wired so: at 4 rows its compaction runs here, on the CPU, where its kernel cannot
    k_pool, v_pool, kept, src, dst, valid = random_problem(rng, targets[:XLA_COMPACTION_MAX_ROWS], 16, 64, 2, 3)
    got = resolve_backend("mosaic").compact_slots(k_pool, v_pool, 2, kept, src, dst, valid)
    np.testing.assert_array_equal(bits(got[1]), bits(oracle(v_pool, 2, kept, src, dst, valid)), err_msg=f"seed {seed}")


def test_compaction_runs_stop_at_page_ends():
    """Consecutive pool pages: a run of source rows is one copy only inside one page, where memory is contiguous."""
    page_size, head_dim, dtype, block_rows, stages, max_run, num_dst, num_src, rows = UNSHUFFLED
    for _ in range(3):
        seed = fresh_seed()
        rng = np.random.default_rng(seed)
        k_pool, v_pool, kept, src, dst, valid = random_problem(rng, rows, page_size, head_dim, num_dst, num_src, dtype,
                                                               shuffled=False)
        check_against_oracle(seed, k_pool, v_pool, 1, kept, src, dst, valid, block_rows=block_rows, stages=stages,
                             max_run=max_run, interpret=INTERPRET)


def test_pools_are_updated_in_place():
    """The kernel's outputs alias the pool operands (Hopper lowering), and a donating jit, alone or with the
    pools in a ``fori_loop`` carry as in ``compress``, reuses their buffers: no copy of the pools."""
    rng = np.random.default_rng(fresh_seed())
    k_pool, v_pool, kept, src, dst, valid = random_problem(rng, [("cow", "random")], 16, 64, 2, 3)
    pool_bytes = k_pool.nbytes
    args = (kept, src, dst, valid)

    def layers_loop(k, v, *args, interpret=INTERPRET):
        step = lambda layer, pools: compact_slots(*pools, layer, *args, interpret=interpret)  # noqa: E731
        return jax.lax.fori_loop(0, k.shape[0], step, (k, v))

    loop = jax.jit(layers_loop, donate_argnums=(0, 1), static_argnames="interpret")
    for fn, lead in ((compact_slots, (1,)), (loop, ())):
        text = fn.trace(k_pool, v_pool, *lead, *args, interpret=False).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
        assert "operand_index = 4" in text and "operand_index = 5" in text  # the custom call's k / v operands
        assert "tf.aliasing_output = 0" in text and "tf.aliasing_output = 1" in text
        compiled = fn.lower(k_pool, v_pool, *lead, *args, interpret=INTERPRET).compile()
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes == 2 * pool_bytes and memory.temp_size_in_bytes < pool_bytes
    pointers = k_pool.unsafe_buffer_pointer(), v_pool.unsafe_buffer_pointer()
    out = compiled(k_pool, v_pool, *args)  # the loop just analysed (called through the jit, it would compile again)
    assert k_pool.is_deleted() and (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers


def test_compress_through_the_kernel_equals_compress():
    """Wired as the lead will wire it (per layer in a ``fori_loop``, kept from the layer's scores), the kernel
    gives ``compress``'s K and V, with copy-on-write targets mixed into in-place rows and a padding row."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page, budget, window, hkv, group, dim = 16, 2, 8, 2, 4, 64
    num_src = np.array([3, 4, 3, 0])
    k_pool, tables, _, _ = scoring_problem(rng, list(num_src * page), 5, group, window, page, dim)
    layers, num_pages = k_pool.shape[:2]
    v_pool = jnp.asarray(rng.standard_normal(k_pool.shape), jnp.bfloat16)
    score_cache = jnp.asarray(rng.uniform(0, 0.1, k_pool.shape[:4]), jnp.float32)
    query_cache = jnp.asarray(rng.standard_normal((layers, 5, window, hkv * group, dim)), jnp.bfloat16)
    spare = sorted(set(range(1, num_pages)) - set(np.asarray(tables).ravel().tolist()))
    dst = np.array(tables[:, :budget])
    dst[1, 0], dst[2, 1] = spare[:2]  # copy-on-write pages next to in-place ones
    comp = CompressionBatch(src_tables=tables, num_src_pages=jnp.asarray(num_src, jnp.int32),
                            dst_tables=jnp.asarray(dst), query_rows=jnp.asarray([3, 0, 1, 4], jnp.int32),
                            logical_lens=jnp.asarray(num_src * page + [16, 0, 5, 0], jnp.int32),
                            compressed_before=jnp.asarray([True, False, True, False]),
                            valid=jnp.asarray(num_src > 0))
    cfg, scale = ScoringConfig(window=window, sink_tokens=1), dim ** -0.5
    scores = slot_scores(k_pool, score_cache, query_cache, comp, cfg, scale, REFERENCE)  # [B, L, Hkv, N]

    def layer_step(layer, pools):
        kept = select_slots(scores[:, layer], budget * page)
        return compact_slots(*pools, layer, kept, comp.src_tables, comp.dst_tables, comp.valid,
                             interpret=INTERPRET)

    want = compress(k_pool, v_pool, score_cache, query_cache, comp, cfg, scale, REFERENCE)[:2]
    got = jax.lax.fori_loop(0, layers, layer_step, (jnp.copy(k_pool), jnp.copy(v_pool)))
    for name, g, w in zip("KV", got, want):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"seed {seed}: {name} pool")


@pytest.mark.parametrize("bad", ["k_pool", "v_pool", "kept", "src_tables", "dst_tables", "valid", "block_rows",
                                 "stages", "max_run"])
def test_compaction_rejects_bad_input(bad):
    rng = seeded_rng()
    k_pool, v_pool, kept, src, dst, valid = random_problem(rng, [("inplace", "random")] * 2, 16, 64, 2, 3)
    block_rows, stages, max_run = None, 2, 8
    if bad == "k_pool":
        k_pool = v_pool = k_pool.astype(jnp.float32)
    elif bad == "v_pool":
        v_pool = v_pool[..., :32]
    elif bad == "kept":
        kept = kept[..., :16]
    elif bad == "src_tables":
        src = src[:, :1]
    elif bad == "dst_tables":
        dst = dst[0]
    elif bad == "valid":
        valid = valid[:1]
    elif bad == "stages":
        stages = 1
    elif bad == "max_run":
        max_run = 6
    else:
        block_rows = 5
    with pytest.raises(ValueError, match=bad):
        compact_slots(k_pool, v_pool, 1, kept, src, dst, valid, block_rows=block_rows, stages=stages,
                      max_run=max_run, interpret=INTERPRET)


@pytest.mark.parametrize("page_size,head_dim,block_rows,split_pools",
                         [(256, 128, None, True), (256, 128, None, False), (16, 64, None, True), (64, 128, 32, True)])
def test_compaction_lowers_for_hopper(page_size, head_dim, block_rows, split_pools):
    """Mosaic GPU lowering runs on CPU, so lowering errors show up without a GPU."""
    pool = jax.ShapeDtypeStruct((2, 33, 8, page_size, head_dim), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    lowered = compact_slots.trace(pool, pool, i32(), i32(4, 8, 2 * page_size), i32(4, 5), i32(4, 2),
                                  jax.ShapeDtypeStruct((4,), jnp.bool_), block_rows=block_rows,
                                  split_pools=split_pools)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def on_hopper():
    return jax.default_backend() == "gpu" and float(jax.devices()[0].compute_capability) >= 9.0


GPU_CASES = [
    # page_size, head_dim, block_rows, num_dst, num_src, num_kv_heads, rows
    (256, 128, None, 4, 8, 8, [("inplace", "random"), ("cow", "random"), ("padding", "random"),
                               ("inplace", "last"), ("cow", "first")]),
    (16, 64, None, 8, 20, 2, [("inplace", "random"), ("inplace", "last"), ("cow", "random")]),
    (64, 128, 8, 3, 7, 4, [("cow", "last"), ("inplace", "random")]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (or newer) NVIDIA GPU")
@pytest.mark.parametrize("split_pools", [True, False])
@pytest.mark.parametrize("page_size,head_dim,block_rows,num_dst,num_src,num_kv_heads,rows", GPU_CASES)
def test_compiled_compaction_matches_gather_scatter(page_size, head_dim, block_rows, num_dst, num_src,
                                                    num_kv_heads, rows, split_pools):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k_pool, v_pool, kept, src, dst, valid = random_problem(rng, rows, page_size, head_dim, num_dst, num_src,
                                                           num_kv_heads=num_kv_heads)
    check_against_oracle(seed, k_pool, v_pool, 1, kept, src, dst, valid, block_rows=block_rows,
                         split_pools=split_pools)
    k_copy, v_copy = jnp.copy(k_pool), jnp.copy(v_pool)
    pointers = k_copy.unsafe_buffer_pointer(), v_copy.unsafe_buffer_pointer()
    out = compact_slots(k_copy, v_copy, 1, kept, src, dst, valid, block_rows=block_rows, split_pools=split_pools)
    assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers  # in place
