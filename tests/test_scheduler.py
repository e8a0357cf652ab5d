"""Property tests of the scheduler in full-KV mode: the engine's step loop over a fake device with a token-valued
paged pool (tests/fake_device.py). Oracle: a request alone produces ``out[k] = next_token(prompt + out[:k])``.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from seeds import fresh_seed
from fake_device import PAGE, VOCAB, digest, fake_engine, growing_limits, limits_st, run
from zipage_jax.benchmarks.probes import HoldingScheduler
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker.worker import Executor


def alone(prompt, max_tokens) -> list[int]:
    """What the fake device samples after each prefix: a hash of its (position, token) slots."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(digest(enumerate(seq)) % VOCAB)
    return seq[len(prompt):]


prompt_st = st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=9),  # shared-ish head
                      st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
request_st = st.tuples(prompt_st, st.integers(1, 12), st.integers(0, 6))  # prompt, max_tokens, arrival step
MAX_LEN = 9 + 14 + 12


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=10),
       extra_pages=st.integers(0, 12), max_num_seqs=st.integers(1, 6), budget=st.integers(1, 24),
       max_num_prefill_seqs=st.integers(1, 3), prefix_caching=st.booleans(),
       aborts=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), max_size=3))
def test_random_workload_is_lossless_and_bounded(requests, extra_pages, max_num_seqs, budget,
                                                 max_num_prefill_seqs, prefix_caching, aborts):
    num_pages = -(-MAX_LEN // PAGE) + 1 + extra_pages  # one full-length request always fits
    engine = fake_engine(num_pages, max_num_seqs, budget, max_num_prefill_seqs, prefix_caching)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m), i)
            for i, ((head, tail), m, _) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a) in zip(reqs, requests)}
    abort_at = {}
    for which, when in aborts:
        abort_at.setdefault(when, []).append(reqs[which % len(reqs)])
    aborted = {r.request_id for rs in abort_at.values() for r in rs}
    max_steps = 50 + sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in reqs) * 4
    run(engine, reqs, arrivals, abort_at, max_steps)
    for r in reqs:
        want = alone(r.prompt_token_ids, r.sampling_params.max_tokens)
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.request_id in aborted and r.output_token_ids == want[:len(r.output_token_ids)]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == want, r.request_id


def test_tight_pool_preempts_and_stays_lossless():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    engine = fake_engine(num_pages=7, max_num_seqs=4, max_num_batched_tokens=8, max_num_prefill_seqs=2)
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=int(rng.integers(5, 12))).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=12), i) for i in range(4)]
    run(engine, reqs, max_steps=500)
    assert engine.scheduler.num_preemptions > 0, seed
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, 12), seed


def test_the_fake_device_is_a_whole_executor():
    """The engine's warm-up and its metrics run over the fake device as over the real worker (both implement
    every member of ``Executor`` the engine reads); unmeasured compression time is None, not 0."""
    engine = fake_engine(num_pages=8, max_num_seqs=2)
    assert isinstance(engine.worker, Executor)
    assert engine.warmup() == dict(programs=0, compile_s=0.0)
    reqs = [Request("r", [1, 2, 0, 1, 2], SamplingParams(temperature=0.0, max_tokens=6), 0)]
    run(engine, reqs)
    assert reqs[0].output_token_ids == alone(reqs[0].prompt_token_ids, 6)
    metrics = engine.metrics()
    # the first token comes with the prefill, the other five from decode steps
    assert metrics["steady_compression_time_share"] is None and metrics["generation_tokens_total"] == 5


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=6), extra_pages=st.integers(0, 6),
       max_num_seqs=st.integers(1, 4), parks=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 25),
                                                                st.integers(0, 8), st.booleans()), max_size=4))
