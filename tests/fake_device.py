"""A fake device for the scheduler's property tests: the real ``LLMEngine`` step loop over a token-valued pool.

``FakeDevice`` implements ``worker.worker.Executor``: it executes each scheduler output in the engine's
dispatch order (swap-outs, swap-ins, synchronous compression, decode, prefill, asynchronous compression) against
a pool whose slots hold ``(position, token)``, a query cache whose ring holds the ``(position, token)`` of each
query-row holder's computed tokens, and a token buffer; a decode whose input token is still pending reads it
from that buffer, as the device does. "Sampling" hashes the slots read through the page table, so any lost,
misplaced or overwritten KV changes the output. A compression keeps, per request, the ``M * S`` live slots
with the highest hash of (slot, the W window entries), the last W slots protected, packed in order into the
destination pages; it asserts the ring holds exactly the last W positions (so a stale or missing window is
caught). Accepting tokens, stop checks and finishing are the engine's own.
"""

import collections
import zlib
from types import SimpleNamespace

import numpy as np
from hypothesis import strategies as st

from zipage_jax.core.page_manager import NULL_PAGE, PageManager
from zipage_jax.config import ScoringConfig
from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.core.request import PENDING, Request, RequestStatus
from zipage_jax.worker.handles import ExecuteResult, StepHandle
from zipage_jax.worker.programs import Programs
from zipage_jax.worker.worker import WorkerStats
from zipage_jax.core.scheduler import Scheduler

PAGE = 4
VOCAB = 3  # tiny, so prompts share prefixes and the prefix cache hits
WINDOW = 2


def digest(items) -> int:
    return zlib.crc32(repr(list(items)).encode())


