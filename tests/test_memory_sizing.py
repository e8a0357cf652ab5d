"""Memory sizing (docs/ARCHITECTURE.md, Compression: concurrency): pool size, query rows C and concurrency from a
byte budget, with the peak step and compression scratch reserved; the scratch estimates bound what XLA actually
allocates."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import warmup_programs
from zipage_jax import LLM
from zipage_jax.worker import device_memory, kv_cache
from zipage_jax.worker.catalog import CompressionShape
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
    return int(page), int(slot) if c.scoring.eviction_policy == "zipage" else 0  # the only policy reading queries


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


OURS = device_memory.Allocator(0.9, "set to gpu_memory_utilization=0.9")  # the engine started the backend


class FakeDevice:
    """A device whose allocator reports ``limit`` bytes it may hold and ``in_use`` held (jax's memory_stats keys)."""

    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use, "num_allocs": 9}

    def memory_stats(self):
        return dict(self.stats)


def test_device_budget_reserves_step_and_compression_scratch():
    rng = seeded_rng()
    budget, weights = 5_000_000, int(rng.integers(10**6, 10**9))
    device = FakeDevice(weights + device_memory.HEADROOM_BYTES + budget, weights)
    c = config()  # the allocator holds gpu_memory_utilization of the card: the share is all of its limit
    plan = kv_cache.plan_memory(c, CFG, jnp.float32, 256, device=device,
                                allocator=OURS)
    assert (plan.budget_source, plan.budget_bytes, plan.weights_bytes) == ("gpu_memory_utilization", budget, weights)
    reserved = plan.step_scratch_bytes + plan.compression_scratch_bytes + plan.reserved_swap_bytes
    assert plan.reserved_step_scratch_bytes > 0 and plan.reserved_compression_scratch_bytes > 0
    page, slot = shapes_bytes(CFG, c, 4)
    assert plan.reserved_swap_bytes == 3 * page + slot
    assert plan.num_query_rows == min(8, (budget - reserved) // (3 * page + slot))
    assert plan.pool_bytes + plan.query_cache_bytes + reserved <= budget
    assert plan.headroom_bytes >= device_memory.HEADROOM_BYTES
    hybrid = plan
    constrained = kv_cache.plan_memory(config(admission="constrained"), CFG, jnp.float32, 256, device=device,
                                       allocator=OURS)
    assert hybrid.max_concurrency == 8 and constrained.max_concurrency == constrained.num_query_rows


def test_window_policy_holds_and_reserves_no_score_or_query_cache():
    """Recent-window eviction never reads a score history or window queries: no score cache and no query cache on
    the device, no bytes for them in the plan (pages, query rows, compression scratch, swap staging), none in a
    swap, whose round trip still restores the pages; its query rows still commit their holders' pages."""
    device = FakeDevice(device_memory.HEADROOM_BYTES + 5_000_000, 0)
    window, zipage = config(eviction_policy="window"), config()
    plans = {c.scoring.eviction_policy: kv_cache.plan_memory(c, CFG, jnp.float32, 256, device=device, allocator=OURS)
             for c in (window, zipage)}
    kv_only, slot = shapes_bytes(CFG, window, 4)
    assert slot == 0 and shapes_bytes(CFG, zipage, 4)[1] > 0
    assert plans["window"].page_bytes == kv_only == np.prod([CFG.num_layers, CFG.num_kv_heads, 16, CFG.head_dim]) * 8
    assert plans["zipage"].page_bytes == kv_only + CFG.num_layers * CFG.num_kv_heads * 16 * 4
    assert plans["window"].reserved_swap_bytes == 3 * kv_only
    assert (plans["window"].query_row_bytes, plans["window"].query_cache_bytes) == (0, 0)
    assert plans["window"].num_query_rows >= 1 and plans["zipage"].query_cache_bytes > 0
    no_history = kv_cache.compression_scratch_bytes(CFG, config(global_score=False), jnp.float32, 64)
    assert kv_cache.compression_scratch_bytes(CFG, window, jnp.float32, 64) == no_history
    assert no_history < kv_cache.compression_scratch_bytes(CFG, zipage, jnp.float32, 64)
    engines = {policy: LLM(MODEL, page_size=16, max_num_seqs=2, max_num_batched_tokens=128, max_model_len=64,
                           compression=True, kv_budget_pages=2, eviction_policy=policy,
                           compilation_cache_dir=None).engine for policy in ("window", "zipage")}
    worker = engines["window"].worker
    assert worker.state.score_cache.size == 1 and worker.state.query_cache.size == 1  # stand-ins
    zipage_state, num_pages = engines["zipage"].worker.state, engines["zipage"].num_pages
    assert zipage_state.score_cache.shape == (CFG.num_layers, num_pages, CFG.num_kv_heads, 16)
    assert zipage_state.query_cache.shape == (CFG.num_layers, engines["zipage"].memory_plan.num_query_rows + 1,
                                              zipage.scoring.window, CFG.num_heads, CFG.head_dim)
    rng = seeded_rng()
    k_pool = rng.standard_normal(worker.state.k_pool.shape).astype(np.float32)
    worker.state = worker.state.replace(k_pool=jnp.asarray(k_pool, worker.state.k_pool.dtype))
    k, v, scores, queries = worker.swap_out([1, 2], 0)
    assert k.shape[1] == 2 and scores.ndim == 0 and queries.ndim == 0
    worker.swap_in([3, 4], 0, (k, v, scores, queries))
    np.testing.assert_array_equal(np.asarray(worker.state.k_pool[:, 3:5]), k_pool[:, 1:3])


# -- the engine's share of a card (vLLM's rule) -------------------------------------------------------------------
H100 = 85_520_809_984  # what an 80 GB H100 reports in all


def qwen3_8b_weight_bytes(m) -> int:
    """bf16 bytes of Qwen3-8B's weights, from its shapes: embedding and LM head, per layer q/k/v/o, the MLP and
    the four norms, the final norm."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
    layer += 2 * m.hidden_size + 2 * m.head_dim
    return 2 * (2 * m.vocab_size * m.hidden_size + m.num_layers * layer + m.hidden_size)


def qwen3_8b_plan(allocator, utilization=0.9, **kwargs):
    """The default engine's plan for Qwen3-8B shapes on an H100 whose allocator holds ``allocator.fraction``."""
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.layers.attention import resolve_backend

    qwen = MODEL_SHAPES["qwen3-8b"]
    weights = qwen3_8b_weight_bytes(qwen)
    assert 16.3e9 < weights < 16.5e9  # Qwen3-8B: 8.2 B parameters
    c = EngineConfig.from_kwargs("unused", gpu_memory_utilization=utilization, **kwargs)
    device = FakeDevice(int(allocator.fraction * H100), weights)
    plan = kv_cache.plan_memory(c, qwen, jnp.bfloat16, qwen.max_position_embeddings, resolve_backend("mosaic"),
                                device=device, allocator=allocator)
    return plan, weights


def test_default_engine_on_an_80_gb_card_gets_vllms_pool():
    """gpu_memory_utilization is the share of the card for weights + KV pool + scratch, as in vLLM: the default
    LLM() of Qwen3-8B shapes gets a pool within 5 % of 0.9 x card - weights - scratch (jax's default allocator
    fraction times 0.9 gave 35 GB, a third less)."""
    plan, weights = qwen3_8b_plan(OURS)
    vllm = 0.9 * H100 - weights - plan.scratch_bytes
    assert plan.card_bytes == pytest.approx(H100, rel=1e-6) and plan.share_bytes == pytest.approx(0.9 * H100, 1e-6)
    assert 0.95 * vllm <= plan.pool_bytes <= vllm
    assert plan.pool_bytes > 50e9 and plan.weights_bytes == weights
    assert plan.pool_bytes + plan.scratch_bytes + weights + plan.headroom_bytes == plan.share_bytes
    line = plan.describe()
    assert "card 79.65 GiB" in line and "weights 15.2" in line and "headroom 2.0" in line
    assert "max concurrency 256" in line


def test_an_allocator_that_holds_less_bounds_the_plan_and_says_why(caplog):
    """A user's fraction wins (logged); jax's default fraction, met when its backend started before the engine,
    is warned about. Either way the plan stays within what the allocator holds."""
    with caplog.at_level("INFO", logger="zipage_jax.worker.device_memory"):
        user, weights = qwen3_8b_plan(device_memory.Allocator(0.6, "XLA_CLIENT_MEM_FRACTION=0.6", user_set=True))
    assert user.share_bytes == pytest.approx(0.6 * H100, rel=1e-6)
    assert user.pool_bytes + user.scratch_bytes + weights <= 0.6 * H100
    [record] = caplog.records
    assert record.levelname == "INFO" and "XLA_CLIENT_MEM_FRACTION=0.6" in record.getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="zipage_jax.worker.device_memory"):
        late, _ = qwen3_8b_plan(device_memory.Allocator(0.75, "jax's default: its backend started before"))
    [record] = caplog.records
    assert record.levelname == "WARNING" and "75%" in record.getMessage()
    assert "XLA_CLIENT_MEM_FRACTION" in record.getMessage()
    assert late.share_bytes == pytest.approx(0.75 * H100, rel=1e-6)
    caplog.clear()
    with caplog.at_level("INFO", logger="zipage_jax.worker.device_memory"):
        smaller, _ = qwen3_8b_plan(device_memory.Allocator(0.75, "jax's default"), utilization=0.5)
    assert not caplog.records and smaller.share_bytes == pytest.approx(0.5 * H100, rel=1e-6)


