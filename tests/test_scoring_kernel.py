"""The compression-scoring kernel under Mosaic GPU interpret mode (CPU) against the jnp window attention.

Fresh random inputs each run (the seed is in the failure message); interpret mode fills every buffer it
allocates (the kernel's output included) with NaN, so a live slot the kernel never writes fails.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.compaction import compact_slots
from pallas_kernels.redundancy import lightning_row_sums
from pallas_kernels.reference import gather_request_kv
from pallas_kernels.scoring import window_scores
from pallas_kernels.selection import selection_threshold
from zipage_jax.layers import attention
from zipage_jax.models import weights
from zipage_jax.layers.attention import REFERENCE, AttentionBackend, resolve_backend, sharded
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.compression.step import CompressionBatch, compress, slot_scores
from zipage_jax.config import ScoringConfig
from zipage_jax.compression.scoring import paged_window_attention, window_attention
from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.core.request import Request
from zipage_jax.sampling_params import SamplingParams
from helpers import random_problem
from seeds import fresh_seed, seeded_rng

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan")


SCORE_CASES = [
    # group, window, page_size, head_dim, block_kv, num_stages, num_live, pages_per_row
    (4, 16, 16, 64, 64, 2, [80, 0, 37], 6),     # a block spans 4 pages; padding row; partial recent page
    (1, 8, 64, 128, 64, 3, [192, 3], 3),        # one page per block; a row shorter than the window
    (8, 16, 128, 64, 64, 2, [300], 3),          # 2 query tiles; a block is half a page; partial last block
]


@pytest.mark.parametrize("group,window,page_size,head_dim,block_kv,num_stages,num_live,pages_per_row", SCORE_CASES)
def test_window_scores_match_jnp(group, window, page_size, head_dim, block_kv, num_stages, num_live, pages_per_row):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k_pool, tables, lens, queries = random_problem(rng, num_live, pages_per_row, group, window, page_size, head_dim)
    scale = head_dim ** -0.5
    out = np.asarray(window_scores(k_pool, 1, tables, lens, queries, scale, block_kv=block_kv,
                                   num_stages=num_stages, interpret=INTERPRET))
    ref = np.asarray(window_attention(gather_request_kv(k_pool, 1, tables), queries, lens, scale))
    assert out.shape == ref.shape == (len(num_live), 2, pages_per_row * page_size) and out.dtype == np.float32
    assert np.isfinite(out).all(), f"seed {seed}: non-finite scores (unwritten slots?)"
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}")
    dead = np.arange(out.shape[-1])[None, :] >= np.asarray(num_live)[:, None]
    assert (out.transpose(1, 0, 2)[:, dead] == 0).all()


def interpreted_kernel_backend(window_scores_fn=window_scores):
    """The reference backend plus the compression kernels in interpret mode: the wiring of the mosaic backends."""
    return AttentionBackend(
        name="interpreted_kernel",
        window_scores=functools.partial(window_scores_fn, interpret=INTERPRET),
        lightning_row_sums=functools.partial(lightning_row_sums, interpret=INTERPRET),
        selection_threshold=functools.partial(selection_threshold, interpret=INTERPRET),
        compact_slots=functools.partial(compact_slots, interpret=INTERPRET), fused_compression=True)


def test_compress_with_the_kernel_equals_jnp():
    """Scores and compacted caches through the kernel backend, all layers in one group, equal the jnp path layer by
    layer (default knobs, GQA)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page, budget, window, hkv, group, dim = 16, 2, 8, 2, 4, 64
    num_src = np.array([3, 4, 3, 0])  # a first compression of 4 pages; a padding row
    k_pool, tables, _, _ = random_problem(rng, list(num_src * page), 5, group, window, page, dim)
    layers, num_pages = k_pool.shape[:2]
    v_pool = jnp.asarray(rng.standard_normal(k_pool.shape), jnp.bfloat16)
    score_cache = jnp.asarray(rng.uniform(0, 0.1, k_pool.shape[:4]), jnp.float32)
    query_cache = jnp.asarray(rng.standard_normal((layers, 5, window, hkv * group, dim)), jnp.bfloat16)
    batch = CompressionBatch(src_tables=tables, num_src_pages=jnp.asarray(num_src, jnp.int32),
                             dst_tables=tables[:, :budget], query_rows=jnp.asarray([3, 0, 1, 4], jnp.int32),
                             logical_lens=jnp.asarray(num_src * page + [16, 0, 5, 0], jnp.int32),
                             compressed_before=jnp.asarray([True, False, True, False]),
                             valid=jnp.asarray(num_src > 0))
    cfg = ScoringConfig(window=window, sink_tokens=1)
    scale = dim ** -0.5
    kernel_backend = interpreted_kernel_backend()
    got = slot_scores(k_pool, score_cache, query_cache, batch, cfg, scale, backend=kernel_backend)
    want = slot_scores(k_pool, score_cache, query_cache, batch, cfg, scale, REFERENCE)
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}")
    run = functools.partial(compress, k_pool, v_pool, score_cache, query_cache, batch, cfg, scale)
    # the kernels with every layer's rows in one call (each row its own layer) against the jnp path layer by layer
    assert layers > 1
    k_got, v_got, s_got = run(backend=kernel_backend, max_pages=layers * tables.size)
    k_want, v_want, s_want = run(backend=REFERENCE)
    np.testing.assert_array_equal(np.asarray(k_got), np.asarray(k_want), err_msg=f"seed {seed}")  # same kept set
    np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_want), err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(s_got), np.asarray(s_want), rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not (jax.default_backend() == "gpu" and float(jax.devices()[0].compute_capability) >= 9.0),
                    reason="needs a Hopper (or newer) NVIDIA GPU")
