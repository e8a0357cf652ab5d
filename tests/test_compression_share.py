"""The steady-state compression share of ``metrics()`` leaves out warm-up and compile time; the share since start
does not. A fake clock makes the wall times exact, so the oracle is plain arithmetic."""

import collections
import dataclasses
import types

import numpy as np
import pytest

from helpers import mixed_workload
from zipage_jax import LLM
from zipage_jax.benchmarks.probes import CompressionTimer
from zipage_jax.core.scheduler_output import SchedulerStats
from zipage_jax.engine import metrics as metrics_module
from zipage_jax.engine.metrics import EngineStats
from zipage_jax.worker.worker import WorkerStats
from seeds import fresh_seed

WARMUP_S, STEP_S = 1000.0, 0.5


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize("async_compression", [True, False])
def test_steady_share_excludes_warmup(monkeypatch, async_compression):
    """Asynchronous compressions are timed by a benchmark's observer (``CompressionTimer``), synchronous ones by the
    worker (the host waits for them anyway); either way the steady share leaves the warm-up out."""
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    llm = LLM("tests/fixtures/hf/qwen3_untied", page_size=16, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=160, compilation_cache_dir=None, compression=True, kv_budget_pages=2,
              async_compression=async_compression)
    engine = llm.engine
    if async_compression:
        engine.add_compression_observer(CompressionTimer())
    warmup = engine.worker.warmup

    def slow_warmup(progress=None, stop=None, ready_early=False):
        clock.now += WARMUP_S  # a long warm-up: it must not dilute the steady share
        return warmup(progress, stop, ready_early)

    monkeypatch.setattr(engine.worker, "warmup", slow_warmup)
    llm.warmup(use_tqdm=False)
    compiles = llm.metrics()["num_compiles"]
    step, steps = engine.step, []

    def timed_step(*args, **kwargs):
        clock.now += STEP_S
        steps.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", timed_step)
    seed = fresh_seed()
    prompts, params = mixed_workload(np.random.default_rng(seed), 250, 4, 60)
    params = [dataclasses.replace(p, max_tokens=60 + p.max_tokens) for p in params]
    llm.generate(prompts, params, use_tqdm=False)
    m = llm.metrics()
    compressing = engine.stats().worker.compression_s
    assert m["num_compiles"] == compiles and m["num_compressions"] > 0 and compressing > 0, seed
    assert m["steady_compression_time_share"] == pytest.approx(compressing / (len(steps) * STEP_S), rel=1e-12), seed
    assert m["compression_time_share"] == pytest.approx(compressing / (WARMUP_S + len(steps) * STEP_S),
                                                        rel=1e-12), seed


def stats(compression_s, compile_s, steps=0, decode_tokens=0) -> EngineStats:
    """A snapshot with only the counters the shares and rates read (the rest zero)."""
    scheduler = SchedulerStats(*[0] * 8, kv_pages_total=8, kv_pages_used=0, prefix_cache_hit_rate=0.0)
    worker = WorkerStats(compile_s=compile_s, compiled_on_use=0, compiling_in_background=False,
                         compression_dispatches=0, compression_s=compression_s, wide_compression_s=0.0)
    return EngineStats(scheduler, worker, collections.Counter(steps=steps, decode_tokens=decode_tokens), 0, 1)


def test_steady_share_subtracts_compiles_after_warmup(monkeypatch):
    """Programs compiled on first use after warm-up are start-up too (only the counters matter)."""
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    meter = metrics_module.Meter(0)
    clock.now = 100.0
    meter.mark_steady(stats(1.0, 5.0))  # warm-up's share
    clock.now = 200.0
    m = meter.metrics(stats(3.0, 25.0))
    assert m["steady_compression_time_share"] == pytest.approx(2.0 / (100.0 - 20.0))
    assert m["compression_time_share"] == pytest.approx(3.0 / 200.0)
    assert meter.metrics(stats(None, 25.0))["compression_time_share"] is None  # not measured: unknown, not 0


def test_reset_starts_the_history_and_the_shares_afresh(monkeypatch):
    """``LLMEngine.reset_metrics_history`` (a benchmark's workload after its warm-up): no samples, and rates and
    shares count from the reset (only the counters matter)."""
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    meter = metrics_module.Meter(1)
    clock.now = 40.0
    meter.totals.update(steps=1)
    assert meter.due()
    meter.sample(stats(8.0, 10.0, steps=1, decode_tokens=100))
    assert len(meter.samples) == 1
    clock.now = 50.0
    meter.reset(stats(8.0, 10.0, steps=1, decode_tokens=100))
    assert not meter.samples and meter.metrics(stats(8.0, 10.0))["compression_time_share"] == 0.0
    clock.now = 60.0
    meter.sample(stats(10.0, 12.0, steps=2, decode_tokens=130))
    (sample,) = meter.samples
    assert sample["time_s"] == 10.0 and sample["decode_tokens_per_s"] == 3.0 and sample["step"] == 2
    assert sample["compression_time_share"] == pytest.approx(0.2)
    m = meter.metrics(stats(10.0, 12.0))
    assert m["compression_time_share"] == pytest.approx(2.0 / 10.0)
    assert m["steady_compression_time_share"] == pytest.approx(2.0 / (10.0 - 2.0))  # less the compile time
