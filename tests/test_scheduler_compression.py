"""Property tests of the scheduler with compression on: the engine's step loop over a fake device with a
token-valued paged pool, query cache and token buffer (tests/fake_device.py). Anything lost, misplaced or
overwritten — or a compression reading pages a step reused before it ran — changes the output. Oracle: the same
fake run with the request alone in an ample pool.
"""

import numpy as np
from hypothesis import given, settings, strategies as st

from seeds import fresh_seed
from fake_device import PAGE, VOCAB, fake_engine, growing_limits, limits_st, run
from zipage_jax.config import ADMISSIONS
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.sampling_params import SamplingParams


def compressing_engine(num_pages, max_num_seqs=4, max_num_batched_tokens=16, max_num_prefill_seqs=2,
                       prefix_caching=True, budget=2, num_query_rows=2, admission="reserved", async_compression=True,
                       max_compression_pages=None, compression_batching=(1, 0)):
    return fake_engine(num_pages, max_num_seqs, max_num_batched_tokens, max_num_prefill_seqs, prefix_caching,
                       compression=True, kv_budget_pages=budget, num_query_rows=num_query_rows,
                       admission=admission, async_compression=async_compression,
                       max_compression_pages=max_compression_pages, compression_min_batch=compression_batching[0],
                       compression_max_wait_steps=compression_batching[1])


def alone(prompt, max_tokens, budget, default_budget=2) -> list[int]:
    engine = compressing_engine(num_pages=64, max_num_seqs=1, budget=default_budget, num_query_rows=1)
    r = Request("alone", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_budget_pages=budget), 0)
    run(engine, [r])
    return r.output_token_ids


prompt_st = st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=9),  # shared-ish head
                      st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
request_st = st.tuples(prompt_st, st.integers(1, 40), st.integers(0, 8), st.sampled_from([None, 1, 2, 3]))


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=8), extra_pages=st.integers(0, 3),
       max_num_seqs=st.integers(1, 5), num_query_rows=st.integers(1, 3), token_budget=st.integers(2, 20),
       admission=st.sampled_from(ADMISSIONS), async_compression=st.booleans(), prefix_caching=st.booleans(),
       max_compression_pages=st.sampled_from([None, 8, 12]),
       aborts=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 60)), max_size=2))
def test_random_compressed_workload_is_lossless(requests, extra_pages, max_num_seqs, num_query_rows, token_budget,
                                                admission, async_compression, prefix_caching, max_compression_pages,
                                                aborts):
    # the pages one request alone needs at its peak: its first compression point (Scheduler.first_due)
    peak = max(max(-(-len(head + tail) // PAGE), (2 if b is None else b) + 1) for (head, tail), _, _, b in requests)
    num_pages = peak + 1 + extra_pages
    engine = compressing_engine(num_pages, max_num_seqs, token_budget, 2, prefix_caching, 2,
                                min(num_query_rows, max_num_seqs), admission, async_compression, max_compression_pages)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m, kv_budget_pages=b), i)
            for i, ((head, tail), m, _, b) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a, _) in zip(reqs, requests)}
    abort_at = {}
    for which, when in aborts:
        abort_at.setdefault(when, []).append(reqs[which % len(reqs)])
    aborted = {r.request_id for rs in abort_at.values() for r in rs}
    run(engine, reqs, arrivals, abort_at)
    for r in reqs:
        want = alone(r.prompt_token_ids, r.sampling_params.max_tokens, r.sampling_params.kv_budget_pages)
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.request_id in aborted and r.output_token_ids == want[:len(r.output_token_ids)]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == want, r.request_id


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=2, max_size=4),
       max_tokens=st.lists(st.integers(10, 40), min_size=4, max_size=4), extra_pages=st.integers(0, 2),
       token_budget=st.integers(2, 20), async_compression=st.booleans(), prefix_caching=st.booleans())
def test_random_swap_prone_workload_is_lossless(prompts, max_tokens, extra_pages, token_budget, async_compression,
                                                prefix_caching):
    """The shape that swaps under hybrid admission: the front request has the largest budget and no query row yet
    when it needs a page, the requests behind it took the query rows first and are compressed."""
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m, kv_budget_pages=3 if i == 0 else 1), i)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    engine = compressing_engine(5 + extra_pages, len(reqs), token_budget, 2, prefix_caching, 1, len(reqs) - 1,
                                "hybrid", async_compression)
    run(engine, reqs)
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.sampling_params.max_tokens,
                                           r.sampling_params.kv_budget_pages), r.request_id


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=6), max_num_seqs=st.integers(2, 5),
       admission=st.sampled_from(ADMISSIONS), async_compression=st.booleans(), growth=limits_st,
       steps_each=st.integers(1, 10))
def test_compressed_steps_stay_within_the_limits_of_a_ready_early_warmup(requests, max_num_seqs, admission,
                                                                         async_compression, growth, steps_each):
    """Compression, query rows and swaps under the growing limits of a ready-early warm-up: within them, lossless."""
    peak = max(max(-(-len(head + tail) // PAGE), (2 if b is None else b) + 1) for (head, tail), _, _, b in requests)
    engine = compressing_engine(peak + 2, max_num_seqs, 20, 2, True, 2, 2, admission, async_compression)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m, kv_budget_pages=b), i)
            for i, ((head, tail), m, _, b) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a, _) in zip(reqs, requests)}
    run(engine, reqs, arrivals, on_step=growing_limits(engine, growth, steps_each))
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.sampling_params.max_tokens,
                                           r.sampling_params.kv_budget_pages), r.request_id


