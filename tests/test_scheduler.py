"""Property tests of the scheduler in full-KV mode: the engine's step loop over a fake device with a token-valued
paged pool (tests/fake_device.py). Oracle: a request alone produces ``out[k] = next_token(prompt + out[:k])``.
"""

import numpy as np
from hypothesis import given, settings, strategies as st

from seeds import fresh_seed
from fake_device import PAGE, VOCAB, digest, fake_engine, run
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker.model_runner import Runner


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


def test_the_fake_device_is_a_whole_runner():
    """The engine's warm-up and its steady-state metrics run over the fake device as over the real one (both
    implement every member of ``Runner`` the engine reads)."""
    engine = fake_engine(num_pages=8, max_num_seqs=2)
    assert isinstance(engine.runner, Runner)
    assert engine.warmup() == dict(programs=0, compile_s=0.0)
    reqs = [Request("r", [1, 2, 0, 1, 2], SamplingParams(temperature=0.0, max_tokens=6), 0)]
    run(engine, reqs)
    assert reqs[0].output_token_ids == alone(reqs[0].prompt_token_ids, 6)
    assert engine.history.steady_compression_share(engine) == 0.0
