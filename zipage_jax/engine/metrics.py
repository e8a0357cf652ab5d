"""What the step loop reports about itself: scheduler state over time (``LLMEngine.metrics_history``) and one
record per step for step observers (``LLMEngine.add_step_observer``)."""

import collections
import dataclasses
import time

from zipage_jax.core.scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step: what the scheduler decided and where the step's host time went (seconds)."""

    scheduled: SchedulerOutput
    schedule_s: float  # Scheduler.schedule()
    dispatch_s: float  # runner.execute(): packing the inputs and dispatching the device work
    read_back_s: float  # blocked waiting for the previous step's sampled tokens
    step_s: float  # the whole step() call; step_s - read_back_s is the host's own time


class MetricsHistory:
    """Scheduler state over time: one sample every ``interval`` engine steps, rates over the last interval."""

    MAX_SAMPLES = 4096

    def __init__(self, interval: int):
        self.interval = interval
        self.samples = collections.deque(maxlen=self.MAX_SAMPLES)
        self.start = time.perf_counter()
        self._start_compression = 0.0  # compression seconds at start
        self._last = (self.start, 0, 0.0)  # time, decode tokens, compression seconds
        self._steady = (self.start, 0.0, 0.0)  # time, compression seconds, compile wall seconds

    def reset(self, engine):
        """Start afresh now: no samples; rates and time shares (steady state too) count from here."""
        self.samples.clear()
        self.start = time.perf_counter()
        self._start_compression = engine.runner.compression_seconds
        self._last = (self.start, engine.totals["decode_tokens"], engine.runner.compression_seconds)
        self.mark_steady(engine)

    def compression_share(self, engine) -> float:
        """Device seconds spent compressing per wall second since the engine started (or the history was reset)."""
        compressing = engine.runner.compression_seconds - self._start_compression
        return compressing / max(time.perf_counter() - self.start, 1e-9)

    def mark_steady(self, engine):
        """Steady state starts now (the end of warm-up): what came before is start-up."""
        self._steady = (time.perf_counter(), engine.runner.compression_seconds, engine.runner.programs.compile_wall_s)

    def steady_compression_share(self, engine) -> float:
        """Device seconds spent compressing per wall second of steady state: since warm-up ended (or the engine
        started, without one), less the time compiling programs met after it."""
        then, compressing, compiling = self._steady
        wall = time.perf_counter() - then - (engine.runner.programs.compile_wall_s - compiling)
        return (engine.runner.compression_seconds - compressing) / max(wall, 1e-9)

    def maybe_sample(self, engine):
        steps = engine.totals["steps"]
        if not self.interval or steps % self.interval:
            return
        now = time.perf_counter()
        then, decoded, compressing = self._last
        span = max(now - then, 1e-9)
        s, bm = engine.scheduler, engine.page_manager
        self.samples.append(dict(
            time_s=now - self.start, step=steps, num_running=len(s.running), num_waiting=len(s.waiting),
            num_stalled=s.num_stalled, num_swapped=len(s.swapped), kv_pages_used=bm.num_used_pages,
            page_occupancy=bm.num_used_pages / (bm.num_pages - 1),
            query_rows_used=s.num_query_rows - len(s.free_query_rows),
            decode_tokens_per_s=(engine.totals["decode_tokens"] - decoded) / span,
            compression_time_share=(engine.runner.compression_seconds - compressing) / span,
            num_preemptions=s.num_preemptions, num_swaps=s.num_swaps, num_compressions=engine.totals["compressions"]))
        self._last = (now, engine.totals["decode_tokens"], engine.runner.compression_seconds)