def long_requests(rng, n, max_tokens=40):
    return [Request(f"r{i}", rng.integers(0, VOCAB, size=int(rng.integers(3, 10))).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), i) for i in range(n)]


def test_memory_pressure_swaps_compressed_requests_losslessly():
    """Query rows go to whoever reaches its window first: the small-budget requests compress early, and when the
    large-budget front request needs a page, the compressed tail is swapped out (and back in later)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    engine = compressing_engine(num_pages=8, max_num_seqs=3, num_query_rows=2, budget=1, admission="hybrid")
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=2).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=30, kv_budget_pages=b), i)
            for i, b in enumerate([3, 1, 1])]
    run(engine, reqs)
    stats = engine.worker.counts
    assert stats["swaps"] > 0 and stats["compressions"] > 0, seed
    for r in reqs:
        assert r.num_swaps == (r.request_id == "r2"), seed
        assert r.output_token_ids == alone(r.prompt_token_ids, 30, r.sampling_params.kv_budget_pages), seed


def test_hybrid_admission_runs_more_than_the_query_rows_and_stalls_at_the_window():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hybrid = compressing_engine(num_pages=40, max_num_seqs=4, num_query_rows=1, budget=2)
    constrained = compressing_engine(num_pages=40, max_num_seqs=4, num_query_rows=1, budget=2, admission="constrained")
    for engine in (hybrid, constrained):
        reqs = long_requests(rng, 4, max_tokens=24)
        stats = engine.worker.counts

        def note_peak(engine):
            stats["peak_running"] = max(stats["peak_running"], len(engine.scheduler.running))

        run(engine, reqs, on_step=note_peak)
        for r in reqs:
            assert r.output_token_ids == alone(r.prompt_token_ids, 24, None), seed
    assert constrained.worker.counts["peak_running"] == 1 and hybrid.worker.counts["peak_running"] > 1, seed
    assert hybrid.worker.counts["stalls"] > 0, seed


def test_reserved_admission_does_not_thrash_where_hybrid_does():
    """Eight requests whose pages up to their first window (3 each) exceed a 12-page pool: hybrid admission lets
    them all run into their windows and preempts by recompute; reserved admission runs only as many without a
    query row as fit beside the holders, so nobody is preempted, yet more run than there are query rows."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=2).tolist() for _ in range(8)]
    preemptions = {}
    for admission in ("hybrid", "reserved"):
        engine = compressing_engine(num_pages=13, max_num_seqs=8, num_query_rows=3, budget=2, max_num_prefill_seqs=8,
                                    admission=admission)
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30), i) for i, p in enumerate(prompts)]
        peak = []
        run(engine, reqs, on_step=lambda e: peak.append(len(e.scheduler.running)))
        preemptions[admission] = engine.scheduler.num_preemptions
        assert max(peak) > 3, (admission, seed)
        for r in reqs:
            assert r.output_token_ids == alone(r.prompt_token_ids, 30, None), (admission, seed)
    assert preemptions["hybrid"] > 0 and preemptions["reserved"] == 0, (preemptions, seed)


def test_compression_batch_is_bounded_by_pages():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    engine = compressing_engine(num_pages=60, max_num_seqs=4, num_query_rows=4, budget=2, max_compression_pages=3)
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=4).tolist(),  # in lockstep: all due together
                    SamplingParams(temperature=0.0, max_tokens=30), i) for i in range(4)]
    run(engine, reqs)
    assert engine.worker.counts["stalls"] > 0, seed
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, 30, None), seed


def test_compression_batches_wait_for_company_at_most_max_wait_steps():
    """Requests falling due one after another are compressed in fewer dispatches when due ones wait for company;
    none waits longer than the bound, and every request decodes what it decodes alone."""
    seed = fresh_seed()
    prompts = [np.random.default_rng(seed + i).integers(0, VOCAB, size=1 + 2 * i).tolist() for i in range(4)]
    dispatches = {}
    for batching in ((1, 0), (4, 3)):
        engine = compressing_engine(num_pages=60, max_num_seqs=4, num_query_rows=4, budget=2,
                                    compression_batching=batching)
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40), i) for i, p in enumerate(prompts)]
        streak, longest = {}, [0]

        def on_step(engine):
            nonlocal streak
            stalled = engine.worker.last_output.stalled  # slots are plenty: only batching stalls
            streak = {id(r): streak.get(id(r), 0) + 1 for r in stalled}
            longest[0] = max([longest[0], *streak.values()])

        run(engine, reqs, on_step=on_step)
        assert longest[0] <= batching[1], seed
        for r in reqs:
            assert r.output_token_ids == alone(r.prompt_token_ids, 40, None), seed
        stats = engine.worker.counts
        dispatches[batching] = (stats["compression_dispatches"], stats["compressions"])
    (eager, eager_total), (batched, batched_total) = dispatches[(1, 0)], dispatches[(4, 3)]
    assert eager_total == batched_total and batched < eager, (seed, dispatches)


def test_async_and_sync_compression_produce_the_same_tokens():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(2, 12))).tolist() for _ in range(5)]
    outs = []
    for async_compression in (True, False):
        engine = compressing_engine(num_pages=20, max_num_seqs=5, num_query_rows=3,
                                    async_compression=async_compression)
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=36), i) for i, p in enumerate(prompts)]
        run(engine, reqs)
        outs.append([r.output_token_ids for r in reqs])
    assert outs[0] == outs[1], seed
