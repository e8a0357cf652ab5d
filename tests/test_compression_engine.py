"""Compressed PagedAttention through the whole engine (CPU, reference attention, tiny random checkpoints)."""

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import checkpoint_params, dense_logits, mixed_workload, warmup_programs
from zipage_jax import LLM, SamplingParams
from zipage_jax.worker.programs import Programs
from seeds import fresh_seed, seeded_rng

MODEL = "tests/fixtures/hf/qwen3_untied"  # GQA 8 q / 2 kv heads
PAGE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)


def make_llm(**kwargs):
    opts = dict(page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
                compilation_cache_dir=None)
    opts.update(kwargs)
    return LLM(MODEL, **opts)


def random_prompt(rng, n):
    return rng.integers(3, 250, size=n).tolist()


def window_policy_mask(total, prompt_len, budget, sinks):
    """Which keys each query sees under recent-window eviction: the exact oracle of the engine's mechanics.

    Before a request's first compression every earlier token is visible. A compression at logical length c (a
    multiple of the page size) keeps the sinks and the most recent ``budget * PAGE - sinks`` tokens, so a query at
    position q >= first compression sees those plus the tokens since c = PAGE * floor(q / PAGE).
    """
    first = max(budget + 1, -(-prompt_len // PAGE)) * PAGE
    q = np.arange(total)[:, None]
    k = np.arange(total)[None, :]
    start = (q // PAGE) * PAGE - (budget * PAGE - sinks)
    visible = (q < first) | (k < sinks) | (k >= start)
    return jnp.asarray((k <= q) & visible)


def masked_greedy_predictions(llm, prompt, output, budget, sinks):
    """Teacher-forced oracle: the greedy next token at every output position under the eviction mask.

    One dense forward over prompt + output; it equals ``output`` exactly when ``output`` is the greedy
    continuation under that mask (each token is then the argmax given the tokens before it).
    """
    engine = llm.engine
    ids = list(prompt) + list(output)
    mask = window_policy_mask(len(ids), len(prompt), budget, sinks)
    logits = dense_logits(checkpoint_params(engine), engine.model_cfg, jnp.asarray([ids], jnp.int32),
                          attention_mask=mask)
    return jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1).tolist()


@pytest.mark.parametrize("prompt_len,sinks", [(9, 0), (70, 4)])
def test_window_policy_equals_masked_dense_attention(prompt_len, sinks):
    """Eviction, compaction, recent-page refill and RoPE positions checked against a dense masked forward."""
    rng = seeded_rng()
    budget = 3
    llm = make_llm(compression=True, kv_budget_pages=budget, eviction_policy="window", sink_tokens=sinks)
    prompt = random_prompt(rng, prompt_len)
    params = dataclasses.replace(GREEDY, max_tokens=110)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.metrics["num_compressions"] >= 3
    tokens = out.outputs[0].token_ids
    assert len(tokens) == params.max_tokens
    assert tokens == masked_greedy_predictions(llm, prompt, tokens, budget, sinks)


def test_budget_above_length_equals_full_kv():
    rng = seeded_rng()
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(5, 40, size=4)]
    full = make_llm().generate(prompts, GREEDY, use_tqdm=False)
    compressed_llm = make_llm(compression=True, kv_budget_pages=8)  # 8 pages = 128 tokens > 40 + 70
    compressed = compressed_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compressed] == [o.outputs[0].token_ids for o in full]
    assert compressed_llm.metrics()["num_compressions"] == 0


@pytest.mark.parametrize("knobs", [
    dict(),  # defaults: global score, first-compression pooling, lightning redundancy
    dict(redundancy="full", pooling_first_only=False, sink_tokens=2),
    dict(global_score=False, pooling=False, redundancy="off"),
])
def test_pages_bounded_shared_prefix_intact_and_no_leaks(knobs):
    """Every step: compressed requests hold <= M+1 pages, page accounting is exact, shared pages are untouched."""
    rng = seeded_rng()
    budget = 2
    llm = make_llm(compression=True, kv_budget_pages=budget, **knobs)
    engine = llm.engine
    prefix = random_prompt(rng, 2 * PAGE + 3)
    warm = llm.generate([prefix], dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)
    assert warm[0].outputs[0].token_ids
    shared = [engine.page_manager.hash_to_page[h] for h in list(engine.page_manager.hash_to_page)[:2]]
    before = np.asarray(engine.worker.state.k_pool[:, shared]), np.asarray(engine.worker.state.v_pool[:, shared])
    # the holder keeps a reference to the shared pages while the others compress (and copy them on write)
    engine.add_request("holder", prefix + random_prompt(rng, 4), dataclasses.replace(GREEDY, kv_budget_pages=8))
    for i in range(4):
        engine.add_request(f"r{i}", prefix + random_prompt(rng, 5 + i), GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        engine.page_manager.check_invariants(live)
        for r in engine.scheduler.running:
            if r.compressed:
                assert len(r.page_ids) <= budget + 1
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in finished.values())
    assert all(o.metrics["num_cached_tokens"] == 2 * PAGE for o in finished.values())
    compressed = [finished[f"r{i}"].metrics for i in range(4)]
    assert all(m["num_compressions"] >= 3 for m in compressed)
    assert all(m["peak_kv_pages_after_compression"] <= budget + 1 for m in compressed)
    np.testing.assert_array_equal(np.asarray(engine.worker.state.k_pool[:, shared]), before[0])
    np.testing.assert_array_equal(np.asarray(engine.worker.state.v_pool[:, shared]), before[1])
    assert engine.metrics()["kv_pages_used"] == 0


