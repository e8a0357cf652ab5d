"""Continuous batching on the host: decodes first, then chunked prefills under a per-step token budget.

Admission is FIFO; swapped-out requests come back before anything new is admitted. When pages run out, the
most recently admitted running request not yet scheduled this step is preempted: an uncompressed one is freed
and recomputed later from its known tokens (exact), a compressed one (which cannot be recomputed) is swapped
out to host memory and back. No request is admitted in a step that preempted.

Compression (docs/ARCHITECTURE.md, Compression). A request that holds at least ``M+1`` full pages and needs another
is compressed first: it keeps ``M`` pages of selected slots plus a recent page. The first compression point is the
end of the prompt's last page (at least ``M+1`` pages), whatever the chunking: prefill chunks stop there, so
recomputation and chunking never move it; after it, a request is due again every page. Compression scores with the
request's last ``W`` window queries, which the device records only for holders of one of ``C`` query rows; so a
request must hold a query row before it computes any of the last ``W`` tokens before its first compression point, and
keeps it until it ends. With hybrid or reserved admission, a request without a query row runs until then and stalls
there until a query row frees (front-most first); a prefill chunk is cut short at that point instead. With reserved
admission (the default) a request is admitted only while the pages it can hold before its first compression fit
beside the ``M+1`` of every holder and those of the requests without a query row, so requests running into their
windows do not thrash the pool by recompute preemption. With constrained admission a request gets its query row on
admission or waits. A query row is granted only while the ``M+1`` steady-state pages of all holders fit in the pool
(per-request budgets). The prefix cache never serves the pages of that window (their queries must be computed),
nor any page of a request that asks for prompt logprobs (a cached page has no logits).

The due requests of a step form one compression batch, bounded by ``max_compression_pages`` source pages (the
rest stall a step). A batch is dispatched once ``compression_min_batch`` requests (or all query-row holders) are due or
one has waited ``compression_max_wait_steps`` steps; until then the due requests stall: with many query-row holders
about one request falls due each step, and a dispatch has a fixed cost (every layer's kernels) whatever its rows.
Asynchronous mode: the batch is dispatched after the step's decode and prefill, its
requests are left out of this step's decode (they decode next step, after their compression in device stream
order), and the pages it releases are deferred to the next step. Synchronous mode: the batch runs first, the
host waits for it, and its requests decode in the same step.
"""

import bisect
import collections
import dataclasses

from zipage_jax.config import EngineConfig
from zipage_jax.core.memory_plan import MemoryPlan
from zipage_jax.core.page_manager import PageManager
from zipage_jax.core.request import Request, RequestStatus


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int  # first token index computed by this chunk
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so the step samples its next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class Compression:
    request: Request
    src_pages: list[int]  # live pages read, in order (all full)
    dst_pages: list[int]  # pages receiving the kept slots
    logical_len: int  # window queries are positions logical_len - W .. logical_len - 1
    compressed_before: bool


@dataclasses.dataclass
class SwapOut:
    request: Request
    pages: list[int]  # its pages, already released on the host: copy them before anything reuses them
    query_row: int


@dataclasses.dataclass
class SchedulerOutput:
    decodes: list[Request]
    prefills: list[PrefillChunk]
    preempted: list[Request]
    compressions: list[Compression] = dataclasses.field(default_factory=list)
    swap_outs: list[SwapOut] = dataclasses.field(default_factory=list)
    swap_ins: list[Request] = dataclasses.field(default_factory=list)  # page_ids / query_row already new
    stalled: list[Request] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.compressions and not self.swap_ins