def test_compiled_kernels_compress_every_layer_at_once_as_layer_by_layer():
    """On the card, the mosaic backend with every layer's rows in one call of each kernel leaves the pools and score
    cache exactly as layer by layer does (each row is computed alone), at Qwen3-8B's head shapes."""
    rng = seeded_rng()
    page, budget, window, hkv, group, dim, layers = 64, 4, 16, 8, 4, 128, 6
    num_src = np.array([5, 5, 9, 5])  # the steady width M+1 and a wider first compression
    k_pool, tables, _, _ = random_problem(rng, list(num_src * page), 9, group, window, page, dim, num_kv_heads=hkv,
                                          layers=layers)
    v_pool = jnp.asarray(rng.standard_normal(k_pool.shape), jnp.bfloat16)
    score_cache = jnp.asarray(rng.uniform(0, 0.1, k_pool.shape[:4]), jnp.float32)
    query_cache = jnp.asarray(rng.standard_normal((layers, 4, window, hkv * group, dim)), jnp.bfloat16)
    batch = CompressionBatch(src_tables=tables, num_src_pages=jnp.asarray(num_src, jnp.int32),
                             dst_tables=tables[:, :budget], query_rows=jnp.arange(4, dtype=jnp.int32),
                             logical_lens=jnp.asarray(num_src * page + 7, jnp.int32),
                             compressed_before=jnp.asarray([True, False, False, True]),
                             valid=jnp.asarray([True, True, True, False]))
    run = functools.partial(compress, k_pool, v_pool, score_cache, query_cache, batch, ScoringConfig(window=window),
                            dim ** -0.5, resolve_backend("mosaic"))
    together, apart = run(max_pages=layers * tables.size), run()
    for a, b in zip(together, apart):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_backends_declare_their_compression_kernels():
    assert REFERENCE.window_scores is paged_window_attention and resolve_backend("reference") is REFERENCE
    mosaic = resolve_backend("mosaic")
    assert mosaic.window_scores is window_scores and mosaic.fused_compression
    assert mosaic is resolve_backend("mosaic")  # resolved once: one jit cache entry per backend
    # tensor parallel: attention per shard; the compression kernels stay (the runner calls them per shard)
    tp = sharded(mosaic, mesh=None)
    assert tp.window_scores is window_scores and tp.decode is not mosaic.decode and tp.name == "mosaic"


