"""What one ``Scheduler.schedule()`` decided, as the worker executes it, and the scheduler's stats."""

import dataclasses

from zipage_jax.core.request import Request


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
class SwapIn:
    request: Request  # its new page_ids and query_row are set
    contents: tuple  # what its swap-out copied to the host


@dataclasses.dataclass
class SchedulerOutput:
    decodes: list[Request] = dataclasses.field(default_factory=list)
    prefills: list[PrefillChunk] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    compressions: list[Compression] = dataclasses.field(default_factory=list)
    swap_outs: list[SwapOut] = dataclasses.field(default_factory=list)
    swap_ins: list[SwapIn] = dataclasses.field(default_factory=list)
    stalled: list[Request] = dataclasses.field(default_factory=list)
    token_bitmask: object = None  # structured-output masks to write before the step (``TokenBitmask``), or None

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.compressions and not self.swap_ins


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state and counters, for the engine's metrics."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_stalled: int  # requests that could not advance in the last step (query row or compression bound)
    num_preemptions: int
    num_swaps: int
    num_query_rows: int
    query_rows_used: int
    kv_pages_total: int
    kv_pages_used: int
    prefix_cache_hit_rate: float
