"""What the step loop reports about itself. Every gauge is computed once, by ``Meter.metrics`` from a stats
snapshot the scheduler and the worker return; ``LLMEngine.metrics()``, the history of samples
(``LLMEngine.metrics_history``) and the server's Prometheus text all read that one dict.

Time shares count wall seconds of the engine since it started (or since ``reset``); the steady-state ones since
warm-up ended (``mark_steady``), less the seconds spent compiling programs met after it. Compression seconds are
the worker's measured ones: a compression the host waits for anyway (synchronous mode) is timed; asynchronous
dispatches are timed only by an observer that syncs for it (a benchmark's), else the shares are None.
"""

import collections
import dataclasses
import time

from zipage_jax.core.scheduler_output import SchedulerOutput, SchedulerStats
from zipage_jax.worker.worker import WorkerStats

RATE_WINDOW_S = 10.0  # prefill / decode tokens per second are rates over this window
MAX_SAMPLES = 4096
# the gauges each history sample keeps, beside its time, step and the rates over its interval
SAMPLED = ("num_running", "num_waiting", "num_stalled", "num_swapped", "kv_pages_used", "page_occupancy",
           "query_rows_used", "num_preempted", "num_swaps", "num_compressions")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step: what the scheduler decided and where the step's host time went (seconds)."""

    scheduled: SchedulerOutput
    schedule_s: float  # Scheduler.schedule()
    dispatch_s: float  # worker.execute(): packing the inputs and dispatching the device work
    read_back_s: float  # blocked waiting for the previous step's sampled tokens
    step_s: float  # the whole step() call; step_s - read_back_s is the host's own time


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the step loop: the scheduler's and the worker's stats and the loop's own counters."""

    scheduler: SchedulerStats
    worker: WorkerStats
    totals: dict  # steps, prefill_tokens, decode_tokens, finished, compressions
    num_compiles: int  # XLA compiles counted since the engine started
    max_concurrency: int


@dataclasses.dataclass(frozen=True)
class _Mark:
    time: float
    decode_tokens: int
    compression_s: float | None
    compile_s: float


def _share(seconds_now: float | None, seconds_then: float | None, wall: float) -> float | None:
    if seconds_now is None:
        return None
    return (seconds_now - (seconds_then or 0.0)) / max(wall, 1e-9)


class Meter:
    """The loop's token counters, rate window and history; ``metrics(stats)`` turns a snapshot into gauges."""

    def __init__(self, interval_steps: int):
        self.interval = interval_steps
        self.totals = collections.Counter()
        self.samples = collections.deque(maxlen=MAX_SAMPLES)
        self._rates = collections.deque()  # (time, prefill tokens, decode tokens)
        self._start = self._steady = self._last = _Mark(time.perf_counter(), 0, None, 0.0)

    def _mark(self, stats: EngineStats) -> _Mark:
        return _Mark(time.perf_counter(), stats.totals["decode_tokens"], stats.worker.compression_s,
                     stats.worker.compile_s)

    def count_read_back(self, kind: str, num_tokens: int, now: float):
        """A step's sampled tokens were read back: its prompt or generated tokens count now."""
        self.totals["prefill_tokens" if kind == "prefill" else "decode_tokens"] += num_tokens
        self._rates.append((now, num_tokens if kind == "prefill" else 0, num_tokens if kind == "decode" else 0))
        while self._rates and now - self._rates[0][0] > RATE_WINDOW_S:
            self._rates.popleft()

    def reset(self, stats: EngineStats):
        """Start afresh now: no samples; rates and time shares (steady state too) count from here."""
        self.samples.clear()
        self._start = self._steady = self._last = self._mark(stats)

    def mark_steady(self, stats: EngineStats):
        """Steady state starts now (the end of warm-up): what came before is start-up."""
        self._steady = self._mark(stats)

    def metrics(self, stats: EngineStats) -> dict:
        s, w = stats.scheduler, stats.worker
        now = time.perf_counter()
        span = (self._rates[-1][0] - self._rates[0][0]) if len(self._rates) > 1 else 0.0
        steady_wall = now - self._steady.time - (w.compile_s - self._steady.compile_s)
        return dict(
            num_running=s.num_running, num_waiting=s.num_waiting, num_preempted=s.num_preemptions,
            kv_pages_total=s.kv_pages_total, kv_pages_used=s.kv_pages_used,
            page_occupancy=s.kv_pages_used / s.kv_pages_total, prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            prompt_tokens_total=stats.totals["prefill_tokens"], generation_tokens_total=stats.totals["decode_tokens"],
            prefill_tokens_per_s=sum(r[1] for r in self._rates) / span if span else 0.0,
            decode_tokens_per_s=sum(r[2] for r in self._rates) / span if span else 0.0,
            compression_time_share=_share(w.compression_s, self._start.compression_s, now - self._start.time),
            steady_compression_time_share=_share(w.compression_s, self._steady.compression_s, steady_wall),
            num_requests_finished=stats.totals["finished"], num_compressions=stats.totals["compressions"],
            num_compiles=stats.num_compiles, num_compiles_waited_on=w.compiled_on_use,
            compiling_in_background=w.compiling_in_background,
            num_stalled=s.num_stalled, num_swapped=s.num_swapped, num_swaps=s.num_swaps,
            num_query_rows=s.num_query_rows, query_rows_used=s.query_rows_used,
            max_concurrency=stats.max_concurrency, kv_cache_dtype=w.kv_cache_dtype,
        )

    def due(self) -> bool:
        """Whether the step just counted takes a history sample."""
        return bool(self.interval) and self.totals["steps"] % self.interval == 0

    def sample(self, stats: EngineStats):
        """One history sample: the sampled gauges, and the decode rate and compression share since the last."""
        gauges, mark = self.metrics(stats), self._mark(stats)
        span = max(mark.time - self._last.time, 1e-9)
        self.samples.append(dict(
            time_s=mark.time - self._start.time, step=stats.totals["steps"], **{k: gauges[k] for k in SAMPLED},
            decode_tokens_per_s=(mark.decode_tokens - self._last.decode_tokens) / span,
            compression_time_share=_share(mark.compression_s, self._last.compression_s, span)))
        self._last = mark