def test_engine_compression_through_the_kernel_backend_equals_jnp(monkeypatch):
    """The runner hands its backend to the compression step: the kernel path gives the jnp path's tokens
    (a tiny bf16 model with the kernel's head dim 64; two compressions a request, a first one and one with history,
    all of 3 pages: one compression program a backend, each interpreted kernel compiled once (a first compression of
    4 pages through the kernels: ``test_compress_with_the_kernel_equals_jnp``); the two prompts fill one 64-token
    prefill step: one prefill program a backend)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    traced = []  # the kernel's traces: the compression step really scores through the backend's kernel
    backend = interpreted_kernel_backend(lambda *args, **kw: traced.append(1) or window_scores(*args, **kw))
    monkeypatch.setitem(attention.BACKENDS, backend.name, backend)
    model_cfg = dataclasses.replace(MODEL_SHAPES["tiny"], head_dim=64, dtype="bfloat16")
    params = weights.init_random_params(model_cfg, jax.random.key(seed), jnp.bfloat16)
    prompts = [rng.integers(0, model_cfg.vocab_size, size=n).tolist() for n in (30, 30)]
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=36)  # compressions at 49 and 65 tokens

    def generate(backend_name):
        config = EngineConfig.from_kwargs("random:tiny", dtype="bfloat16", page_size=16, max_model_len=128,
                              max_num_seqs=2, max_num_batched_tokens=64, num_gpu_pages_override=24,
                              attention_backend=backend_name, enable_prefix_caching=False,
                              compilation_cache_dir=None, compression=True, kv_budget_pages=2, window=8,
                              sink_tokens=1)
        engine = LLMEngine(config, model_cfg, params)
        requests = [Request(f"r{i}", p, sampling, i, seed=i) for i, p in enumerate(prompts)]
        for r in requests:
            engine.add(r)
        while engine.has_unfinished_requests():
            engine.step(only_finished=True)
        return [r.output_token_ids for r in requests], engine.meter.totals["compressions"]

    got, got_compressions = generate(backend.name)
    assert traced
    want, want_compressions = generate("reference")
    assert got_compressions == want_compressions >= 4
    assert all(len(t) == sampling.max_tokens for t in want)
    assert got == want, f"seed {seed}"


@pytest.mark.parametrize("bad", ["window", "dtype", "num_live", "queries"])
def test_window_scores_rejects_bad_input(bad):
    rng = seeded_rng()
    k_pool, tables, lens, queries = random_problem(rng, [32, 16], 2, 2, 8, 16, 64)
    if bad == "window":
        queries = queries[:, :6]
    elif bad == "dtype":
        k_pool = k_pool.astype(jnp.float32)
    elif bad == "num_live":
        lens = lens[:1]
    else:
        queries = queries[..., :32]
    with pytest.raises(ValueError, match=bad):
        window_scores(k_pool, 0, tables, lens, queries, 0.1, interpret=INTERPRET)


@pytest.mark.parametrize("group,window,head_dim,page_size,block_kv", [
    (4, 16, 128, 256, 64),    # Qwen3-8B compression shapes
    (4, 16, 128, 256, 128),
    (8, 32, 64, 16, 64),
    (1, 8, 128, 64, 128),
])
def test_window_scores_lower_for_hopper(group, window, head_dim, page_size, block_kv):
    """Mosaic GPU layout inference runs at lowering, so layout errors show up on CPU without a GPU."""
    pool = jax.ShapeDtypeStruct((2, 33, 2, page_size, head_dim), jnp.bfloat16)
    queries = jax.ShapeDtypeStruct((4, window, 2 * group, head_dim), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    fn = functools.partial(window_scores, layer=1, sm_scale=0.1, block_kv=block_kv)
    lowered = jax.jit(lambda *a, **kw: fn(*a, **kw)).trace(
        pool, page_tables=i32(4, 8), num_live=i32(4), queries=queries).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
