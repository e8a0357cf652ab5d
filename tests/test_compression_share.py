"""The steady-state compression share of ``metrics()`` leaves out warm-up and compile time; the share since start
does not. A fake clock makes the wall times exact, so the oracle is plain arithmetic."""

import collections
import dataclasses
import types

import numpy as np
import pytest

from helpers import mixed_workload
from zipage_jax import LLM
from zipage_jax.engine import metrics as metrics_module
from seeds import fresh_seed

WARMUP_S, STEP_S = 1000.0, 0.5


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_steady_share_excludes_warmup(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    llm = LLM("tests/fixtures/hf/qwen3_untied", page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=160, compilation_cache_dir=None, compression=True, kv_budget_pages=2)
    engine = llm.engine
    warmup = engine.runner.warmup

    def slow_warmup(progress=None, stop=None, ready_early=False):
        clock.now += WARMUP_S  # a long warm-up: it must not dilute the steady share
        return warmup(progress, stop, ready_early)

    engine.runner.warmup = slow_warmup
    llm.warmup(use_tqdm=False)
    compiles = llm.metrics()["num_compiles"]
    step, steps = engine.step, []

    def timed_step(*args, **kwargs):
        clock.now += STEP_S
        steps.append(1)
        return step(*args, **kwargs)

    engine.step = timed_step
    seed = fresh_seed()
    prompts, params = mixed_workload(np.random.default_rng(seed), 250, 4, 60)
    params = [dataclasses.replace(p, max_tokens=60 + p.max_tokens) for p in params]
    llm.generate(prompts, params, use_tqdm=False)
    m = llm.metrics()
    compressing = engine.runner.compression_seconds
    assert m["num_compiles"] == compiles and m["num_compressions"] > 0 and compressing > 0, seed
    assert m["steady_compression_time_share"] == pytest.approx(compressing / (len(steps) * STEP_S), rel=1e-12), seed
    assert m["compression_time_share"] == pytest.approx(compressing / (WARMUP_S + len(steps) * STEP_S),
                                                        rel=1e-12), seed


def test_steady_share_subtracts_compiles_after_warmup(monkeypatch):
    """Programs compiled on first use after warm-up are start-up too (a stub engine: only the counters matter)."""
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    runner = types.SimpleNamespace(compression_seconds=0.0, programs=types.SimpleNamespace(compile_wall_s=0.0))
    stub = types.SimpleNamespace(runner=runner)
    history = metrics_module.MetricsHistory(0)
    clock.now, runner.compression_seconds, runner.programs.compile_wall_s = 100.0, 1.0, 5.0  # warm-up's share
    history.mark_steady(stub)
    clock.now, runner.compression_seconds, runner.programs.compile_wall_s = 200.0, 3.0, 25.0
    assert history.steady_compression_share(stub) == pytest.approx(2.0 / (100.0 - 20.0))
    assert history.compression_share(stub) == pytest.approx(3.0 / 200.0)


def test_reset_starts_the_history_and_the_shares_afresh(monkeypatch):
    """``LLMEngine.reset_metrics_history`` (a benchmark's workload after its warm-up): no samples, and rates and
    shares count from the reset (a stub engine: only the counters matter)."""
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    runner = types.SimpleNamespace(compression_seconds=0.0, programs=types.SimpleNamespace(compile_wall_s=0.0))
    scheduler = types.SimpleNamespace(running=[], waiting=[], swapped=[], num_stalled=0, num_query_rows=0,
                                      free_query_rows=[], num_preemptions=0, num_swaps=0)
    stub = types.SimpleNamespace(runner=runner, scheduler=scheduler, totals=collections.Counter(),
                                 page_manager=types.SimpleNamespace(num_used_pages=0, num_pages=9))
    history = metrics_module.MetricsHistory(1)
    clock.now, runner.compression_seconds, runner.programs.compile_wall_s = 40.0, 8.0, 10.0
    stub.totals.update(steps=1, decode_tokens=100)
    history.maybe_sample(stub)
    assert len(history.samples) == 1
    clock.now = 50.0
    history.reset(stub)
    assert not history.samples and history.compression_share(stub) == 0.0
    clock.now, runner.compression_seconds, runner.programs.compile_wall_s = 60.0, 10.0, 12.0
    stub.totals.update(steps=1, decode_tokens=30)
    history.maybe_sample(stub)
    (sample,) = history.samples
    assert sample["time_s"] == 10.0 and sample["decode_tokens_per_s"] == 3.0
    assert sample["compression_time_share"] == pytest.approx(0.2)
    assert history.compression_share(stub) == pytest.approx(2.0 / 10.0)
    assert history.steady_compression_share(stub) == pytest.approx(2.0 / (10.0 - 2.0))  # less the compile time
