"""FP8 KV pages (``kv_cache_dtype``; pallas_kernels.kv_quant): the references against a float oracle, the Mosaic
kernels' FP8 paths in interpret mode against the references, compaction as a byte copy, the memory plan, and greedy
parity of the shipped model.

Tolerances. Against the oracle *on the dequantized values* the FP8 path is the same math with the scales moved
(``q . s k = s q . k``, ``p @ s v = s (p @ v)``): only f32 rounding differs (1e-5). Against the original values,
e4m3 rounds each value to 3 mantissa bits (relative error <= 2^-4): an output, a convex combination of V rows,
moves by at most 2^-4 of max |v| through V, and the logit error (<= 2^-4 sum |q_d k_d| sm_scale) reweights it a
little more: 0.1 of max |v| bounds both at these shapes.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import (quantize, round_queries, scale_outputs, scale_queries, scales_from_amax,
                                     upcast)
from pallas_kernels.reference import paged_decode_ref, ragged_prefill_ref
from zipage_jax.compression import compaction, scoring
from zipage_jax.config import EngineConfig
from helpers import assert_close, shuffled_page_tables
from seeds import seeded_rng

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan")
E4M3 = jnp.float8_e4m3fn


def fp8_pools(rng, shape, dtype=E4M3):
    """Float K/V ``[L, pages, Hkv, S, D]`` (f32, per-head magnitudes apart), their FP8 pools and scales [2, L, Hkv]."""
    heads = np.exp(rng.uniform(-2, 2, (shape[0], 1, shape[2], 1, 1)))
    k, v = (jnp.asarray(rng.standard_normal(shape) * heads, jnp.float32) for _ in range(2))
    amax = jnp.stack([jnp.max(jnp.abs(x), axis=(1, 3, 4)) for x in (k, v)])
    scales = scales_from_amax(amax, dtype)
    quant = [jax.vmap(lambda x, s: quantize(x.transpose(0, 2, 1, 3), s, dtype).transpose(0, 2, 1, 3))(x, scales[i])
             for i, x in enumerate((k, v))]
    return k, v, quant[0], quant[1], scales


def dequantized(pool, scales):  # [L, pages, Hkv, S, D] f32
    return upcast(pool, jnp.float32) * scales[:, None, :, None, None]


def test_quantize_rounds_to_three_mantissa_bits_and_saturates():
    rng = seeded_rng()
    x = jnp.asarray(rng.standard_normal((64, 2, 32)) * [[[1.0], [30.0]]], jnp.float32)
    scale = scales_from_amax(jnp.max(jnp.abs(x), axis=(0, 2)), E4M3)
    back = upcast(quantize(x, scale, E4M3), jnp.float32) * scale[:, None]
    normal = jnp.abs(x) >= scale[:, None] * 2.0 ** -6  # below: e4m3's subnormals, an absolute error of 2^-10 scale
    assert float(jnp.max(jnp.where(normal, jnp.abs(back - x) / jnp.abs(x), 0))) <= 2.0 ** -4
    assert float(jnp.max(jnp.abs(back - x) / scale[:, None])) <= 448 * 2.0 ** -4
    huge = quantize(jnp.full((1, 2, 4), 1e9), scale, E4M3)
    assert not bool(jnp.any(jnp.isnan(upcast(huge, jnp.float32))))
    assert float(upcast(huge, jnp.float32).max()) == float(jnp.finfo(E4M3).max)


def test_reference_decode_and_prefill_over_fp8_pages():
    """The engine's folding (queries scaled in, outputs scaled out) over an FP8 pool is the float attention of its
    dequantized values, and within FP8's rounding of the float values."""
    rng = seeded_rng()
    layers, pages, hkv, page_size, d, group = 2, 12, 2, 8, 32, 2
    k, v, k8, v8, scales = fp8_pools(rng, (layers, pages, hkv, page_size, d))
    kv_lens = np.array([19, 0, 8], np.int32)
    tables = jnp.asarray(shuffled_page_tables(rng, [-(-n // page_size) for n in kv_lens], 4, pages))
    q = jnp.asarray(rng.standard_normal((3, hkv * group, d)), jnp.float32)
    layer, sm = 1, d ** -0.5
    got = scale_outputs(paged_decode_ref(scale_queries(q, scales[0, layer]), k8, v8, layer, kv_lens, tables, sm),
                        scales[1, layer])
    exact = paged_decode_ref(q, dequantized(k8, scales[0]), dequantized(v8, scales[1]), layer, kv_lens, tables, sm)
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5)
    float_out = paged_decode_ref(q, k, v, layer, kv_lens, tables, sm)
    assert float(jnp.max(jnp.abs(got - float_out))) <= 0.1 * float(jnp.max(jnp.abs(v[layer])))
    cu = jnp.asarray([0, 5, 5, 8], jnp.int32)
    qp = jnp.asarray(rng.standard_normal((10, hkv * group, d)), jnp.float32)
    got = scale_outputs(ragged_prefill_ref(scale_queries(qp, scales[0, layer]), k8, v8, layer, cu, kv_lens, tables,
                                           sm), scales[1, layer])
    exact = ragged_prefill_ref(qp, dequantized(k8, scales[0]), dequantized(v8, scales[1]), layer, cu, kv_lens,
                               tables, sm)
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5)


def test_scores_read_dequantized_keys_and_compaction_copies_bytes():
    """Window scores with the K scale in the queries and lightning redundancy (a cosine: no scale) over FP8 pages
    equal those of the dequantized keys; compaction moves the kept slots' bytes."""
    rng = seeded_rng()
    layers, pages, hkv, page_size, d = 1, 9, 2, 8, 32
    _, _, k8, v8, scales = fp8_pools(rng, (layers, pages, hkv, page_size, d))
    tables = jnp.asarray(rng.permutation(np.arange(1, pages))[:4].reshape(1, 4), jnp.int32)
    live = jnp.asarray([32], jnp.int32)
    queries = jnp.asarray(rng.standard_normal((1, 8, 2 * hkv, d)), jnp.float32)
    deq = dequantized(k8, scales[0])
    got = scoring.paged_window_attention(k8, 0, tables, live, scale_queries(queries, scales[0, 0]), d ** -0.5)
    want = scoring.paged_window_attention(deq, 0, tables, live, queries, d ** -0.5)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4)
    got = scoring.paged_lightning_row_sums(k8, 0, tables, jnp.asarray([4]), 0.5)
    want = scoring.paged_lightning_row_sums(deq, 0, tables, jnp.asarray([4]), 0.5)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    kept = jnp.asarray(np.sort(rng.permutation(32)[:16]).reshape(1, 1, 16).repeat(hkv, 1), jnp.int32)
    k2, v2 = compaction.compact_slots(k8, v8, 0, kept, tables, tables[:, :2], jnp.asarray([True]))
    for before, after in ((k8, k2), (v8, v2)):
        moved = compaction.gather_slots(after, 0, jnp.broadcast_to(jnp.arange(16), kept.shape), tables[:, :2])
        want = compaction.gather_slots(before, 0, kept, tables)
        np.testing.assert_array_equal(moved.view(jnp.uint8), want.view(jnp.uint8))


def test_kv_cache_dtype_is_validated_and_counts_one_byte_a_value():
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.worker import kv_cache
    qwen = MODEL_SHAPES["qwen3-8b"]
    plans = {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        c = EngineConfig(model="m", kv_cache_dtype=kv, compression=True, kv_budget_pages=2, page_size=256,
                         kv_cache_memory_bytes=8 * 2**30, max_num_seqs=256, compilation_cache_dir=None)
        plans[kv] = kv_cache.plan_memory(c, qwen, jnp.bfloat16, 32768)
    bf16, fp8 = plans["auto"], plans["fp8"]
    assert fp8.kv_dtype == jnp.float8_e4m3fn and plans["fp8_e5m2"].kv_dtype == jnp.float8_e5m2
    score = qwen.num_layers * qwen.num_kv_heads * 256 * 4
    assert fp8.page_bytes - score == (bf16.page_bytes - score) // 2
    assert fp8.max_compressed_concurrency >= 1.8 * bf16.max_compressed_concurrency
    assert "pages of float8_e4m3fn" in fp8.describe() and fp8.as_dict()["kv_dtype"] == "float8_e4m3fn"


@pytest.mark.parametrize("num_splits, num_stages, kv_lens", [(2, 2, (70, 0, 33)), (1, 3, (250, 0, 33)),
                                                             (2, 1, (150, 0, 33))])
def test_decode_kernel_reads_fp8_pages(num_splits, num_stages, kv_lens, page_size=16, block_kv=64):
    """Interpret mode: the Mosaic decode kernel over FP8 pages with exact queries (``fp8_qk=False``: K and V upcast
    in shared memory, taking turns in one buffer; more blocks than stages from the second case on) equals the
    reference over the same pages (relative L2 error under 1e-2, as the 16-bit kernel's test: the probabilities are
    rounded to bf16 for the wgmma); at one stage (a slot refilled right after its V is read) with the race
    detector on."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

    from pallas_kernels.paged_decode import paged_decode
    rng = seeded_rng()
    hkv, d, group = 1, 64, 4
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1
    pages = len(kv_lens) * pages_per_row + 2
    _, _, k8, v8, _ = fp8_pools(rng, (2, pages, hkv, page_size, d))
    tables = jnp.asarray(shuffled_page_tables(rng, [-(-n // page_size) for n in kv_lens], pages_per_row, pages))
    q = jnp.asarray(rng.standard_normal((len(kv_lens), hkv * group, d)), jnp.bfloat16)
    lens = jnp.asarray(kv_lens, jnp.int32)
    races = num_stages == 1
    interpret = INTERPRET
    if races:
        gpu_interpret.reset_gpu_interpret_mode_state()
        interpret = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
    out = paged_decode(q, k8, v8, 1, lens, tables, d ** -0.5, block_kv=block_kv, num_splits=num_splits,
                       num_stages=num_stages, fp8_qk=False, interpret=interpret)
    want = paged_decode_ref(q, k8, v8, 1, lens, tables, d ** -0.5)
    assert_close(out, want, "above")
    assert not (races and gpu_interpret.get_races().races_found), "data race between the copies and the upcasts"


def test_decode_kernel_with_fp8_queries(page_size=16):
    """Interpret mode: by default over FP8 pools the kernel reads e4m3 queries (one scale per row and KV head; q @
    k^T straight off the staged FP8 keys) and equals the reference over the same rounded queries (relative L2 under
    1e-2, as above), which is the engine's reference decode over FP8 pools; it stays within 5e-2 of the exact
    queries' output when the queries carry the engine's K scales (e4m3's 3 mantissa bits move each logit by up to
    2^-4 of sum |q_d k_d| sm_scale: 2-3e-2 here)."""
    from pallas_kernels.paged_decode import paged_decode
    from zipage_jax.layers.attention import REFERENCE
    rng = seeded_rng()
    hkv, d, group, kv_lens = 2, 64, 4, (250, 0, 33)
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1
    pages = len(kv_lens) * pages_per_row + 2
    _, _, k8, v8, scales = fp8_pools(rng, (2, pages, hkv, page_size, d))
    tables = jnp.asarray(shuffled_page_tables(rng, [-(-n // page_size) for n in kv_lens], pages_per_row, pages))
    q = scale_queries(jnp.asarray(rng.standard_normal((len(kv_lens), hkv * group, d)), jnp.bfloat16), scales[0, 1])
    lens = jnp.asarray(kv_lens, jnp.int32)
    out = paged_decode(q, k8, v8, 1, lens, tables, d ** -0.5, block_kv=64, num_splits=2, interpret=INTERPRET)
    engine_reference = REFERENCE.decode(q, k8, v8, 1, lens, tables, d ** -0.5)
    assert_close(engine_reference, paged_decode_ref(round_queries(q, hkv), k8, v8, 1, lens, tables, d ** -0.5), 1e-6)
    assert_close(out, engine_reference, "above")
    exact = paged_decode_ref(q, k8, v8, 1, lens, tables, d ** -0.5).astype(jnp.float32)
    assert float(jnp.linalg.norm(out.astype(jnp.float32) - exact) / jnp.linalg.norm(exact)) < 5e-2
    with pytest.raises(ValueError, match="fp8_qk"):
        paged_decode(q, upcast(k8), upcast(v8), 1, lens, tables, 0.1, fp8_qk=True, interpret=INTERPRET)


def test_rounded_queries_are_e4m3_values_and_round_again_to_themselves():
    """``round_queries``: each (row, KV head) group's largest magnitude is kept, every value moves by at most half
    an e4m3 step (2^-4 of its magnitude, or 2^-10 of the scale in the subnormal range), and rounding the result
    again changes nothing (so the Mosaic kernel's own quantization and the other backends' rounding agree)."""
    rng = seeded_rng()
    b, hkv, group, d = 5, 2, 4, 64
    q = jnp.asarray(rng.standard_normal((b, hkv * group, d)) * np.exp(rng.uniform(-3, 3, (b, hkv * group, 1))),
                    jnp.bfloat16)
    rounded = round_queries(q, hkv)
    x, y = (np.asarray(a, np.float32).reshape(b, hkv, group * d) for a in (q, rounded))
    amax = np.abs(x).max(-1, keepdims=True)
    np.testing.assert_allclose(np.abs(y).max(-1, keepdims=True), amax, rtol=2 ** -8)
    assert (np.abs(y - x) <= np.maximum(2 ** -4 * np.abs(x), 2 ** -10 * amax / 448) * 1.01 + 1e-30).all()
    assert not np.array_equal(x, y)
    np.testing.assert_array_equal(np.asarray(round_queries(rounded, hkv), np.float32), np.asarray(rounded, np.float32))
    # the e4m3 values behind a barrier, so no compiler folds the round trip away (XLA's GPU compiler may, as excess
    # precision: an H100 run found the reference as far from the kernel as exact queries' output is, 2.4e-2; with
    # the barrier, 3.0e-3: docs/benchmarks/fp8_decode_rounded_h100.json)
    hlo = jax.jit(round_queries, static_argnums=1).lower(q, hkv).as_text()
    assert "optimization_barrier" in hlo and "f8E4M3FN" in hlo


def test_fp8_decode_rounds_queries_once():
    """``with_fp8_queries`` rounds a decode's queries over FP8 pools, except at the head dims where the decode
    quantizes its own (the Mosaic kernel's FP8 q @ k^T), and never over 16-bit pools."""
    from zipage_jax.layers.attention import with_fp8_queries
    rng = seeded_rng()
    seen = []
    decode = with_fp8_queries(lambda q, *args: seen.append(q) or q, rounds_own_head_dims=(64,))
    for head_dim, pool_dtype, rounded in ((32, E4M3, True), (64, E4M3, False), (32, jnp.bfloat16, False)):
        q = jnp.asarray(rng.standard_normal((3, 8, head_dim)), jnp.bfloat16)
        pool = jnp.zeros((1, 2, 2, 16, head_dim), pool_dtype)
        decode(q, pool, pool, 0, None, None, 0.1)
        want = round_queries(q, 2) if rounded else q
        np.testing.assert_array_equal(np.asarray(seen[-1], np.float32), np.asarray(want, np.float32))
        assert rounded == (not np.array_equal(np.asarray(seen[-1], np.float32), np.asarray(q, np.float32)))


@pytest.mark.parametrize("head_dim, fp8_qk", [(64, False), (128, False), (64, None), (128, None)])
def test_decode_kernel_over_fp8_pages_lowers_for_hopper(head_dim, fp8_qk):
    """Interpret mode ignores shared-memory layouts: lowering for CUDA (no GPU needed) runs Mosaic's layout inference
    and checks the staging's tiling against the loads (None: the default, e4m3 queries and an FP8 q @ k^T)."""
    from jax import export

    from pallas_kernels.paged_decode import paged_decode
    batch, hkv, pages_per_row, page_size = 2, 2, 4, 256
    arg = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, k, v, lens, tables: paged_decode(q, k, v, 1, lens, tables, 0.1, fp8_qk=fp8_qk))
    pool = arg((2, batch * pages_per_row + 1, hkv, page_size, head_dim), jnp.float8_e4m3fn)
    lowered = export.export(fn, platforms=("cuda",))(
        arg((batch, 4 * hkv, head_dim), jnp.bfloat16), pool, pool, arg((batch,), jnp.int32),
        arg((batch, pages_per_row), jnp.int32))
    assert "mosaic_gpu" in lowered.mlir_module()


@pytest.mark.parametrize("group, head_dim, page_size, block_kv, q_lens, kv_lens, races", [
    (4, 64, 16, 64, [70, 0, 5], [90, 3, 5], True),     # a chunk behind a prefix, an idle request, more blocks than stages
    (1, 128, 64, 128, [150, 5], [150, 40], False),     # one head; last blocks at full and half width (keys 64)
])
def test_prefill_kernel_reads_fp8_pages(group, head_dim, page_size, block_kv, q_lens, kv_lens, races):
    """Interpret mode: the Mosaic ragged prefill over FP8 pages (each consumer warpgroup upcasts the staged block
    into its own 16-bit buffer, K and V taking turns) equals the reference over the same pages (relative L2 error
    under 1e-2, as the 16-bit kernel's test), with no race between the warpgroups and the copies."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

    from pallas_kernels.ragged_prefill import ragged_prefill
    rng = seeded_rng()
    hkv = 1
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1
    pages = len(kv_lens) * pages_per_row + 2
    _, _, k8, v8, _ = fp8_pools(rng, (2, pages, hkv, page_size, head_dim))
    tables = jnp.asarray(shuffled_page_tables(rng, [-(-n // page_size) for n in kv_lens], pages_per_row, pages))
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + 3, hkv * group, head_dim)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    interpret = INTERPRET
    if races:
        gpu_interpret.reset_gpu_interpret_mode_state()
        interpret = plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
    out = ragged_prefill(q, k8, v8, 1, cu, lens, tables, head_dim ** -0.5, block_kv=block_kv, num_ctas=2,
                         interpret=interpret)
    assert_close(out, ragged_prefill_ref(q, k8, v8, 1, cu, lens, tables, head_dim ** -0.5), "above")
    assert (np.asarray(out, np.float32)[sum(q_lens):] == 0).all()
    assert not (races and gpu_interpret.get_races().races_found), "data race between warpgroups or TMA copies"


@pytest.mark.parametrize("head_dim, block_kv", [(128, 128), (64, 64)])
def test_prefill_kernel_over_fp8_pages_lowers_for_hopper(head_dim, block_kv):
    """Lowered for CUDA on the CPU: Mosaic's layout inference accepts the 8-bit staging, its upcast and the shared
    memory plan (two stages of 8-bit blocks and a 16-bit buffer a consumer fit one CTA)."""
    from jax import export

    from pallas_kernels.ragged_prefill import ragged_prefill
    arg = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, k, v, cu, lens, tables: ragged_prefill(q, k, v, 1, cu, lens, tables, 0.1,
                                                                  block_kv=block_kv, num_ctas=132))
    pool = arg((2, 9, 2, 256, head_dim), E4M3)
    lowered = export.export(fn, platforms=("cuda",))(
        arg((600, 8, head_dim), jnp.bfloat16), pool, pool, arg((3,), jnp.int32), arg((2,), jnp.int32),
        arg((2, 4), jnp.int32))
    assert "mosaic_gpu" in lowered.mlir_module()


def test_compaction_kernel_moves_fp8_bytes():
    from pallas_kernels.compaction import compact_slots
    rng = seeded_rng()
    hkv, page_size, d = 1, 16, 64
    _, _, k8, v8, _ = fp8_pools(rng, (1, 6, hkv, page_size, d))
    src = jnp.asarray(rng.permutation(np.arange(1, 6))[:2].reshape(1, 2), jnp.int32)
    kept = jnp.asarray(np.sort(rng.permutation(32)[:16]).reshape(1, 1, 16), jnp.int32)
    valid = jnp.asarray([True])
    want = compaction.compact_slots(k8, v8, 0, kept, src, src[:, :1], valid)
    got = compact_slots(k8, v8, 0, kept, src, src[:, :1], valid, interpret=INTERPRET)  # donates the pools
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_compression_kernels_read_fp8_keys():
    """Interpret mode: the window-scores and lightning-redundancy kernels over FP8 pages (upcast in shared memory)
    equal the jnp paths over the same pages (bf16 operands: 2e-2 relative; the scores are probabilities)."""
    from pallas_kernels.redundancy import lightning_row_sums
    from pallas_kernels.scoring import window_scores
    rng = seeded_rng()
    hkv, page_size, d = 1, 64, 64
    _, _, k8, _, scales = fp8_pools(rng, (1, 4, hkv, page_size, d))
    tables = jnp.asarray([[2, 3]], jnp.int32)
    live, pages = jnp.asarray([128], jnp.int32), jnp.asarray([2], jnp.int32)
    queries = scale_queries(jnp.asarray(rng.standard_normal((1, 8, 2, d)), jnp.bfloat16), scales[0, 0])
    got = window_scores(k8, 0, tables, live, queries, d ** -0.5, interpret=INTERPRET)
    want = scoring.paged_window_attention(k8, 0, tables, live, queries, d ** -0.5)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-2)
    got = lightning_row_sums(k8, 0, tables, pages, 0.5, interpret=INTERPRET)
    want = scoring.paged_lightning_row_sums(k8, 0, tables, pages, 0.5)
    np.testing.assert_allclose(got, want, atol=5e-2, rtol=2e-2)


# logits: e4m3 pages moved the shipped model's logits by at most 2.34 (p99 0.88) over a 200-token teacher-forced trace
# against the dense f32 forward; a dense top-2 margin below this may flip
FP8_TIE = 2.5


def test_shipped_model_greedy_matches_the_dense_forward_over_fp8_pages():
    """Greedy decoding of the shipped model over an e4m3 pool (the paged forward, reference backend, f32 weights)
    gives the dense forward's tokens (HF's: tests/test_models.py) at every step whose dense top-2 margin exceeds
    FP8_TIE, over a prompt and 40 generated tokens."""
    from zipage_jax.config import DEFAULT_MODEL
    from zipage_jax.layers.attention import REFERENCE
    from zipage_jax.models import ModelConfig, PagedBatch, forward_dense, forward_paged, to_serving
    from zipage_jax.models.weights import load_hf_weights
    from zipage_jax.tasks import repeated_addition
    from zipage_jax.tasks.tokenizer import encode_chat
    from zipage_jax.worker import kv_scales
    cfg = ModelConfig.from_pretrained(DEFAULT_MODEL)
    params = load_hf_weights(DEFAULT_MODEL, cfg, jnp.float32)
    serving = to_serving(params)
    scales = kv_scales.calibrate(serving, cfg, E4M3, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))
    problem = repeated_addition.sample_problems(1, 5, "test")[0]
    prompt, steps, page_size = encode_chat(problem.question), 40, 16
    total = len(prompt) + steps
    table = jnp.arange(1, -(-total // page_size) + 1, dtype=jnp.int32)[None]
    shape = (cfg.num_layers, table.shape[1] + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    k_pool = v_pool = jnp.zeros(shape, E4M3)
    step = jax.jit(forward_paged, static_argnums=(1, 5), static_argnames=("return_queries", "return_hidden"))

    def run(tokens, start, k_pool, v_pool, prefill):
        pos = jnp.arange(start, start + len(tokens), dtype=jnp.int32)
        batch = PagedBatch(tokens=jnp.asarray(tokens, jnp.int32), positions=pos,
                           slot_mapping=table[0, pos // page_size] * page_size + pos % page_size,
                           kv_lens=jnp.asarray([start + len(tokens)], jnp.int32), page_tables=table,
                           logits_indices=jnp.asarray([len(tokens) - 1], jnp.int32),
                           cu_q_lens=jnp.asarray([0, len(tokens)], jnp.int32) if prefill else None)
        logits, k_pool, v_pool = step(serving, cfg, k_pool, v_pool, batch, REFERENCE, kv_scales=scales)
        return int(jnp.argmax(logits[0])), k_pool, v_pool

    token, k_pool, v_pool = run(prompt, 0, k_pool, v_pool, True)
    ours = [token]
    for i in range(steps - 1):
        token, k_pool, v_pool = run([token], len(prompt) + i, k_pool, v_pool, False)
        ours.append(token)
    dense = jax.jit(forward_dense, static_argnums=1)(params, cfg, jnp.asarray([prompt + ours]))[0, len(prompt) - 1:-1]
    top2 = jnp.sort(dense, axis=-1)[:, -2:]
    clear = np.asarray(top2[:, 1] - top2[:, 0] > FP8_TIE)
    assert clear.sum() >= steps // 2, "too many near-ties to compare"
    np.testing.assert_array_equal(np.asarray(ours)[clear], np.asarray(jnp.argmax(dense, -1))[clear])


def test_a_prefill_kernel_without_fp8_reads_copies_of_the_steps_pages():
    from zipage_jax.layers.attention import fp8_prefill_through_copies
    rng = seeded_rng()
    _, _, k8, v8, _ = fp8_pools(rng, (2, 9, 1, 8, 32))
    tables = jnp.asarray([[3, 5, 0], [7, 1, 2]], jnp.int32)
    cu, kv_lens = jnp.asarray([0, 4, 9], jnp.int32), jnp.asarray([12, 20], jnp.int32)
    q = jnp.asarray(rng.standard_normal((12, 2, 32)), jnp.bfloat16)
    got = fp8_prefill_through_copies(ragged_prefill_ref)(q, k8, v8, 1, cu, kv_lens, tables, 0.2)
    np.testing.assert_array_equal(got, ragged_prefill_ref(q, k8, v8, 1, cu, kv_lens, tables, 0.2))


def test_an_fp8_engine_calibrates_its_scales_reports_its_dtype_and_follows_the_reference_trace(caplog):
    """Through the whole engine (compression on, reference backend): start-up calibrates non-unit scales, warns
    that FP8 pages are slow on the CPU, the metrics name the pool's dtype, and greedy decoding of held-out problems,
    compressed twice or more, writes the task's reference scratchpad (the shipped model's full-KV greedy output)."""
    from zipage_jax import LLM, SamplingParams
    from zipage_jax.tasks import repeated_addition
    from zipage_jax.tasks.tokenizer import encode_chat

    with caplog.at_level("WARNING"):
        llm = LLM(kv_cache_dtype="fp8", page_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                  compression=True, kv_budget_pages=6, compilation_cache_dir=None)
    assert any("FP8 pages run ~30x slower" in r.getMessage() for r in caplog.records)
    assert llm.metrics()["kv_cache_dtype"] == "float8_e4m3fn"
    scales = np.asarray(llm.engine.worker.state.kv_scales)
    assert np.isfinite(scales).all() and (scales > 0).all() and not np.allclose(scales, 1.0)
    problems = repeated_addition.sample_problems(2, 11, "test")
    outs = llm.generate([encode_chat(p.question) for p in problems],
                        SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    for problem, out in zip(problems, outs):
        assert problem.solution().startswith(out.outputs[0].text), out.outputs[0].text
        assert out.metrics["num_compressions"] >= 2