class FakeDevice:
    def __init__(self, scheduler: Scheduler, plan):
        self.plan = plan
        self.programs = Programs()  # compiles nothing: the engine's metrics read its compile time (0)
        self.step_limits = None
        self.s = scheduler
        self.bm = scheduler.page_manager
        self.pool = {page: [None] * PAGE for page in range(self.bm.num_pages)}
        self.buffer = [None] * (scheduler.max_num_seqs + 1)
        self.queries = [[None] * WINDOW for _ in range(scheduler.query_rows.num_rows)]
        self.counts = collections.Counter()

    # -- worker.worker.Executor ----------------------------------------------------------------------------
    def execute(self, out) -> ExecuteResult:
        self.check_schedule(out)
        s = self.s
        result = ExecuteResult()
        for swap in out.swap_outs:
            result.swapped_out[swap.request.request_id] = self.swap_out(swap)
        for c in out.compressions:  # the worker's order: before anything of the step writes the pool
            self.compress(c, s.budget(c.request))
        for swap in out.swap_ins:
            self.swap_in(swap)
        handles = []
        if out.decodes:
            handles.append(self._handle(out.decodes, [self.decode(r) for r in out.decodes], "decode"))
        if out.prefills:
            sampled = [self.prefill(c) for c in out.prefills]
            handles.append(self._handle([c.request if c.samples else None for c in out.prefills], sampled, "prefill"))
        self.counts.update(compressions=len(out.compressions), swaps=len(out.swap_outs), stalls=len(out.stalled),
                           recomputes=sum(not r.compressed for r in out.preempted),
                           compression_dispatches=bool(out.compressions))
        self.last_output = out
        result.handles = handles
        return result

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Nothing to compile; ready early, the engine then reads ``limits()`` (``step_limits``) at every step."""
        return dict(programs=0, compile_s=0.0, background=1) if ready_early else dict(programs=0, compile_s=0.0)

    def limits(self):
        return self.step_limits  # what a test sets: steps as a ready-early warm-up would limit them

    def stats(self) -> WorkerStats:
        return WorkerStats(compile_s=0.0, compiled_on_use=0, compiling_in_background=self.step_limits is not None,
                           compression_dispatches=self.counts["compression_dispatches"], compression_s=None,
                           wide_compression_s=0.0)

    def set_eos_token_ids(self, eos_token_ids):
        pass

    @staticmethod
    def _handle(requests, tokens, kind) -> StepHandle:
        ids = np.zeros((len(tokens), 3), np.int32)  # the device layout: token, rank, top-1 id (unused here)
        ids[:, 0] = [0 if t is None else t for t in tokens]
        return StepHandle(list(requests), ids, np.zeros((len(tokens), 2), np.float32), kind, len(tokens))

    # -- the device math, on tokens ------------------------------------------------------------------------
    def _write(self, request, physical, position, token):
        page = request.page_ids[physical // PAGE]
        assert page != NULL_PAGE, "write to the null page"
        assert self.bm.ref_count[page] == 1 and self.bm.page_hash[page] is None, "write to a shared/cached page"
        self.pool[page][physical % PAGE] = (position, token)
        if request.query_row is not None:
            self.queries[request.query_row][position % WINDOW] = (position, token)

    def _sample(self, request) -> int:
        n = request.num_physical_tokens
        seq = [self.pool[request.page_ids[i // PAGE]][i % PAGE] for i in range(n)]
        assert None not in seq, "attention would read a slot nobody wrote"
        token = digest(seq) % VOCAB
        self.buffer[request.token_row] = token
        return token

    def decode(self, request) -> int:
        index = request.num_computed_tokens - 1
        token = request.token_at(index)
        if token == PENDING:
            token = self.buffer[request.token_row]
        self._write(request, request.num_physical_tokens - 1, index, token)
        return self._sample(request)

    def prefill(self, chunk):
        r = chunk.request
        ids = r.token_slice(chunk.start, chunk.start + chunk.num_tokens)
        assert PENDING not in ids and not r.compressed
        slot = r.query_row
        for j, token in enumerate(ids):
            if j < len(ids) - WINDOW:  # like the worker: queries of the chunk's last W tokens only
                r.query_row = None
            self._write(r, chunk.start + j, chunk.start + j, token)
            r.query_row = slot
        return self._sample(r) if chunk.samples else None

    def compress(self, c, budget):
        r = c.request
        assert r.query_row is not None, "compression without a query row"
        window = self.queries[r.query_row]
        assert sorted(p for p, _ in window) == list(range(c.logical_len - WINDOW, c.logical_len)), \
            "window queries missing or stale"
        live = [self.pool[p][s] for p in c.src_pages for s in range(PAGE)]
        assert None not in live
        protected = len(live) - WINDOW
        score = [float("inf") if i >= protected else digest([slot, sorted(window)]) for i, slot in enumerate(live)]
        keep = sorted(sorted(range(len(live)), key=lambda i: -score[i])[:budget * PAGE])
        kept = [live[i] for i in keep]
        for i, page in enumerate(c.dst_pages):
            assert self.bm.ref_count[page] == 1
            self.pool[page] = kept[i * PAGE:(i + 1) * PAGE]

    def swap_out(self, swap):
        return [list(self.pool[p]) for p in swap.pages], list(self.queries[swap.query_row])

    def swap_in(self, swap):
        request, (pages, queries) = swap.request, swap.contents
        for page, content in zip(request.page_ids, pages):
            self.pool[page] = list(content)
        self.queries[request.query_row] = list(queries)

    # -- invariants ----------------------------------------------------------------------------------------
    def check_schedule(self, out):
        s = self.s
        scheduled = out.decodes + [c.request for c in out.prefills]
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice in one step"
        assert len(out.decodes) + sum(c.num_tokens for c in out.prefills) <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs and len(out.prefills) <= s.max_num_prefill_seqs
        assert all(r.status == RequestStatus.RUNNING and r in s.running for r in scheduled)
        assert not any(r in s.running for r in out.preempted)
        compressing = {id(c.request) for c in out.compressions}
        assert all(c.request.query_row is not None for c in out.compressions), "compression without a query row"
        assert not {id(r) for r in out.stalled} & ({id(r) for r in scheduled} | compressing)
        if s.max_compression_pages is not None and len(out.compressions) > 1:
            assert sum(len(c.src_pages) for c in out.compressions) <= s.max_compression_pages
        for r in out.preempted:  # compressed ones are swapped, the others recomputed
            assert r.status == (RequestStatus.SWAPPED if r.compressed else RequestStatus.WAITING)
        for r in scheduled:  # a request without a query row never computes into the window of its first compression
            if s.compression and r.query_row is None:
                assert not r.compressed and r.num_computed_tokens <= s.first_due(r) - WINDOW

    def check_state(self):
        s = self.s
        held = getattr(s, "held", [])  # a benchmark's HoldingScheduler: held requests keep pages and rows
        self.bm.check_invariants(list(s.running) + list(s.waiting) + list(s.swapped) + held)
        tokens = [r.token_row for r in s.running + held]
        assert None not in tokens and len(set(tokens)) == len(tokens) <= s.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in held)
        holders = [r for r in s.running + held if r.query_row is not None]
        rows = s.query_rows
        assert len({r.query_row for r in holders}) == len(holders), "a query row held twice"
        assert len(holders) + len(rows.free) == rows.num_rows
        assert all(r.query_row is None for r in list(s.waiting) + s.swapped)
        assert rows.committed_pages == sum(s.budget(r) + 1 for r in holders) <= self.bm.num_pages - 1
        for r in s.running:
            if s.compression and not s.admission.runs_without_query_row:
                assert r.query_row is not None, "constrained admission runs only query-row holders"
            if r.compressed:
                assert r.query_row is not None and len(r.page_ids) <= s.budget(r) + 1
                assert all(self.bm.ref_count[p] == 1 for p in r.page_ids), "a compressed request shares a page"
        assert all(not r.page_ids and r.swap_state is not None for r in s.swapped)


def fake_engine(num_pages, max_num_seqs=4, max_num_batched_tokens=16, max_num_prefill_seqs=2, prefix_caching=True,
                scheduler_cls=Scheduler, **compression) -> LLMEngine:
    """The real engine over a fake device; ``compression``: the scheduler's compression arguments."""
    settings = dict(compression=False, kv_budget_pages=8, admission="reserved", async_compression=True,
                    compression_min_batch=1, compression_max_wait_steps=0, num_query_rows=None,
                    max_compression_pages=None)
    unknown = set(compression) - set(settings)
    assert not unknown, unknown
    settings.update(compression)
    num_query_rows = (settings.pop("num_query_rows") or max_num_seqs) if settings["compression"] else 0
    plan = SimpleNamespace(num_pages=num_pages, num_query_rows=num_query_rows, max_concurrency=max_num_seqs,
                           max_compression_pages=settings.pop("max_compression_pages"))
    sched_config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_prefill_seqs=max_num_prefill_seqs, scoring=ScoringConfig(window=WINDOW),
                                   **settings)  # toy sizes EngineConfig would reject
    scheduler = scheduler_cls(PageManager(num_pages, PAGE, prefix_caching), sched_config, plan)
    config = EngineConfig(model="fake-device", max_model_len=4096, metrics_interval_steps=0)
    model_cfg = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(), max_position_embeddings=4096)
    return LLMEngine(config, model_cfg, scheduler=scheduler, worker=FakeDevice(scheduler, plan))


