"""Continuous batching on the host: decodes first, then chunked prefills under a per-step token budget.

Admission is FIFO. When pages run out, the most recently admitted running request is preempted (its pages are
freed and it is recomputed later from its known tokens); no new request is admitted in a step that preempted.
With compression on, a request that holds at least ``M+1`` full pages and needs another is compressed first:
it keeps ``M`` pages of selected slots plus a recent page, so after its first compression it never holds more
than ``M+1`` pages.
"""

import collections
import dataclasses

from zipage_jax.block_manager import BlockManager
from zipage_jax.request import Request, RequestStatus


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
class SchedulerOutput:
    decodes: list[Request]
    prefills: list[PrefillChunk]
    preempted: list[Request]
    compressions: list[Compression] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_num_prefill_seqs: int, compression: bool = False, kv_budget_blocks: int = 8):
        self.block_manager = block_manager
        self.compression = compression
        self.kv_budget_blocks = kv_budget_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefill_seqs = max_num_prefill_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_token_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, request: Request):
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            todo = request.num_tokens - request.num_computed_tokens
            if request.reached_max_tokens or todo < 1 or (todo > 1 and len(out.prefills) >= self.max_num_prefill_seqs):
                i += 1  # waiting for its last token to come back, or no prefill row left this step
                continue
            num_new = 1 if todo == 1 else min(todo, budget)
            if todo == 1 and self._due_for_compression(request) and not self._compress_or_preempt(request, out):
                continue  # the request preempted itself
            if not self._allocate_or_preempt(request, num_new, out):
                continue  # the request preempted itself; running[i] is now the next one
            if todo == 1:
                out.decodes.append(request)
            else:
                out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
            request.num_computed_tokens += num_new
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt one request not yet scheduled this step; uncompressed ones first (recompute is exact for them)."""
        scheduled = {id(r) for r in out.decodes} | {id(c.request) for c in out.prefills}
        candidates = [r for r in reversed(self.running) if id(r) not in scheduled]
        victim = next((r for r in candidates if not r.compressed), candidates[0])
        self.preempt(victim)
        out.preempted.append(victim)
        return victim is not request

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(request, num_new):
            if not self._preempt_for(request, out):
                return False
        return True

    def _due_for_compression(self, request: Request) -> bool:
        """All pages full, at least M+1 of them, and the next token needs a new one."""
        pages = len(request.block_ids)
        return (self.compression and pages >= request.kv_budget(self.kv_budget_blocks) + 1
                and request.num_physical_tokens == pages * self.block_manager.block_size)

    def _compress_or_preempt(self, request: Request, out: SchedulerOutput) -> bool:
        budget = request.kv_budget(self.kv_budget_blocks)
        while (plan := self.block_manager.plan_compression(request, budget)) is None:
            if not self._preempt_for(request, out):
                return False
        src, dst = plan
        out.compressions.append(Compression(request, src, dst, request.num_computed_tokens, request.compressed))
        request.num_evicted += request.num_physical_tokens - budget * self.block_manager.block_size
        request.num_compressions += 1
        request.note_blocks()
        return True

    def _admit(self, out: SchedulerOutput, budget: int):
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.prefills) < self.max_num_prefill_seqs):
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token still in flight; it is known by the next step
            if not request.block_ids:
                self.block_manager.match_prefix(request)
            todo = request.num_tokens - request.num_computed_tokens
            num_new = min(todo, budget)
            if not self.block_manager.allocate(request, num_new):
                self._release_pages(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.token_slot = self.free_token_slots.pop()
            self.running.append(request)
            out.prefills.append(PrefillChunk(request, request.num_computed_tokens, num_new))
            request.num_computed_tokens += num_new
            budget -= num_new

    # -- state changes -----------------------------------------------------------------------------------
    def _release_pages(self, request: Request):
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_evicted = 0

    def _release_slot(self, request: Request):
        if request.token_slot is not None:
            self.free_token_slots.append(request.token_slot)
            request.token_slot = None

    def preempt(self, request: Request):
        """Free the request's pages; it goes back to the front of the queue and is recomputed."""
        self.running.remove(request)
        self._release_pages(request)
        self._release_slot(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus):
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_pages(request)
        self._release_slot(request)
        request.status = status
