"""What benchmarks attach to an engine to measure it, kept out of the engine itself: a scheduler that holds
requests back, a replay of the last decode step, and a timer of compression dispatches."""

import time

import jax

from zipage_jax.core.request import Request, RequestStatus
from zipage_jax.core.scheduler import Scheduler
from zipage_jax.worker import input_batch


class HoldingScheduler(Scheduler):
    """A scheduler that can take running requests out of scheduling without freeing anything: each keeps its pages,
    KV and rows (and is never preempted) until released. The decode benchmark holds prefilled requests this way
    until its whole batch is prefilled, so every one decodes at the same context length."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: list[Request] = []

    def hold(self, requests: list[Request]):
        """Raises ``ValueError`` (and holds none) unless every request is running."""
        self._check(requests, self.running, "running")
        for request in requests:
            self.running.remove(request)
            self.held.append(request)

    def release(self, requests: list[Request]):
        """Schedule held requests again, in the order given, after the running ones."""
        self._check(requests, self.held, "held")
        for request in requests:
            self.held.remove(request)
            self.running.append(request)

    @staticmethod
    def _check(requests, where: list, what: str):
        wrong = [r.request_id for r in requests if r not in where]
        if wrong:
            raise ValueError(f"requests: {wrong} are not {what}")

    def finish(self, request: Request, status: RequestStatus):
        if request in self.held:  # aborted while held
            self.held.remove(request)
            self.running.append(request)
        super().finish(request, status)


class DecodeReplay:
    """Records the worker's last decode step and dispatches it again, back to back with nothing around it: one
    step's device time. The input tokens that step read on the device are known on the host by now (read back with
    it) and are fed as such, so a replay rewrites what the step wrote (its KV slots; its token-buffer rows, the same
    tokens unless penalties apply); valid until the next step changes pages or rows."""

    def __init__(self, worker):
        self.worker = worker
        self.last = None  # the last decode's ``StepDispatch``
        worker.add_step_observer(self._record)

    @classmethod
    def of(cls, engine) -> "DecodeReplay":
        """A replay of ``engine``'s own worker: the one place a benchmark reaches past the step loop."""
        return cls(engine.worker)

    def _record(self, dispatch):
        if dispatch.kind == "decode":
            self.last = dispatch

    @property
    def program_key(self):
        """The key of the last decode's program (``worker.programs.compiled[key]``: its HLO)."""
        return self.last.program_key

    def __call__(self) -> jax.Array:
        """Dispatch the last decode step again; returns its sampled tokens (not waited for)."""
        if self.last is None:
            raise RuntimeError("DecodeReplay: no decode step was dispatched yet")
        last = self.last
        inputs = input_batch.known_tokens(last.inputs, last.requests)
        handle, _ = self.worker.dispatch_step("decode", inputs, last.requests, len(last.requests), last.bucket)
        self.last = last  # the replay is not a step of its own
        return handle.ids[:, 0]  # each row's token first (``layers.logprobs``)


class CompressionTimer:
    """Times asynchronous compression dispatches for a benchmark, at the cost of host syncs the engine never makes
    itself: each of the first ``probes`` dispatches of a shape is timed (the device drained before and after), later
    ones are counted at the fastest time measured for their shape. The seconds reach the engine's stats (so its
    compression shares) through ``add_compression_observer``'s return value."""

    def __init__(self, probes: int = 2):
        self.probes = probes
        self.times: dict = {}  # shape -> measured seconds
        self.dispatches: dict = {}  # shape -> [dispatches, requests compressed]

    def __call__(self, dispatch, run) -> float:
        shape = dispatch.shape
        counts = self.dispatches.setdefault(shape, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + len(dispatch.compressions)
        seen = self.times.setdefault(shape, [])
        if len(seen) >= self.probes:
            run()
            return min(seen)
        jax.block_until_ready(dispatch.state().k_pool)
        start = time.perf_counter()
        run()
        jax.block_until_ready(dispatch.state().k_pool)
        seen.append(time.perf_counter() - start)
        return seen[-1]

    def profile(self) -> list[dict]:
        """Per dispatch shape (budget M, padded width, row bucket): dispatches, requests compressed and the fastest
        measured seconds of one, to tell a dispatch's fixed cost from its per-row cost."""
        return [dict(budget=s.budget, width=s.width, rows=s.rows, dispatches=n, requests=k,
                     seconds=min(self.times.get(s, []), default=None))
                for s, (n, k) in sorted(self.dispatches.items(), key=lambda item: (item[0].budget, item[0].width,
                                                                                   item[0].rows))]