@pytest.mark.parametrize("field,value", [("kv_cache_memory_bytes", 60 * 2**30), ("num_gpu_pages_override", 1600)])
def test_an_explicit_pool_that_cannot_fit_is_a_value_error_at_start(field, value):
    """40 GB on an 80 GB card beside 16 GB of weights fits (once the allocator holds 0.9 of the card); 60 GB or
    1600 pages of 256 tokens (56 GiB) do not: the error names the field and the card, weights, scratch and pool."""
    fits, _ = qwen3_8b_plan(OURS, kv_cache_memory_bytes=40 * 10**9)
    assert fits.budget_source == "kv_cache_memory_bytes" and fits.pool_bytes <= 40e9
    with pytest.raises(ValueError, match=field) as error:
        qwen3_8b_plan(OURS, **{field: value})
    message = str(error.value)
    for number in ("79.65 GiB card", "weights take 15.2", "step scratch", "headroom 2.00 GiB", "KV pool of"):
        assert number in message, message


def test_a_device_share_too_small_for_one_request_names_gpu_memory_utilization():
    with pytest.raises(ValueError, match="gpu_memory_utilization: the engine's share of the 79.65 GiB card"):
        qwen3_8b_plan(OURS, utilization=0.21)


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
    engine, worker = llm.engine, llm.engine.worker
    assert engine.memory_plan.num_query_rows == 8 and llm.metrics()["max_concurrency"] == 8
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    for rows, width in ((4, 16), (16, 3)):
        program, _ = worker.catalog.compress_program([], CompressionShape(2, width, rows), worker.state)
        compiled = program.jitted.lower(*jax.tree.map(spec, program.args), **program.static).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= kv_cache.compression_scratch_bytes(
            engine.model_cfg, engine.config, worker.dtype, rows * width)
    bound = kv_cache.step_scratch_bytes(engine.model_cfg, engine.config, worker.dtype, 256, "reference")
    steps = [p for p in warmup_programs(worker) if p.key[0] == "step"]
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
    # a dispatch of 4 rows compacts through XLA (``attention.compaction_by_rows``): 33.8 MB measured on an H100
    assert kv_cache.compression_scratch_bytes(qwen, cfg, jnp.bfloat16, 4 * 9, fused=True) >= 33.8e6
    mosaic = resolve_backend("mosaic")
    plans = [kv_cache.plan_memory(config(), CFG, jnp.float32, 256, b) for b in (resolve_backend("reference"), mosaic)]
    assert 0 < plans[1].compression_scratch_bytes < plans[0].compression_scratch_bytes
    assert mosaic.fused_compression and not resolve_backend("reference").fused_compression
    assert sharded(mosaic, mesh=None).fused_compression