class Scheduler:
    def __init__(self, page_manager: PageManager, config: EngineConfig, plan: MemoryPlan):
        """``plan`` gives the query rows and the compression bound (``max_compression_pages``; None: none)."""
        self.page_manager = page_manager
        self.compression = config.compression
        self.kv_budget_pages = config.kv_budget_pages
        self.max_num_seqs = max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_prefill_seqs = config.max_num_prefill_seqs
        # what this step may take: the configuration's limits, lower while the larger programs still compile
        self.max_running, self.max_step_tokens = self.max_num_seqs, self.max_num_batched_tokens
        self.window = config.scoring.window
        self.hybrid_admission = config.admission != "constrained"  # requests may run without a query row
        self.reserve_pages = config.admission == "reserved"  # ... only while the pages they can grow to fit
        self.async_compression = config.async_compression
        self.max_compression_pages = plan.max_compression_pages
        self.num_query_rows = plan.num_query_rows
        self.compression_min_batch = config.compression_min_batch
        self.compression_max_wait_steps = config.compression_max_wait_steps
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # in arrival order
        self.parked: list[Request] = []  # out of scheduling, holding their pages and rows (``park``)
        self.free_token_rows = list(range(max_num_seqs - 1, -1, -1))
        self.free_query_rows = list(range(self.num_query_rows - 1, -1, -1))
        self.committed_pages = 0  # sum of M+1 over the query-row holders
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_stalled = 0  # requests that could not advance in the last step (query row or compression bound)
        self._scheduled: set[int] = set()
        self._steps = 0
        self._due_since: dict[int, int] = {}  # id(request) -> step it became due, while its compression waits

    def add(self, request: Request):
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def limit(self, limits: tuple[int, int] | None):
        """Cap the running requests (so the decode rows) and the tokens of a step at ``limits`` (None: the
        configuration's): the programs of larger steps are not compiled yet. Running requests above the cap stay
        (the runner's limits only grow); new ones wait."""
        rows, tokens = limits or (self.max_num_seqs, self.max_num_batched_tokens)
        self.max_running = min(rows, self.max_num_seqs)
        self.max_step_tokens = min(tokens, self.max_num_batched_tokens)

    def budget(self, request: Request) -> int:
        return request.kv_budget(self.kv_budget_pages)

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.page_manager.release_deferred()  # last step's compressions precede everything dispatched now
        out = SchedulerOutput([], [], [])
        self._scheduled = set()
        token_budget = self.max_step_tokens
        compression_pages = 0
        compress_now = self._compression_batch_ready(self._note_due_compressions())
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            todo = request.num_tokens - request.num_computed_tokens
            if request.reached_max_tokens or todo < 1 or (todo > 1 and len(out.prefills) >= self.max_num_prefill_seqs):
                i += 1  # waiting for its last token to come back, or no prefill row left this step
                continue
            num_new = 1 if todo == 1 else self._prefill_size(request, todo, token_budget)
            if self.compression and request.query_row is None:
                end = self.end_without_query_row(request, request.num_computed_tokens + num_new)
                if end < request.num_computed_tokens + num_new and not self._grant_query_row(request):
                    num_new = end - request.num_computed_tokens if todo > 1 else 0
                    if num_new <= 0:  # stalled at its window until a query row frees
                        out.stalled.append(request)
                        i += 1
                        continue
            if todo == 1 and self._due_for_compression(request):
                pages = len(request.page_ids)
                if not compress_now or (self.max_compression_pages is not None and out.compressions
                                        and compression_pages + pages > self.max_compression_pages):
                    out.stalled.append(request)  # the batch is full; compressed next step
                    i += 1
                    continue
                if not self._compress_or_preempt(request, out):
                    continue  # the request preempted itself
                compression_pages += pages
                self._scheduled.add(id(request))
                if self.async_compression:
                    i += 1  # not decoded until its compression has run: next step
                    continue
            if not self._allocate_or_preempt(request, num_new, out):
                continue  # the request preempted itself; running[i] is now the next one
            if todo == 1:
                out.decodes.append(request)
            else:
                out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
            self._scheduled.add(id(request))
            request.num_computed_tokens += num_new
            token_budget -= num_new
            i += 1
        if not out.preempted:
            self._swap_in(out)
            if not self.swapped:
                self._admit(out, token_budget)
        self.num_stalled = len(out.stalled)
        return out

    @property
    def _holds_back_compressions(self) -> bool:
        """Due compressions may wait for company (``compression_min_batch``, ``compression_max_wait_steps``)."""
        return self.compression and self.compression_max_wait_steps > 0 and self.compression_min_batch > 1

    def _note_due_compressions(self) -> list[Request]:
        """Count this step and, while compressions may be held back, note since which step each due request has
        waited; returns the due requests."""
        self._steps += 1
        if not self._holds_back_compressions:
            return []
        due = [r for r in self.running if r.query_row is not None and not r.reached_max_tokens
               and r.num_tokens - r.num_computed_tokens == 1 and self._due_for_compression(r)]
        self._due_since = {id(r): self._due_since.get(id(r), self._steps) for r in due}
        return due

    def _compression_batch_ready(self, due: list[Request]) -> bool:
        """Whether this step dispatches the ``due`` compressions: enough are due together (or every query-row
        holder is), or one has waited long enough (see the module docstring)."""
        if not self._holds_back_compressions:
            return True
        holders = sum(r.query_row is not None for r in self.running)  # only they fall due: no more company
        return len(due) >= min(self.compression_min_batch, holders) or any(
            self._steps - since >= self.compression_max_wait_steps for since in self._due_since.values())

    # -- query rows -------------------------------------------------------------------------------------
    def first_due(self, request: Request) -> int:
        """Length at which the request is first compressed: the end of its prompt's last page, at least M+1 pages.

        A function of the prompt alone, so chunking and recomputation never move it: prefill chunks stop there.
        """
        size = self.page_manager.page_size
        return size * max(self.budget(request) + 1, -(-len(request.prompt_token_ids) // size))

    def end_without_query_row(self, request: Request, end: int) -> int:
        """The largest length ``<= end`` an uncompressed request can reach without a query row."""
        return min(end, self.first_due(request) - self.window)

    def _prefill_size(self, request: Request, todo: int, token_budget: int) -> int:
        """Tokens of the next chunk: within the step's token budget, and never past the first compression point."""
        n = min(todo, token_budget)
        if self.compression and not request.compressed:
            n = min(n, self.first_due(request) - request.num_computed_tokens)
        assert n >= 1
        return n

    def _grant_query_row(self, request: Request) -> bool:
        need = self.budget(request) + 1
        if not self.free_query_rows or self.committed_pages + need > self.page_manager.num_pages - 1:
            return False
        request.query_row = self.free_query_rows.pop()
        self.committed_pages += need
        return True

    def _release_query_row(self, request: Request):
        if request.query_row is not None:
            self.free_query_rows.append(request.query_row)
            self.committed_pages -= self.budget(request) + 1
            request.query_row = None

    # -- pages -------------------------------------------------------------------------------------------
    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt the tail-most request not yet scheduled this step: recompute it, or swap it out if compressed.
        Returns False when that was ``request`` itself."""
        victim = next(r for r in reversed(self.running) if id(r) not in self._scheduled)
        if victim.compressed:
            out.swap_outs.append(SwapOut(victim, list(victim.page_ids), victim.query_row))
            self.swap_out(victim)
        else:
            self.preempt(victim)
        out.preempted.append(victim)
        return victim is not request

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.page_manager.allocate(request, num_new):
            if not self._preempt_for(request, out):
                return False
        return True

    def _due_for_compression(self, request: Request) -> bool:
        """All pages full, at least M+1 of them, the next token needs a new one, and the prompt's pages are done."""
        pages = len(request.page_ids)
        return (self.compression and pages >= self.budget(request) + 1
                and request.num_physical_tokens == pages * self.page_manager.page_size
                and (request.compressed or request.num_computed_tokens >= self.first_due(request)))

    def _compress_or_preempt(self, request: Request, out: SchedulerOutput) -> bool:
        assert request.query_row is not None, "compression without a query row"
        budget = self.budget(request)
        while (pages := self.page_manager.allocate_compaction(request, budget, self.async_compression)) is None:
            if not self._preempt_for(request, out):
                return False
        src, dst = pages
        out.compressions.append(Compression(request, src, dst, request.num_computed_tokens, request.compressed))
        request.num_evicted += request.num_physical_tokens - budget * self.page_manager.page_size
        request.num_compressions += 1
        request.note_pages()
        return True

    # -- admission ---------------------------------------------------------------------------------------
    def _start(self, request: Request):
        request.status = RequestStatus.RUNNING
        request.token_row = self.free_token_rows.pop()
        self.running.append(request)

    def _swap_in(self, out: SchedulerOutput):
        while self.swapped and self.free_token_rows and len(self.running) < self.max_running:  # parked hold rows too
            request = self.swapped[0]
            if request.num_pending or not self._grant_query_row(request):
                break  # its last token is still in flight, or no query row: it comes back first, later
            pages = self.page_manager.allocate_pages(request.swap_pages)
            if pages is None:
                self._release_query_row(request)
                break
            self.swapped.pop(0)
            request.page_ids = pages
            request.note_pages()
            self._start(request)
            out.swap_ins.append(request)

    def peak_pages_before_compression(self, request: Request) -> int:
        """Pages the request holds at most before its first compression (or its end, if that comes first)."""
        end = min(len(request.prompt_token_ids) + request.sampling_params.max_tokens, self.first_due(request))
        return -(-end // self.page_manager.page_size)

    def _rowless_pages(self) -> int:
        """Pages the running requests without a query row can come to hold (or hold, if more): once one takes a
        query row at its window, its ``M+1`` committed pages are no more than that."""
        return sum(max(len(r.page_ids), self.peak_pages_before_compression(r))
                   for r in self.running if r.query_row is None)

    def _admit(self, out: SchedulerOutput, token_budget: int):
        rowless = self._rowless_pages() if self.waiting and self.compression and self.reserve_pages else 0
        while (self.waiting and token_budget > 0 and self.free_token_rows and len(self.running) < self.max_running
               and len(out.prefills) < self.max_num_prefill_seqs):
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token still in flight; it is known by the next step
            # The window of the first compression is always computed, and so is a prompt whose logprobs are asked
            # for (a cached page has no logits), as in vLLM.
            if not request.page_ids:
                limit = self.first_due(request) - self.window if self.compression else None
                if request.sampling_params.prompt_logprobs is not None:
                    limit = 0
                self.page_manager.match_prefix(request, limit)
            todo = request.num_tokens - request.num_computed_tokens
            num_new = self._prefill_size(request, todo, token_budget)
            if self.compression:
                if self.reserve_pages:  # admitted only if it can reach its first compression beside the others
                    need = self.peak_pages_before_compression(request)
                    if self.committed_pages + rowless + need > self.page_manager.num_pages - 1:
                        self._release_pages(request)
                        break
                end = request.num_computed_tokens + num_new
                reachable = (self.end_without_query_row(request, end) if self.hybrid_admission
                             else request.num_computed_tokens)
                if reachable < end and not self._grant_query_row(request):
                    num_new = reachable - request.num_computed_tokens
                    if num_new <= 0:
                        self._release_pages(request)
                        break
                if request.query_row is None and self.reserve_pages:
                    rowless += need
            if not self.page_manager.allocate(request, num_new):
                self._release_query_row(request)
                self._release_pages(request)
                break
            self.waiting.popleft()
            self._start(request)
            out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
            request.num_computed_tokens += num_new
            token_budget -= num_new

    # -- state changes -----------------------------------------------------------------------------------
    def _release_pages(self, request: Request):
        self.page_manager.free(request)
        request.num_computed_tokens = 0
        request.num_evicted = 0

    def _release_rows(self, request: Request):
        if request.token_row is not None:
            self.free_token_rows.append(request.token_row)
            request.token_row = None
        self._release_query_row(request)

    def preempt(self, request: Request):
        """Free the request's pages; it goes back to the front of the queue and is recomputed."""
        assert not request.compressed, "a compressed request cannot be recomputed exactly: swap it out"
        self.running.remove(request)
        self._release_pages(request)
        self._release_rows(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def swap_out(self, request: Request):
        """Release the compressed request's pages and slots; the caller copies their contents to the host first."""
        self.running.remove(request)
        request.swap_pages = len(request.page_ids)
        self.page_manager.free(request)
        self._release_rows(request)
        request.status = RequestStatus.SWAPPED
        request.num_swaps += 1
        self.num_swaps += 1
        bisect.insort(self.swapped, request, key=lambda r: r.arrival)

    def park(self, request: Request):
        """Take a running request out of scheduling: it keeps its pages, KV and rows, and is never preempted,
        until ``resume``; admission reserves nothing more for it."""
        self.running.remove(request)
        self.parked.append(request)
        request.status = RequestStatus.PARKED

    def resume(self, request: Request):
        """Schedule a parked request again, after the running ones."""
        self.parked.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING

    def finish(self, request: Request, status: RequestStatus):
        if request in self.running:
            self.running.remove(request)
        elif request in self.parked:
            self.parked.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            request.swap_state = None
        self._release_pages(request)
        self._release_rows(request)
        request.status = status
