"""Property tests of the scheduler with compression on, driven by a fake device with a token-valued paged pool.

The fake device executes each step's work in the engine's dispatch order (swap-outs, swap-ins, synchronous
compression, decode, prefill, asynchronous compression) against a pool whose slots hold ``(position, token)``,
a query cache whose ring holds the ``(position, token)`` of each slot holder's computed tokens, and a token
buffer. A compression keeps, per request, the ``M * S`` live slots with the highest hash of (slot, the W window
entries) — the last W slots protected — packed in order into the destination pages; it asserts the ring holds
exactly the last W positions (so a stale or missing window is caught). Sampling hashes the slots read through
the page table. Anything lost, misplaced or overwritten — or a compression reading pages a step reused before
it ran — changes the output. Oracle: the same fake run with the request alone in an ample pool.
"""

import collections
import zlib
from types import SimpleNamespace
import numpy as np

from hypothesis import given, settings, strategies as st

from zipage_jax.block_manager import NULL_PAGE, BlockManager
from zipage_jax.compression import ScoringConfig
from zipage_jax.request import PENDING, Request, RequestStatus
from zipage_jax.sampling import SamplingParams
from zipage_jax.scheduler import Scheduler
from seeds import fresh_seed, seeded_rng

BLOCK = 4
VOCAB = 3
WINDOW = 2


def digest(items) -> int:
    return zlib.crc32(repr(list(items)).encode())