# -- the allocator set up before jax's backend starts (a fresh process each: a backend starts once) ---------------
ALLOCATOR_PROBE = """
import dataclasses, json, logging, os, sys
from jax._src import xla_bridge

seen = {}
cpu = xla_bridge._backend_factories["cpu"]

def spy(*args, **kwargs):  # what the allocator would read when the backend is created
    seen.update({name: os.environ.get(name) for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")})
    return cpu.factory(*args, **kwargs)

xla_bridge._backend_factories["cpu"] = dataclasses.replace(cpu, factory=spy)
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from zipage_jax.engine.llm_engine import LLMEngine  # imports start no backend
assert not xla_bridge.backends_are_initialized()
engine = LLMEngine.from_kwargs("tests/fixtures/hf/qwen3_untied", gpu_memory_utilization=0.6, page_size=16,
                               max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                               compilation_cache_dir=None)
after = {name: os.environ.get(name) for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
print("PROBE", json.dumps(dict(at_start=seen, after=after, allocator=dataclasses.asdict(engine.worker.allocator))))
"""


def run_probes(*settings):
    """The probe in a fresh process per setting, each in this environment less any allocator fraction."""
    base = {k: v for k, v in os.environ.items() if k not in device_memory.FRACTION_VARIABLES}
    root = pathlib.Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", ALLOCATOR_PROBE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=root, env={**base, **extra}) for extra in settings]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        results.append((json.loads(out.split("PROBE ", 1)[1]), out))
    return results


