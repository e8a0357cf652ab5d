"""Memory sizing (docs/ARCHITECTURE.md, Compression: concurrency): pool size, query rows C and concurrency from a
byte budget, with the peak step and compression scratch reserved; the scratch estimates bound what XLA actually
allocates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax import LLM
from zipage_jax.worker import kv_cache
from zipage_jax.worker import packing
from zipage_jax.compression.step import CompressionBatch
from zipage_jax.config import EngineConfig
from zipage_jax.models.config import ModelConfig
from seeds import seeded_rng

MODEL = "tests/fixtures/hf/qwen3_untied"
CFG = ModelConfig.from_pretrained(MODEL)


def config(**kwargs):
    opts = dict(model=MODEL, page_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
                compression=True, kv_budget_pages=2, compilation_cache_dir=None)
    opts.update(kwargs)
    return EngineConfig.from_kwargs(**opts)


def shapes_bytes(m, c, itemsize):
    """Independent arithmetic from the array shapes: one device's share of one page of K, V (+ f32 score) and of
    one query-cache row (its KV heads and their query heads)."""
    kv_heads, q_heads = m.num_kv_heads // c.tensor_parallel_size, m.num_heads // c.tensor_parallel_size
    page = np.prod([m.num_layers, kv_heads, c.page_size, m.head_dim]) * itemsize * 2
    keeps_scores = c.scoring.eviction_policy == "zipage" and c.scoring.global_score
    page += np.prod([m.num_layers, kv_heads, c.page_size]) * 4 if keeps_scores else 0
    slot = np.prod([m.num_layers, c.scoring.window, q_heads, m.head_dim]) * itemsize
    return int(page), int(slot)


@pytest.mark.parametrize("kwargs", [dict(), dict(global_score=False, window=8), dict(num_query_rows=3),
                                    dict(tensor_parallel_size=2)])
def test_pool_and_query_rows_from_a_byte_budget(kwargs):
    """The budget is per device: with two devices each page and query row costs a device half as much."""
    rng = seeded_rng()
    c = config(kv_cache_memory_bytes=int(rng.integers(320_000, 700_000)), **kwargs)
    plan = kv_cache.plan_memory(c, CFG, jnp.float32, 256)
    page, slot = shapes_bytes(CFG, c, 4)
    slots = c.num_query_rows or min(c.max_num_seqs, c.kv_cache_memory_bytes // (3 * page + slot))
    pages = min((c.kv_cache_memory_bytes - (slots + 1) * slot) // page, c.max_num_seqs * 16 + 1)
    assert (plan.page_bytes, plan.query_row_bytes) == (page, slot)
    assert (plan.num_query_rows, plan.num_pages) == (slots, pages)
    assert plan.pool_bytes + plan.query_cache_bytes <= c.kv_cache_memory_bytes
    assert plan.max_compressed_concurrency == min(slots, (pages - 1) // 3)
    assert plan.reserved_step_scratch_bytes == 0  # an explicit pool budget reserves nothing


def test_device_budget_reserves_step_and_compression_scratch(monkeypatch):
    budget = 5_000_000
    monkeypatch.setattr(kv_cache, "device_free_bytes", lambda device, utilization: budget)
    c = config()
    plan = kv_cache.plan_memory(c, CFG, jnp.float32, 256)
    reserved = plan.step_scratch_bytes + plan.compression_scratch_bytes + plan.reserved_swap_bytes
    assert plan.reserved_step_scratch_bytes > 0 and plan.reserved_compression_scratch_bytes > 0
    page, slot = shapes_bytes(CFG, c, 4)
    assert plan.reserved_swap_bytes == 3 * page + slot
    assert plan.num_query_rows == min(8, (budget - reserved) // (3 * page + slot))
    assert plan.pool_bytes + plan.query_cache_bytes + reserved <= budget
    hybrid, constrained = plan, kv_cache.plan_memory(config(admission="constrained"), CFG, jnp.float32, 256)
    assert hybrid.max_concurrency == 8 and constrained.max_concurrency == constrained.num_query_rows


def test_window_policy_holds_and_reserves_no_score_cache(monkeypatch):
    """Recent-window eviction never reads a score history: no score cache on the device, no bytes for one in
    the plan (pages, compression scratch, swap staging), no scores in a swap."""
    monkeypatch.setattr(kv_cache, "device_free_bytes", lambda device, utilization: 5_000_000)
    window, zipage = config(eviction_policy="window"), config()
    plans = {c.scoring.eviction_policy: kv_cache.plan_memory(c, CFG, jnp.float32, 256) for c in (window, zipage)}
    kv_only, slot = shapes_bytes(CFG, window, 4)
    assert plans["window"].page_bytes == kv_only == np.prod([CFG.num_layers, CFG.num_kv_heads, 16, CFG.head_dim]) * 8
    assert plans["zipage"].page_bytes == kv_only + CFG.num_layers * CFG.num_kv_heads * 16 * 4
    assert plans["window"].reserved_swap_bytes == 3 * kv_only + slot
    no_history = kv_cache.compression_scratch_bytes(CFG, config(global_score=False), jnp.float32, 64)
    assert kv_cache.compression_scratch_bytes(CFG, window, jnp.float32, 64) == no_history
    assert no_history < kv_cache.compression_scratch_bytes(CFG, zipage, jnp.float32, 64)
    monkeypatch.undo()
    engines = {policy: LLM(MODEL, page_size=16, max_num_seqs=2, max_num_batched_tokens=128, max_model_len=64,
                           compression=True, kv_budget_pages=2, eviction_policy=policy,
                           compilation_cache_dir=None).engine for policy in ("window", "zipage")}
    runner = engines["window"].runner
    assert runner.state.score_cache.size == 1  # a stand-in
    assert engines["zipage"].runner.state.score_cache.shape == (CFG.num_layers, engines["zipage"].num_pages,
                                                                CFG.num_kv_heads, 16)
    k, _, scores, _ = runner.swap_out([1, 2], 0)
    assert k.shape[1] == 2 and scores.ndim == 0


def test_bad_budgets_and_bounds_raise():
    with pytest.raises(ValueError, match="max_compression_pages"):
        kv_cache.plan_memory(config(max_compression_pages=15), CFG, jnp.float32, 256)  # one request has 16
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        kv_cache.plan_memory(config(kv_cache_memory_bytes=50_000), CFG, jnp.float32, 256)
    for bad in (dict(num_query_rows=0), dict(num_query_rows=9), dict(admission="greedy"),
                dict(async_compression="yes"), dict(max_compression_pages=0), dict(metrics_interval_steps=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            config(**bad)


def test_scratch_estimates_bound_what_xla_allocates():
    llm = LLM(MODEL, page_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
              compression=True, kv_budget_pages=2, compilation_cache_dir=None, max_compression_pages=64)
    engine, runner = llm.engine, llm.engine.runner
    assert engine.memory_plan.num_query_rows == 8 and llm.metrics()["max_concurrency"] == 8
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    state = jax.tree.map(spec, runner.state)
    for rows, width in ((4, 16), (16, 3)):
        batch = CompressionBatch(src_tables=np.zeros((rows, width), np.int32), num_src_pages=np.zeros(rows, np.int32),
                                 dst_tables=np.zeros((rows, 2), np.int32), query_rows=np.zeros(rows, np.int32),
                                 logical_lens=np.zeros(rows, np.int32), compressed_before=np.zeros(rows, bool),
                                 valid=np.zeros(rows, bool))
        packed, batch_spec = packing.pack(batch)
        compiled = runner._compress.lower(state, jnp.asarray(packed), spec=batch_spec).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= kv_cache.compression_scratch_bytes(
            engine.model_cfg, engine.config, engine.dtype, rows * width)
    bound = kv_cache.step_scratch_bytes(engine.model_cfg, engine.config, engine.dtype, 256, "reference")
    steps = [p for p in runner.warmup_programs() if p.key[0] == "step"]
    assert {p.name.split()[0] for p in steps} == {"decode", "prefill"}
    for program in steps:
        compiled = program.jitted.lower(*jax.tree.map(spec, program.args), **program.static).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= bound


def test_fused_compression_reserves_less_scratch_and_only_for_kernel_backends():
    """The Mosaic kernels compact in place and score from the pool pages: their compression reserve drops the
    gathered and kept K/V (H200, Qwen3-8B shapes: 17.8 MB measured, BENCHMARKS.md), leaving the pool more
    pages; "full" redundancy still gathers keys. Tensor parallelism keeps the kernels (run per shard)."""
    from zipage_jax.layers.attention import resolve_backend, sharded
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES

    qwen = MODEL_SHAPES["qwen3-8b"]
    cfg = config(page_size=256, kv_budget_pages=8)
    fused = kv_cache.compression_scratch_bytes(qwen, cfg, jnp.bfloat16, 64 * 9, fused=True)
    assert 17.8e6 <= fused < kv_cache.compression_scratch_bytes(qwen, cfg, jnp.bfloat16, 64 * 9) / 10
    full = config(page_size=256, kv_budget_pages=8, redundancy="full")
    assert kv_cache.compression_scratch_bytes(qwen, full, jnp.bfloat16, 64 * 9, fused=True) > fused
    mosaic = resolve_backend("mosaic")
    plans = [kv_cache.plan_memory(config(), CFG, jnp.float32, 256, b) for b in (resolve_backend("reference"), mosaic)]
    assert 0 < plans[1].compression_scratch_bytes < plans[0].compression_scratch_bytes
    assert mosaic.fused_compression and not resolve_backend("reference").fused_compression
    assert sharded(mosaic, mesh=None).fused_compression