class FakeDevice:
    def __init__(self, bm: BlockManager, max_num_seqs: int, num_query_slots: int):
        self.bm = bm
        self.pool = {page: [None] * BLOCK for page in range(bm.num_pages)}
        self.buffer = [None] * (max_num_seqs + 1)
        self.queries = [[None] * WINDOW for _ in range(num_query_slots)]

    def _write(self, request, physical, position, token):
        page = request.block_ids[physical // BLOCK]
        assert page != NULL_PAGE, "write to the null page"
        assert self.bm.ref_count[page] == 1 and self.bm.page_hash[page] is None, "write to a shared/cached page"
        self.pool[page][physical % BLOCK] = (position, token)
        if request.query_slot is not None:
            self.queries[request.query_slot][position % WINDOW] = (position, token)

    def _sample(self, request) -> int:
        n = request.num_physical_tokens
        seq = [self.pool[request.block_ids[i // BLOCK]][i % BLOCK] for i in range(n)]
        assert None not in seq, "attention would read a slot nobody wrote"
        token = digest(seq) % VOCAB
        self.buffer[request.token_slot] = token
        return token

    def decode(self, request) -> int:
        index = request.num_computed_tokens - 1
        token = request.token_at(index)
        if token == PENDING:
            token = self.buffer[request.token_slot]
        self._write(request, request.num_physical_tokens - 1, index, token)
        return self._sample(request)

    def prefill(self, chunk):
        r = chunk.request
        ids = r.token_slice(chunk.start, chunk.start + chunk.num_tokens)
        assert PENDING not in ids and not r.compressed
        slot = r.query_slot
        for j, token in enumerate(ids):
            if j < len(ids) - WINDOW:  # like the runner: queries of the chunk's last W tokens only
                r.query_slot = None
            self._write(r, chunk.start + j, chunk.start + j, token)
            r.query_slot = slot
        return self._sample(r) if chunk.samples else None

    def compress(self, c, budget):
        r = c.request
        assert r.query_slot is not None, "compression without a query slot"
        window = self.queries[r.query_slot]
        assert sorted(p for p, _ in window) == list(range(c.logical_len - WINDOW, c.logical_len)), \
            "window queries missing or stale"
        live = [self.pool[p][s] for p in c.src_pages for s in range(BLOCK)]
        assert None not in live
        protected = len(live) - WINDOW
        score = [float("inf") if i >= protected else digest([slot, sorted(window)]) for i, slot in enumerate(live)]
        keep = sorted(sorted(range(len(live)), key=lambda i: -score[i])[:budget * BLOCK])
        kept = [live[i] for i in keep]
        for i, page in enumerate(c.dst_pages):
            assert self.bm.ref_count[page] == 1
            self.pool[page] = kept[i * BLOCK:(i + 1) * BLOCK]

    def swap_out(self, swap):
        return [list(self.pool[p]) for p in swap.pages], list(self.queries[swap.query_slot])

    def swap_in(self, request):
        pages, queries = request.swap_state
        for page, content in zip(request.block_ids, pages):
            self.pool[page] = list(content)
        self.queries[request.query_slot] = list(queries)
        request.swap_state = None


class Driver:
    """The engine's step loop minus the model, with invariant checks after every step."""

    def __init__(self, num_pages, max_num_seqs=4, max_num_batched_tokens=16, max_num_prefill_seqs=2,
                 prefix_caching=True, budget=2, num_query_slots=2, hybrid=True, async_compression=True,
                 max_compression_pages=None, compression_batching=(1, 0)):
        self.bm = BlockManager(num_pages, BLOCK, prefix_caching)
        config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_prefill_seqs=max_num_prefill_seqs, compression=True, kv_budget_blocks=budget,
                                 scoring=ScoringConfig(window=WINDOW), hybrid_admission=hybrid,
                                 async_compression=async_compression,
                                 compression_min_batch=compression_batching[0],
                                 compression_max_wait_steps=compression_batching[1])
        plan = SimpleNamespace(num_query_slots=num_query_slots, max_compression_pages=max_compression_pages)
        self.s = Scheduler(self.bm, config, plan)  # toy sizes EngineConfig would reject
        self.device = FakeDevice(self.bm, max_num_seqs, num_query_slots)
        self.in_flight: list[tuple[Request, int]] = []
        self.finished: dict[str, Request] = {}
        self.stats = collections.Counter()

    def live(self):
        return list(self.s.running) + list(self.s.waiting) + list(self.s.swapped)

    def step(self):
        s, dev = self.s, self.device
        out = s.schedule()
        self.check_schedule(out)
        for swap in out.swap_outs:
            swap.request.swap_state = dev.swap_out(swap)
        for request in out.swap_ins:
            dev.swap_in(request)
        if not s.async_compression:
            for c in out.compressions:
                dev.compress(c, s.budget(c.request))
        dispatched = [(r, dev.decode(r)) for r in out.decodes]
        for chunk in out.prefills:
            token = dev.prefill(chunk)
            if token is not None:
                dispatched.append((chunk.request, token))
        if s.async_compression:
            for c in out.compressions:
                dev.compress(c, s.budget(c.request))
        for request, _ in dispatched:
            request.output_token_ids.append(PENDING)
        for request, token in self.in_flight:
            if not request.status.finished:
                self.accept(request, token)
        self.in_flight = dispatched
        self.check_state()
        self.stats.update(compressions=len(out.compressions), swaps=len(out.swap_outs), stalls=len(out.stalled),
                          recomputes=sum(not r.compressed for r in out.preempted),
                          compression_dispatches=bool(out.compressions))
        return out

    def check_schedule(self, out):
        s = self.s
        scheduled = out.decodes + [c.request for c in out.prefills]
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice in one step"
        assert len(s.running) <= s.max_num_seqs and len(out.prefills) <= s.max_num_prefill_seqs
        assert all(r.status == RequestStatus.RUNNING and r in s.running for r in scheduled)
        compressing = {id(c.request) for c in out.compressions}
        assert all(c.request.query_slot is not None for c in out.compressions), "slot-less compression"
        if s.async_compression:
            assert not compressing & {id(r) for r in scheduled}, "decoded while its compression is pending"
        assert not {id(r) for r in out.stalled} & ({id(r) for r in scheduled} | compressing)
        if s.max_compression_pages is not None and len(out.compressions) > 1:
            assert sum(len(c.src_pages) for c in out.compressions) <= s.max_compression_pages
        for r in out.preempted:  # compressed ones are swapped, the others recomputed
            assert r.status == (RequestStatus.SWAPPED if r.compressed else RequestStatus.WAITING)
        for r in scheduled:  # a slot-less request never computes into the window of its next compression
            if r.query_slot is None:
                assert not s.needs_slot(r, r.num_computed_tokens)

    def check_state(self):
        s = self.s
        self.bm.check_invariants(self.live())
        tokens = [r.token_slot for r in s.running]
        assert None not in tokens and len(set(tokens)) == len(tokens)
        holders = [r for r in s.running if r.query_slot is not None]
        assert len({r.query_slot for r in holders}) == len(holders), "a query slot held twice"
        assert len(holders) + len(s.free_query_slots) == s.num_query_slots
        assert all(r.query_slot is None for r in list(s.waiting) + s.swapped)
        assert s.committed_pages == sum(s.budget(r) + 1 for r in holders) <= self.bm.num_pages - 1
        for r in s.running:
            if not s.hybrid_admission:
                assert r.query_slot is not None, "constrained admission runs only slot holders"
            if r.compressed:
                assert r.query_slot is not None and len(r.block_ids) <= s.budget(r) + 1
                assert all(self.bm.ref_count[p] == 1 for p in r.block_ids), "a compressed request shares a page"
        assert all(not r.block_ids and r.swap_state is not None for r in s.swapped)

    def accept(self, request, token):
        index = request.output_token_ids.index(PENDING)
        request.output_token_ids[index] = token
        self.bm.register_full_pages(request)
        if index + 1 >= request.sampling_params.max_tokens:
            request.output_token_ids = request.output_token_ids[:index + 1]
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def finish(self, request, status):
        self.s.finish(request, status)
        while request.output_token_ids and request.output_token_ids[-1] == PENDING:
            request.output_token_ids.pop()
        self.finished[request.request_id] = request
        self.check_state()

    def run(self, requests, arrivals=None, aborts=None, max_steps=5000):
        arrivals = arrivals or {r.request_id: 0 for r in requests}
        aborts = aborts or {}
        step = 0
        while len(self.finished) < len(requests):
            assert step < max_steps, "workload did not finish in bounded steps"
            for r in requests:
                if arrivals[r.request_id] == step:
                    self.s.add(r)
            for r in aborts.get(step, []):
                if r.request_id not in self.finished and arrivals[r.request_id] <= step:
                    self.finish(r, RequestStatus.FINISHED_ABORTED)
            self.step()
            step += 1
        assert not self.s.has_work() and self.bm.num_used_pages == 0 and not self.bm.deferred
        assert sorted(self.s.free_query_slots) == list(range(self.s.num_query_slots)) and self.s.committed_pages == 0


def alone(prompt, max_tokens, budget, default_budget=2) -> list[int]:
    d = Driver(num_pages=64, max_num_seqs=1, budget=default_budget, num_query_slots=1)
    r = Request("alone", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_budget_blocks=budget), 0)
    d.run([r])
    return r.output_token_ids


prompt_st = st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=9),  # shared-ish head
                      st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
request_st = st.tuples(prompt_st, st.integers(1, 40), st.integers(0, 8), st.sampled_from([None, 1, 2, 3]))


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=8), extra_pages=st.integers(0, 3),
       max_num_seqs=st.integers(1, 5), num_query_slots=st.integers(1, 3), token_budget=st.integers(2, 20),
       hybrid=st.booleans(), async_compression=st.booleans(), prefix_caching=st.booleans(),
       max_compression_pages=st.sampled_from([None, 8, 12]),
       compression_batching=st.sampled_from([(1, 0), (2, 1), (4, 3)]),
       aborts=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 60)), max_size=2))
