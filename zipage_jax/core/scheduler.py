"""Continuous batching on the host: decodes first, then chunked prefills under a per-step token budget, with
compression, preemption and admission.

One ``schedule()`` runs these phases (docs/ARCHITECTURE.md, Scheduling and Compression):

| phase      | what happens                                                                                        |
|------------|-----------------------------------------------------------------------------------------------------|
| finish     | a new step: pages the last step's compressions read may be copy-on-write targets again              |
| running    | each running request in admission order, while the step has tokens left:                            |
| ·gate      | a request without a query row stops short of the window of its first compression (a prefill chunk   |
|            | is cut there; a decode stalls) unless a query row is granted now                                    |
| ·compress  | one due for compression (``M+1`` full pages, needing another) joins the step's compression batch, or |
|            | stalls while the batch is held back or full; compressed, it decodes in the same step                |
| ·preempt   | pages it needs are taken from the most recently admitted running request not yet scheduled this     |
|            | step: an uncompressed one is freed and recomputed later (exact), a compressed one is swapped out     |
| ·decode /  | one token, or the next prompt chunk (within the token budget and ``max_num_prefill_seqs``, never    |
|  prefill   | past the first compression point)                                                                   |
| swap-in    | swapped-out requests come back first, in arrival order, if no request was preempted this step       |
| admit      | then, FIFO, waiting requests start (prefix-cache match, first chunk) as the admission policy allows |
|            | (``core.admission``)                                                                                |

Compression. A request's first compression point is the end of its prompt's last page (at least ``M+1`` pages),
whatever the chunking: prefill chunks stop there, so recomputation and chunking never move it; after it, a request
is due again every page. The prefix cache never serves the pages of that window (their queries must be computed),
nor any page of a request that asks for prompt logprobs (a cached page has no logits). The due requests of a step
form one compression batch, bounded by ``max_compression_pages`` source pages (the rest stall a step), dispatched
as ``core.compression_batching`` decides. The batch runs before the step's other device work (the same stream), so
its requests decode in the same step and the pages it releases are free at once; asynchronous mode only spares the
host the wait for it.

A request is written by the scheduler and the page manager only: the worker returns what it produced
(``dispatched``: the tokens in flight, the swapped-out contents; ``accept``: a token read back).
"""

import bisect
import collections
import dataclasses

from zipage_jax.config import EngineConfig
from zipage_jax.core.admission import ADMISSION
from zipage_jax.core.compression_batching import CompressionBatching
from zipage_jax.core.memory_plan import MemoryPlan
from zipage_jax.core.page_manager import PageManager
from zipage_jax.core.query_rows import QueryRows
from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.core.scheduler_output import (
    Compression,
    PrefillChunk,
    SchedulerOutput,
    SchedulerStats,
    SwapIn,
    SwapOut,
)


@dataclasses.dataclass
class _Step:
    """What one ``schedule()`` has decided so far."""

    out: SchedulerOutput
    token_budget: int
    compress_now: bool  # the due compressions are dispatched this step
    compression_pages: int = 0