def test_the_engine_sets_the_allocator_before_the_backend_starts_and_a_users_setting_wins():
    (ours, log), (users, _) = run_probes({}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    # no setting: the backend starts with the fraction at gpu_memory_utilization; child processes do not inherit it
    assert ours["at_start"] == {"XLA_CLIENT_MEM_FRACTION": "0.6", "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    assert ours["after"] == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    assert ours["allocator"]["fraction"] == 0.6 and not ours["allocator"]["user_set"]
    assert "memory plan: KV pool" in log  # one line (CPU reports no memory: the CPU default pool)
    # the user's own variable wins, and the engine sets none beside it (jax refuses both names at once)
    assert users["at_start"] == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert users["after"] == users["at_start"]
    assert users["allocator"] == {"fraction": 0.5, "source": "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5", "user_set": True}


def test_the_plan_counts_the_weights_from_the_engines_arrays_so_every_start_plans_alike(caplog):
    """The allocator's bytes in use move by tens of MB between starts (transient buffers of the weight load); the
    plan counts the weights from their arrays instead, so the pool and every program's shapes (the executable
    store's keys) repeat. What else is in use comes out of the headroom, warned about when it is large."""
    weights = 16_000_000_000
    plans = [kv_cache.plan_memory(config(), CFG, jnp.float32, 256, device=FakeDevice(H100, weights + extra),
                                  allocator=OURS, weights_bytes=weights)
             for extra in (0, 37_000_000, 61_000_000)]
    assert len({(p.budget_bytes, p.num_pages, p.num_query_rows) for p in plans}) == 1
    assert plans[0].weights_bytes == weights
    moved = kv_cache.plan_memory(config(), CFG, jnp.float32, 256, device=FakeDevice(H100, weights + 61_000_000),
                                 allocator=OURS)
    assert moved.budget_bytes == plans[0].budget_bytes - 61_000_000  # reading bytes_in_use: the pool moves with it
    with caplog.at_level("WARNING", logger="zipage_jax.worker.device_memory"):
        held = [kv_cache.plan_memory(config(), CFG, jnp.float32, 256, device=FakeDevice(H100, weights + extra),
                                     allocator=OURS, weights_bytes=weights)
                for extra in (int(12.9 * 2**30), int(12.3 * 2**30))]
    # 12.9 GiB held beside the weights (a benchmark's second copy): the plan leaves 13 GiB out instead of placing a
    # pool that cannot fit, in whole GiB so that starts holding a little more or less plan alike
    assert "plan leaves 13 GiB out" in caplog.text
    assert {(p.num_pages, p.held_bytes) for p in held} == {(held[0].num_pages, 13 * 2**30)}
    assert held[0].budget_bytes == plans[0].budget_bytes - 13 * 2**30
    h = held[0]
    assert h.pool_bytes + h.query_cache_bytes + h.scratch_bytes + h.weights_bytes + h.held_bytes + h.headroom_bytes \
        == h.share_bytes
    assert "other arrays 13.00 GiB" in held[0].describe() and plans[0].held_bytes == 0


def test_the_pools_are_two_buffers_and_a_pool_the_allocator_did_not_grow_by_is_warned_about(caplog):
    """The pools are fills of a runtime operand, one execution each: a program whose output was a constant handed
    back pools the allocator never held, and the first step that donated them allocated the missing one after
    warm-up fragmented the free memory (an 80 GB H100's full-KV engine failed its first step so). Where the
    device reports its allocator, a state that did not grow it by its size is warned about."""
    from zipage_jax.worker import device_state
    from zipage_jax import parallel

    c = config(compression=False)
    state = device_state.allocate(c, CFG, 32, 0, jnp.float32, parallel.make_mesh(1, CFG))
    assert state.k_pool.unsafe_buffer_pointer() != state.v_pool.unsafe_buffer_pointer()
    assert not np.shares_memory(np.asarray(state.k_pool), np.asarray(state.v_pool))
    assert not np.asarray(state.k_pool).any() and not np.asarray(state.score_cache).any()
    device = FakeDevice(80 * 2**30, 20 * 2**30)
    with caplog.at_level("WARNING", logger="zipage_jax.worker.device_memory"):
        assert device_memory.check_allocated(device, 20 * 2**30 - 2 * 2**30, 2 * 2**30, "pools") == 2 * 2**30
        assert not caplog.text
        assert device_memory.check_allocated(device, 20 * 2**30 - 2**30, 2 * 2**30, "pools") == 2**30
    assert "pools: 1.00 GiB allocated" in caplog.text and "2.00 GiB were expected" in caplog.text
    assert device_memory.check_allocated(jax.devices("cpu")[0], None, 2**30, "pools") is None