def test_random_compressed_workload_is_lossless(requests, extra_pages, max_num_seqs, num_query_slots, token_budget,
                                                hybrid, async_compression, prefix_caching, max_compression_pages,
                                                compression_batching, aborts):
    # the pages one request alone needs at its peak: its first compression point (Scheduler.first_due)
    peak = max(max(-(-len(head + tail) // BLOCK), (2 if b is None else b) + 1) for (head, tail), _, _, b in requests)
    num_pages = peak + 1 + extra_pages
    d = Driver(num_pages, max_num_seqs, token_budget, 2, prefix_caching, 2, min(num_query_slots, max_num_seqs),
               hybrid, async_compression, max_compression_pages, compression_batching)
    reqs = [Request(f"r{i}", head + tail, SamplingParams(temperature=0.0, max_tokens=m, kv_budget_blocks=b), i)
            for i, ((head, tail), m, _, b) in enumerate(requests)]
    arrivals = {r.request_id: a for r, (_, _, a, _) in zip(reqs, requests)}
    abort_at = {}
    for which, when in aborts:
        abort_at.setdefault(when, []).append(reqs[which % len(reqs)])
    aborted = {r.request_id for rs in abort_at.values() for r in rs}
    d.run(reqs, arrivals, abort_at)
    for r in reqs:
        want = alone(r.prompt_token_ids, r.sampling_params.max_tokens, r.sampling_params.kv_budget_blocks)
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
    """The shape that swaps: the front request has the largest budget and no slot yet when it needs a page,
    the requests behind it took the slots first and are compressed."""
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m, kv_budget_blocks=3 if i == 0 else 1), i)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    d = Driver(5 + extra_pages, len(reqs), token_budget, 2, prefix_caching, 1, len(reqs) - 1, True, async_compression)
    d.run(reqs)
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.sampling_params.max_tokens,
                                           r.sampling_params.kv_budget_blocks), r.request_id