def test_held_requests_keep_their_pages_and_resume_losslessly(requests, extra_pages, max_num_seqs, parks):
    """The decode benchmark's ``HoldingScheduler``: a held request neither advances nor loses a page or row while
    others run (and take no row it holds); released, it ends as if it had run alone; aborted while held, it frees
    everything."""
    engine = fake_engine(-(-MAX_LEN // PAGE) + 1 + extra_pages, max_num_seqs, scheduler_cls=HoldingScheduler)
    scheduler = engine.scheduler
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m), i)
            for i, ((head, tail), m, _) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a) in zip(reqs, requests)}
    events = {}  # step -> [(request, park | resume | abort)]
    for which, when, steps, abort in parks:
        r = reqs[which % len(reqs)]
        events.setdefault(when, []).append((r, "park"))
        events.setdefault(when + steps, []).append((r, "abort" if abort else "resume"))
    held, step = {}, [0]  # request id -> (its pages, its tokens) when parked

    def on_step(engine):
        for r, (pages, tokens) in list(held.items()):
            if reqs_by_id[r].status.finished:  # the token it had in flight ended it
                assert reqs_by_id[r].page_ids == [] and len(reqs_by_id[r].output_token_ids) == tokens
                del held[r]
                continue
            assert reqs_by_id[r].page_ids == pages and len(reqs_by_id[r].output_token_ids) == tokens
        step[0] += 1
        for r, what in events.get(step[0], []):
            if what == "park" and r in scheduler.running:
                scheduler.hold([r])
                held[r.request_id] = (list(r.page_ids), len(r.output_token_ids))
            elif what != "park" and r.request_id in held:
                del held[r.request_id]
                engine.abort_request(r.request_id) if what == "abort" else scheduler.release([r])
        engine.worker.check_state()

    reqs_by_id = {r.request_id: r for r in reqs}
    max_steps = 100 + sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in reqs) * 4
    run(engine, reqs, arrivals, max_steps=max_steps, on_step=on_step)
    for r in reqs:
        want = alone(r.prompt_token_ids, r.sampling_params.max_tokens)
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == want[:len(r.output_token_ids)]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == want, r.request_id


@settings(max_examples=80, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=8), extra_pages=st.integers(0, 8),
       max_num_seqs=st.integers(2, 6), growth=limits_st, steps_each=st.integers(1, 8))
def test_steps_stay_within_the_limits_of_a_ready_early_warmup(requests, extra_pages, max_num_seqs, growth,
                                                              steps_each):
    """While a ready-early warm-up compiles in the background, ``limits()`` grow from the smallest buckets: no step
    exceeds them (``growing_limits``) and every output is still exact; once lifted, the configuration's apply."""
    engine = fake_engine(-(-MAX_LEN // PAGE) + 1 + extra_pages, max_num_seqs)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m), i)
            for i, ((head, tail), m, _) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a) in zip(reqs, requests)}
    max_steps = 100 + sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in reqs) * 8
    run(engine, reqs, arrivals, max_steps=max_steps, on_step=growing_limits(engine, growth, steps_each))
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == alone(r.prompt_token_ids, r.sampling_params.max_tokens), r.request_id
    engine.worker.step_limits = None
    engine.step()
    assert (engine.scheduler.max_running, engine.scheduler.max_step_tokens) == (max_num_seqs, 16)


def test_hold_and_release_check_their_requests():
    """Only running requests are held and only held ones released; a bad request changes nothing."""
    engine = fake_engine(num_pages=8, max_num_seqs=2, scheduler_cls=HoldingScheduler)
    scheduler = engine.scheduler
    reqs = [Request(f"r{i}", [1, 2, 0], SamplingParams(temperature=0.0, max_tokens=4), i) for i in range(3)]
    for r in reqs:
        engine.add(r)
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["r0", "r1"]
    with pytest.raises(ValueError, match=r"requests: \['r2'\] are not running"):  # r2 waits: max_num_seqs
        scheduler.hold(reqs[::2])
    with pytest.raises(ValueError, match="are not held"):
        scheduler.release(reqs[:1])
    assert scheduler.held == []
    scheduler.hold(reqs[:1])
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["r1"]  # r0 holds its row: r2 still waits
    engine.worker.check_state()
    engine.abort_request("r1")
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["r2"]