def run(engine: LLMEngine, requests: list[Request], arrivals=None, aborts=None, max_steps=5000, on_step=None):
    """Step the engine until every request finished, adding each at its arrival step and aborting those of
    ``aborts`` (step -> requests) then, with the invariants checked after every change."""
    device, s = engine.worker, engine.scheduler
    arrivals = arrivals or {r.request_id: 0 for r in requests}
    aborts = aborts or {}
    step = 0
    while not all(r.status.finished for r in requests) or engine.has_unfinished_requests():
        assert step < max_steps, "workload did not finish in bounded steps"
        for r in requests:
            if arrivals[r.request_id] == step:
                engine.add(r)
        for r in aborts.get(step, []):
            engine.abort_request(r.request_id)
            device.check_state()
        engine.step(only_finished=True)
        device.check_state()
        if on_step:
            on_step(engine)
        step += 1
    assert all(r.status.finished for r in requests)
    assert not s.has_work() and engine.page_manager.num_used_pages == 0
    assert sorted(s.free_token_rows) == list(range(s.max_num_seqs))
    assert sorted(s.query_rows.free) == list(range(s.query_rows.num_rows)) and s.query_rows.committed_pages == 0


# rows and prompt tokens a step may take, growing (sorted) as a background warm-up's compiles finish
limits_st = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 16)), min_size=1, max_size=4).map(sorted)


def growing_limits(engine: LLMEngine, limits: list[tuple[int, int]], steps_each: int):
    """Start ``engine`` as after a ready-early warm-up whose worker limits steps to ``limits[0]``, then the next
    every ``steps_each`` steps, then none; returns the ``run`` hook that checks each step kept within its limits:
    no more running requests than rows (decode rows are among them) and no more prompt tokens."""
    device = engine.worker
    device.step_limits = limits[0]
    assert engine.warmup(ready_early=True)["background"]
    step = [0]

    def on_step(engine):
        if device.step_limits is not None:
            rows, tokens = device.step_limits
            assert len(engine.scheduler.running) <= rows
            assert sum(c.num_tokens for c in device.last_output.prefills) <= tokens
        step[0] += 1
        index = step[0] // steps_each
        device.step_limits = limits[index] if index < len(limits) else None

    return on_step