class Scheduler:
    def __init__(self, page_manager: PageManager, config: EngineConfig, plan: MemoryPlan):
        """``plan`` gives the query rows and the compression bound (``max_compression_pages``; None: none)."""
        self.page_manager = page_manager
        self.compression = config.compression
        self.kv_budget_pages = config.kv_budget_pages
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_prefill_seqs = config.max_num_prefill_seqs
        # what this step may take: the configuration's limits, lower while the larger programs still compile
        self.max_running, self.max_step_tokens = self.max_num_seqs, self.max_num_batched_tokens
        self.window = config.scoring.window
        self.admission = ADMISSION[config.admission]
        self.max_compression_pages = plan.max_compression_pages
        self.query_rows = QueryRows(plan.num_query_rows, page_manager.num_pages - 1)
        self.batching = CompressionBatching(config.compression, config.compression_min_batch,
                                            config.compression_max_wait_steps)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # in arrival order
        self.free_token_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self.num_preemptions = self.num_swaps = self.num_stalled = 0  # num_stalled: requests held back last step
        self._scheduled: set[int] = set()

    def add(self, request: Request):
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def limit(self, limits: tuple[int, int] | None):
        """Cap the running requests (so the decode rows) and a step's tokens at ``limits`` (None: the configuration's)
        while larger programs still compile; running requests above the cap stay (limits only grow), new ones wait."""
        rows, tokens = limits or (self.max_num_seqs, self.max_num_batched_tokens)
        self.max_running = min(rows, self.max_num_seqs)
        self.max_step_tokens = min(tokens, self.max_num_batched_tokens)

    def budget(self, request: Request) -> int:
        return request.kv_budget(self.kv_budget_pages)

    def stats(self) -> SchedulerStats:
        pm = self.page_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_stalled=self.num_stalled, num_preemptions=self.num_preemptions, num_swaps=self.num_swaps,
            num_query_rows=self.query_rows.num_rows, query_rows_used=self.query_rows.num_used,
            kv_pages_total=pm.num_pages - 1, kv_pages_used=pm.num_used_pages, prefix_cache_hit_rate=pm.hit_rate())

    # -- what the worker produced ----------------------------------------------------------------------------
    def dispatched(self, handles, swapped_out: dict):
        """The worker dispatched these steps (each row's next token is in flight) and copied these swapped-out
        requests' contents to the host (request id -> contents)."""
        for request in (r for handle in handles for r in handle.requests if r is not None):
            request.add_pending()
        for request in (r for r in self.swapped if r.request_id in swapped_out):
            request.swap_state = swapped_out[request.request_id]

    def accept(self, request: Request, token: int, logprob: float):
        """A sampled token was read back: it resolves the oldest one in flight, and pages it filled are published
        to the prefix cache."""
        request.resolve_pending(token, logprob)
        self.page_manager.register_full_pages(request)

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.page_manager.new_step()
        step = _Step(SchedulerOutput(), self.max_step_tokens,
                     compress_now=self.batching.dispatch_now(self.running, self._due_for_compression))
        self._scheduled = set()
        i = 0
        while i < len(self.running) and step.token_budget > 0:
            if self._schedule_running(self.running[i], step):
                i += 1
        if not step.out.preempted:
            self._swap_in(step.out)
            if not self.swapped:
                self._admit(step)
        self.num_stalled = len(step.out.stalled)
        return step.out

    def _schedule_running(self, request: Request, step: _Step) -> bool:
        """Gate, compress, allocate (preempting) and decode or prefill one running request (the table above).
        Returns False when it preempted itself: the next running request then stands where it stood."""
        todo = request.num_tokens - request.num_computed_tokens
        decode = todo == 1
        if request.reached_max_tokens or todo < 1 or (not decode and len(step.out.prefills) >= self.max_num_prefill_seqs):
            return True  # its last token is still in flight, or no prefill row is left this step
        num_new = self._gate(request, 1 if decode else self._prefill_size(request, todo, step.token_budget), decode)
        if num_new <= 0:  # stalled at its window until a query row frees
            step.out.stalled.append(request)
            return True
        if decode and self._due_for_compression(request):
            pages = len(request.page_ids)
            if not step.compress_now or (self.max_compression_pages is not None and step.out.compressions
                                         and step.compression_pages + pages > self.max_compression_pages):
                step.out.stalled.append(request)  # the batch is held back or full; compressed at a later step
                return True
            if not self._compress_or_preempt(request, step.out):
                return False
            step.compression_pages += pages
            self._scheduled.add(id(request))
        if not self._allocate_or_preempt(request, num_new, step.out):
            return False
        if decode:
            step.out.decodes.append(request)
        else:
            step.out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
        self._scheduled.add(id(request))
        request.num_computed_tokens += num_new
        step.token_budget -= num_new
        return True

    def _gate(self, request: Request, num_new: int, decode: bool) -> int:
        """``num_new``, or fewer tokens for a request without a query row that would enter the window of its first
        compression and gets no row now (0: it stalls)."""
        if not self.compression or request.query_row is not None:
            return num_new
        computed = request.num_computed_tokens
        end = self.end_without_query_row(request, computed + num_new)
        if end >= computed + num_new or self._grant_query_row(request):
            return num_new
        return 0 if decode else end - computed

    # -- compression points -------------------------------------------------------------------------------
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

    def _due_for_compression(self, request: Request) -> bool:
        """All pages full, at least M+1 of them, the next token needs a new one, and the prompt's pages are done."""
        pages = len(request.page_ids)
        return (self.compression and pages >= self.budget(request) + 1
                and request.num_physical_tokens == pages * self.page_manager.page_size
                and (request.compressed or request.num_computed_tokens >= self.first_due(request)))

    def _compress_or_preempt(self, request: Request, out: SchedulerOutput) -> bool:
        assert request.query_row is not None, "compression without a query row"
        budget = self.budget(request)
        while (pages := self.page_manager.allocate_compaction(request, budget)) is None:
            if not self._preempt_for(request, out):
                return False
        src, dst = pages
        out.compressions.append(Compression(request, src, dst, request.num_computed_tokens, request.compressed))
        request.num_evicted += request.num_physical_tokens - budget * self.page_manager.page_size
        request.num_compressions += 1
        request.note_pages()
        return True

    # -- query rows and pages -----------------------------------------------------------------------------
    def _grant_query_row(self, request: Request) -> bool:
        return self.query_rows.grant(request, self.budget(request))

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

    # -- admission ---------------------------------------------------------------------------------------
    def _start(self, request: Request):
        request.status = RequestStatus.RUNNING
        request.token_row = self.free_token_rows.pop()
        self.running.append(request)

    def _swap_in(self, out: SchedulerOutput):
        while self.swapped and self.free_token_rows and len(self.running) < self.max_running:
            request = self.swapped[0]
            if request.num_pending or not self._grant_query_row(request):
                break  # its last token is still in flight, or no query row: it comes back first, later
            pages = self.page_manager.allocate_pages(request.swap_pages)
            if pages is None:
                self.query_rows.release(request, self.budget(request))
                break
            self.swapped.pop(0)
            request.page_ids = pages
            request.note_pages()
            self._start(request)
            out.swap_ins.append(SwapIn(request, request.swap_state))
            request.swap_state = None

    def _admit(self, step: _Step):
        out = step.out
        reserving = self.waiting and self.compression and self.admission.reserves_pages
        rowless = self.admission.rowless_pages(self) if reserving else 0
        while (self.waiting and step.token_budget > 0 and self.free_token_rows and len(self.running) < self.max_running
               and len(out.prefills) < self.max_num_prefill_seqs):
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token still in flight; it is known by the next step
            if not request.page_ids:  # the window of the first compression, and prompts scored, are computed
                limit = self.first_due(request) - self.window if self.compression else None
                if request.sampling_params.prompt_logprobs is not None:
                    limit = 0
                self.page_manager.match_prefix(request, limit)
            num_new = self._prefill_size(request, request.num_tokens - request.num_computed_tokens, step.token_budget)
            if self.compression:
                need = self.admission.reservation(self, request, rowless)
                if need is None:  # it cannot reach its first compression beside the others
                    self._release_pages(request)
                    break
                end = request.num_computed_tokens + num_new
                reachable = self.admission.reachable(self, request, end)
                if reachable < end and not self._grant_query_row(request):
                    num_new = reachable - request.num_computed_tokens
                    if num_new <= 0:
                        self._release_pages(request)
                        break
                if request.query_row is None:
                    rowless += need
            if not self.page_manager.allocate(request, num_new):
                self.query_rows.release(request, self.budget(request))
                self._release_pages(request)
                break
            self.waiting.popleft()
            self._start(request)
            out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
            request.num_computed_tokens += num_new
            step.token_budget -= num_new

    # -- state changes -----------------------------------------------------------------------------------
    def _release_pages(self, request: Request):
        self.page_manager.free(request)
        request.num_computed_tokens = 0
        request.num_evicted = 0

    def _release_rows(self, request: Request):
        if request.token_row is not None:
            self.free_token_rows.append(request.token_row)
            request.token_row = None
        self.query_rows.release(request, self.budget(request))

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
        """Release the compressed request's pages and rows; the worker copies their contents to the host first
        (``dispatched`` hands them back)."""
        self.running.remove(request)
        request.swap_pages = len(request.page_ids)
        self.page_manager.free(request)
        self._release_rows(request)
        request.status = RequestStatus.SWAPPED
        request.num_swaps += 1
        self.num_swaps += 1
        bisect.insort(self.swapped, request, key=lambda r: r.arrival)

    def finish(self, request: Request, status: RequestStatus):
        """End the request (stopped, at its length, or aborted) wherever it is: its pages, rows and tokens still in
        flight are let go."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            request.swap_state = None
        self._release_pages(request)
        self._release_rows(request)
        request.drop_pending()
        request.status = status