def long_requests(rng, n, max_tokens=40):
    return [Request(f"r{i}", rng.integers(0, VOCAB, size=int(rng.integers(3, 10))).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), i) for i in range(n)]


def test_memory_pressure_swaps_compressed_requests_losslessly():
    """Slots go to whoever reaches its window first: the small-budget requests compress early, and when the
    large-budget front request needs a page, the compressed tail is swapped out (and back in later)."""
    rng = seeded_rng()
    d = Driver(num_pages=8, max_num_seqs=3, num_query_slots=2, budget=1)
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=2).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=30, kv_budget_blocks=b), i)
            for i, b in enumerate([3, 1, 1])]
    d.run(reqs)
    assert d.stats["swaps"] > 0 and d.stats["compressions"] > 0
    for r in reqs:
        assert r.num_swaps == (r.request_id == "r2")
        assert r.output_token_ids == alone(r.prompt_token_ids, 30, r.sampling_params.kv_budget_blocks)


def test_hybrid_admission_runs_more_than_the_slots_and_stalls_at_the_window():
    rng = seeded_rng()
    hybrid = Driver(num_pages=40, max_num_seqs=4, num_query_slots=1, budget=2)
    constrained = Driver(num_pages=40, max_num_seqs=4, num_query_slots=1, budget=2, hybrid=False)
    for d in (hybrid, constrained):
        reqs = long_requests(rng, 4, max_tokens=24)
        peak = 0
        for r in reqs:
            d.s.add(r)
        while len(d.finished) < len(reqs):
            d.step()
            peak = max(peak, len(d.s.running))
        d.stats["peak_running"] = peak
        for r in reqs:
            assert r.output_token_ids == alone(r.prompt_token_ids, 24, None)
    assert constrained.stats["peak_running"] == 1 and hybrid.stats["peak_running"] > 1
    assert hybrid.stats["stalls"] > 0


def test_compression_batch_is_bounded_by_pages():
    rng = seeded_rng()
    d = Driver(num_pages=60, max_num_seqs=4, num_query_slots=4, budget=2, max_compression_pages=3)
    reqs = [Request(f"r{i}", rng.integers(0, VOCAB, size=4).tolist(),  # in lockstep: all due together
                    SamplingParams(temperature=0.0, max_tokens=30), i) for i in range(4)]
    d.run(reqs)
    assert d.stats["stalls"] > 0
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, 30, None)


def test_compression_batches_wait_for_company_at_most_max_wait_steps():
    """Requests falling due one after another are compressed in fewer dispatches when due ones wait for company;
    none waits longer than the bound, and every request decodes what it decodes alone."""
    seed = fresh_seed()
    prompts = [np.random.default_rng(seed + i).integers(0, VOCAB, size=1 + 2 * i).tolist() for i in range(4)]
    dispatches = {}
    for batching in ((1, 0), (4, 3)):
        d = Driver(num_pages=60, max_num_seqs=4, num_query_slots=4, budget=2, compression_batching=batching)
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40), i) for i, p in enumerate(prompts)]
        for r in reqs:
            d.s.add(r)
        streak, longest = {}, 0
        while len(d.finished) < len(reqs):
            out = d.step()
            streak = {id(r): streak.get(id(r), 0) + 1 for r in out.stalled}  # slots are plenty: only batching stalls
            longest = max([longest, *streak.values()])
        assert longest <= batching[1], seed
        for r in reqs:
            assert r.output_token_ids == alone(r.prompt_token_ids, 40, None), seed
        dispatches[batching] = (d.stats["compression_dispatches"], d.stats["compressions"])
    (eager, eager_total), (batched, batched_total) = dispatches[(1, 0)], dispatches[(4, 3)]
    assert eager_total == batched_total and batched < eager, (seed, dispatches)


def test_async_and_sync_compression_produce_the_same_tokens():
    rng = seeded_rng()
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(2, 12))).tolist() for _ in range(5)]
    outs = []
    for async_compression in (True, False):
        d = Driver(num_pages=20, max_num_seqs=5, num_query_slots=3, async_compression=async_compression)
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=36), i) for i, p in enumerate(prompts)]
        d.run(reqs)
        outs.append([r.output_token_ids for r in reqs])
    assert outs[0] == outs[1]
