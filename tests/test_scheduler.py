"""Property tests of the scheduler driven by a fake device that keeps a real (token-valued) paged pool.

The fake device follows the engine's protocol: a sampled token is appended as ``PENDING`` at dispatch and read
back one step later; a decode whose input token is still pending takes it from the device token buffer. It
writes each computed token into its (page, offset) slot and "samples" by hashing the sequence it reads back
through the page table, so any lost, misplaced or overwritten KV changes the output. Oracle: a request alone
produces ``out[k] = next_token(prompt + out[:k])``.
"""

import zlib
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as st

from zipage_jax.block_manager import NULL_PAGE, BlockManager
from zipage_jax.compression import ScoringConfig
from zipage_jax.request import PENDING, Request, RequestStatus
from zipage_jax.sampling import SamplingParams
from zipage_jax.scheduler import Scheduler
from seeds import seeded_rng

BLOCK = 4
VOCAB = 3  # tiny, so prompts share prefixes and the prefix cache hits


def next_token(tokens) -> int:
    return zlib.crc32(np.asarray(tokens, np.int64).tobytes()) % VOCAB


def alone(prompt, max_tokens) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeDevice:
    """Token-valued KV pool plus the persistent token buffer of the runner."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int):
        self.bm = block_manager
        self.pool = {page: [None] * BLOCK for page in range(block_manager.num_pages)}
        self.buffer = [None] * (max_num_seqs + 1)

    def _write(self, request, index, token):
        page = request.block_ids[index // BLOCK]
        assert page != NULL_PAGE, "write to the null page"
        assert self.bm.ref_count[page] == 1 and self.bm.page_hash[page] is None, "write to a shared/cached page"
        self.pool[page][index % BLOCK] = token

    def _sample(self, request, length) -> int:
        seq = [self.pool[request.block_ids[i // BLOCK]][i % BLOCK] for i in range(length)]
        assert None not in seq, "attention would read a slot nobody wrote"
        token = next_token(seq)
        self.buffer[request.token_slot] = token
        return token

    def decode(self, request) -> int:
        index = request.num_computed_tokens - 1
        token = request.all_token_ids[index]
        if token == PENDING:
            token = self.buffer[request.token_slot]
        self._write(request, index, token)
        return self._sample(request, index + 1)

    def prefill(self, chunk) -> int | None:
        ids = chunk.request.all_token_ids[chunk.start:chunk.start + chunk.num_tokens]
        assert PENDING not in ids
        for j, token in enumerate(ids):
            self._write(chunk.request, chunk.start + j, token)
        return self._sample(chunk.request, chunk.start + chunk.num_tokens) if chunk.samples else None


class Driver:
    """The engine's step loop minus the model: schedule, dispatch, read back the previous step, finish."""

    def __init__(self, num_pages, max_num_seqs, max_num_batched_tokens, max_num_prefill_seqs, prefix_caching):
        self.bm = BlockManager(num_pages, BLOCK, prefix_caching)
        config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_prefill_seqs=max_num_prefill_seqs, compression=False, kv_budget_blocks=8,
                                 scoring=ScoringConfig(), hybrid_admission=True, async_compression=True)
        self.scheduler = Scheduler(self.bm, config, SimpleNamespace(num_query_slots=0, max_compression_pages=None))
        self.device = FakeDevice(self.bm, max_num_seqs)
        self.in_flight: list[tuple[Request, int]] = []
        self.finished: dict[str, Request] = {}

    def live(self):
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def step(self):
        s = self.scheduler
        out = s.schedule()
        scheduled = out.decodes + [c.request for c in out.prefills]
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice in one step"
        assert len(out.decodes) + sum(c.num_tokens for c in out.prefills) <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs and len(out.prefills) <= s.max_num_prefill_seqs
        assert all(r.status == RequestStatus.RUNNING and r in s.running for r in scheduled)
        assert not any(r in s.running for r in out.preempted)
        slots = [r.token_slot for r in s.running]
        assert None not in slots and len(set(slots)) == len(slots)
        dispatched = [(r, self.device.decode(r)) for r in out.decodes]
        for chunk in out.prefills:
            token = self.device.prefill(chunk)
            if token is not None:
                dispatched.append((chunk.request, token))
        for request, _ in dispatched:
            request.output_token_ids.append(PENDING)
        for request, token in self.in_flight:
            if not request.status.finished:
                self.accept(request, token)
        self.in_flight = dispatched
        self.bm.check_invariants(self.live())
        return out

    def accept(self, request, token):
        index = request.output_token_ids.index(PENDING)
        request.output_token_ids[index] = token
        self.bm.register_full_pages(request)
        if index + 1 >= request.sampling_params.max_tokens:
            request.output_token_ids = request.output_token_ids[:index + 1]
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def finish(self, request, status):
        self.scheduler.finish(request, status)
        while request.output_token_ids and request.output_token_ids[-1] == PENDING:
            request.output_token_ids.pop()
        self.finished[request.request_id] = request


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
    num_pages = -(-MAX_LEN // BLOCK) + 1 + extra_pages  # one full-length request always fits
    d = Driver(num_pages, max_num_seqs, budget, max_num_prefill_seqs, prefix_caching)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m), i)
            for i, ((head, tail), m, _) in enumerate(requests)]
    arrivals = {i: a for i, (_, _, a) in enumerate(requests)}
    abort_at = {}
    for which, when in aborts:
        abort_at.setdefault(when, []).append(reqs[which % len(reqs)])
    aborted = set()
    max_steps = 50 + sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in reqs) * 4
    step = 0
    while len(d.finished) < len(reqs):
        assert step < max_steps, "workload did not finish in bounded steps"
        for i, a in arrivals.items():
            if a == step:
                d.scheduler.add(reqs[i])
        for r in abort_at.get(step, []):
            if r.request_id not in d.finished and arrivals[int(r.request_id[1:])] <= step:
                d.finish(r, RequestStatus.FINISHED_ABORTED)
                aborted.add(r.request_id)
                d.bm.check_invariants(d.live())
        d.step()
        step += 1
    assert not d.scheduler.has_work()
    assert d.bm.num_used_pages == 0 and sorted(d.scheduler.free_token_slots) == list(range(max_num_seqs))
    for r in reqs:
        want = alone(r.prompt_token_ids, r.sampling_params.max_tokens)
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED and r.output_token_ids == want[:len(r.output_token_ids)]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == want, r.request_id


def test_tight_pool_preempts_and_stays_lossless():
    rng = seeded_rng()
    d = Driver(num_pages=7, max_num_seqs=4, max_num_batched_tokens=8, max_num_prefill_seqs=2, prefix_caching=True)
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=int(rng.integers(5, 12))).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=12), i) for i in range(4)]
    for r in reqs:
        d.scheduler.add(r)
    steps = 0
    while len(d.finished) < len(reqs):
        d.step()
        steps += 1
        assert steps < 500
    assert d.scheduler.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, 12)