def test_per_request_budget_and_invalid_knobs():
    rng = seeded_rng()
    llm = make_llm(compression=True, kv_budget_pages=4)
    tight = dataclasses.replace(GREEDY, kv_budget_pages=2)
    outs = llm.generate([random_prompt(rng, 10)] * 2, [GREEDY, tight], use_tqdm=False)
    assert outs[0].metrics["peak_kv_pages_after_compression"] <= 5
    assert outs[1].metrics["peak_kv_pages_after_compression"] <= 3
    assert outs[1].metrics["num_compressions"] > outs[0].metrics["num_compressions"]
    wide = make_llm(compression=True, kv_budget_pages=4, window=PAGE, sink_tokens=4)
    with pytest.raises(ValueError, match="kv_budget_pages"):
        wide.engine.add_request("no-room", [5, 6, 7], dataclasses.replace(GREEDY, kv_budget_pages=1))
    with pytest.raises(ValueError, match="kv_budget_pages"):
        make_llm().engine.add_request("full-kv", [5, 6, 7], tight)
    for bad in (dict(window=0), dict(window=PAGE * 2), dict(eviction_policy="lru"), dict(redundancy="some"),
                dict(decay=1.5), dict(pooling_width=4), dict(sink_tokens=PAGE * 8)):
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            make_llm(compression=True, kv_budget_pages=4, **bad)


def test_swaps_and_stalls_are_lossless_and_async_equals_sync():
    """Under memory pressure that greedy (hybrid) admission lets in: the small-budget requests take both query
    rows first, the large-budget front request (still without one) runs out of pages and the compressed tail is
    swapped out and back. Every request decodes what it decodes alone with the same budget (run one at a time
    first, on the first engine: alone, a request fits its pages and never swaps), in asynchronous and synchronous
    mode alike."""
    rng = seeded_rng()
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(2, 6, size=3)]
    params = [dataclasses.replace(GREEDY, kv_budget_pages=b) for b in (3, 1, 1)]
    tight = dict(compression=True, kv_budget_pages=1, window=4, num_gpu_pages_override=8, max_model_len=112,
                 max_num_seqs=3, num_query_rows=2, metrics_interval_steps=1, admission="hybrid")
    want = None
    for async_compression in (True, False):
        llm = make_llm(async_compression=async_compression, **tight)
        if want is None:  # prompts shorter than a page: nothing the runs alone leave in the prefix cache is hit
            want = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
            assert llm.metrics()["num_swaps"] == 0
            llm.engine.reset_metrics_history()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        m = llm.metrics()
        assert m["num_swaps"] > 0 and m["num_compressions"] > 0 and m["kv_pages_used"] == 0
        history = llm.engine.metrics_history()
        assert max(h["num_swapped"] for h in history) >= 1 and max(h["query_rows_used"] for h in history) == 2
        assert all(0 <= h["page_occupancy"] <= 1 for h in history)


def test_ready_early_serves_within_the_compiled_buckets_then_compiles_the_rest_and_a_mixed_workload_nothing(
        monkeypatch):
    """``warmup(ready_early=True)`` compiles only a light load's programs. While the rest are held back, a workload
    larger than those buckets (12 requests over 8 decode rows, prompts over 16-token chunks, several compressions
    due at once) runs within them: no step waits on a compile. Released, the background compiles every other
    program, the limits lift, and the same workload in the full buckets gives the same tokens. With every warm-up
    program compiled, a mixed workload (every sampling feature, prompt logprobs, several compressions a request)
    compiles nothing more."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(20, 120, size=12)]
    held, start_background = [], Programs.compile_in_background
    monkeypatch.setattr(Programs, "compile_in_background", lambda *args, **kwargs: held.append((args, kwargs)))
    llm = make_llm(compression=True, kv_budget_pages=2, max_num_seqs=16, max_num_batched_tokens=64,
                   max_model_len=192)
    worker, programs = llm.engine.worker, llm.engine.worker.programs
    report = llm.engine.warmup(ready_early=True)
    every = {p.key for p in warmup_programs(worker)}
    assert report["programs"] + report["background"] == len(every) and report["background"] > 0
    assert worker.limits() == (8, 16)  # the smallest decode and prefill buckets
    peak = collections.Counter()

    def note(record):
        peak["running"] = max(peak["running"], len(llm.engine.scheduler.running))

    llm.engine.add_step_observer(note)
    limited = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics["num_compressions"] for o in limited) > len(prompts), seed
    assert llm.metrics()["num_compiles_waited_on"] == 0 and peak["running"] == 8, seed
    assert set(programs.compiled) < every

    start_background(*held[0][0], **held[0][1])
    programs.join_background()
    assert every <= set(programs.compiled) and worker.limits() is None
    assert not llm.metrics()["compiling_in_background"]
    full = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in limited] == [o.outputs[0].token_ids for o in full], seed
    assert llm.metrics()["num_compiles_waited_on"] == 0 and peak["running"] == 12, seed

    before = llm.metrics()["num_compiles"]
    # prompts below 90 tokens (the two sharing a prefix below 180, within max_model_len 192)
    prompts, params = mixed_workload(rng, 250, 8, 90)
    params = [dataclasses.replace(p, max_tokens=60 + p.max_tokens) for p in params]  # several compressions each
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics["num_compressions"] for o in outs) > 0, seed
    assert llm.metrics()["num_compiles"] == before, seed
