"""The engine loop: one `LLMEngine` stepped by one thread, fed commands through a queue, reporting through events.

It runs on a thread of the server's process (``core_client.ThreadCore``) or alone in a process of its own
(``core_client.ProcessCore``, the server's default: HTTP, JSON and SSE then do not share a GIL with the loop that
keeps the device fed). Either way it speaks in ``messages``: each step's outputs travel as ``OutputDelta``s (the
tokens, text and logprobs new since the request's last delta), O(new tokens) per request and step instead of the
cumulative O(length). Requests are validated here, by ``LLMEngine.add_request`` with the server's length rule, and
nowhere else: the server learns what was queued (``Added``) or why not (``Refused``). A request's final delta says
how the engine ran it (``RequestStats``: its time in the queue, measured here, and what compression did to it).
"""

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from zipage_jax.engine.messages import (Abort, Accepted, Added, AddRequests, Command, Event, Failed, Metrics,
                                        OutputDelta, Outputs, Ready, Refused, RequestStats, Startup, Stop, Stopped)

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = 0.05  # pause after an engine exception so a persistent fault cannot spin the CPU
METRICS_INTERVAL_S = 0.25  # metrics are refreshed at most this often while busy
MAX_SHUTDOWN_STEPS = 10_000  # steps allowed to retire aborted requests when stopping


class EngineCore:
    """Steps ``engine`` while it has work; between steps runs the commands queued since."""

    def __init__(self, engine, emit: Callable[[Event], None], commands: queue.SimpleQueue,
                 stop_warmup: concurrent.futures.Future, warmup: bool, ready_early: bool = False):
        self.engine = engine
        self.emit = emit  # called from the loop's thread only
        self.commands = commands
        self.stop_warmup = stop_warmup  # done on shutdown: a warm-up still compiling ends at once
        self.warmup = warmup
        self.ready_early = ready_early  # ready once a light load's programs are; the rest compile in the background
        self._sent: dict[str, Reported] = {}  # the requests in flight
        self._metrics_at = 0.0

    def run(self):
        self.engine.add_step_observer(self._note_scheduled)
        try:
            self._run()
        finally:
            self.engine.remove_step_observer(self._note_scheduled)

    def _run(self):
        self.emit(Metrics(self.engine.metrics()))
        if self.warmup:
            self._warm_up()
        while True:
            try:
                busy = self.engine.has_unfinished_requests()
                for command in self._drain(block=not busy, timeout=self._idle_refresh_s()):
                    match command:
                        case AddRequests():
                            self._add(command)
                        case Abort(request_ids):
                            self._abort(request_ids)
                        case Stop():
                            self._shutdown()
                            self.emit(Stopped())
                            return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_metrics()
            except Exception:  # a bug outside engine.step: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all("internal engine error")
                time.sleep(FAILURE_BACKOFF_S)

    def _warm_up(self):
        """Compile every program before serving (with ``ready_early``, those of a light load), reporting progress
        (the server's /health shows it)."""
        loop_thread = threading.current_thread()

        def progress(done, total, name, seconds):
            if threading.current_thread() is loop_thread:  # not the background compiles: ``emit`` is this thread's
                self.emit(Startup(f"compiled {done}/{total} programs, last: {name}"))

        self.emit(Startup("compiling programs"))
        try:
            self.engine.warmup(progress, stop=self.stop_warmup, ready_early=self.ready_early)
        except Exception as error:
            if self.stop_warmup.done():  # shutting down: compiles still running are left to finish unused
                log.info("warm-up stopped for the shutdown (%s)", error)
                return
            log.exception("warm-up failed; programs compile on first use")  # serving beats refusing to start
        self.emit(Metrics(self.engine.metrics()))  # what is ready now, before requests come
        self.emit(Ready())

    def _publish_metrics(self):
        """At most every ``METRICS_INTERVAL_S`` while busy (it sums the rate window between the steps that keep
        the device fed) and always once the engine idles, so a scrape after the load sees it drained."""
        now = time.monotonic()
        if self.engine.has_unfinished_requests() and now - self._metrics_at < METRICS_INTERVAL_S:
            return
        self._metrics_at = now
        self.emit(Metrics(self.engine.metrics()))

    def _idle_refresh_s(self) -> float | None:
        """While programs compile in the background an idle loop still refreshes the metrics (``/health`` reports
        when they are done); otherwise it sleeps until a command comes."""
        return METRICS_INTERVAL_S if self.engine.compiling_in_background else None

    def _drain(self, block: bool, timeout: float | None = None) -> list[Command]:
        commands = []
        if block:
            try:
                commands.append(self.commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def _abort(self, request_ids):
        for request_id in request_ids:
            if self._sent.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _add(self, command: AddRequests):
        """Queue the command's requests, all or none; the engine checks each (the server's rule: a ``max_tokens``
        beyond the context is refused, not capped)."""
        accepted = []
        try:
            for new in command.requests:
                self.engine.add_request(new.request_id, new.prompt_token_ids, new.params, reject_over_length=True)
                request = self.engine.requests[new.request_id]
                self._sent[new.request_id] = Reported(request, queued_at=time.monotonic())
                kept = request.prompt_token_ids
                accepted.append(Accepted(len(kept), list(kept) if len(kept) != len(new.prompt_token_ids) else None))
        except Exception as error:
            self._abort([new.request_id for new in command.requests[:len(accepted)]])
            self.emit(Refused.of(command.token, error))
        else:
            self.emit(Added(command.token, accepted))

    def _step(self):
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine cannot say which requests the failed step held, so every request in flight fails.
            log.exception("engine.step failed; failing %d in-flight request(s)", len(self._sent))
            self._fail_all("the engine failed while generating this request", step_failure=True)
            time.sleep(FAILURE_BACKOFF_S)
            return
        deltas = []
        for output in outputs:
            reported = self._sent.get(output.request_id)
            if reported is None:
                continue  # aborted by its client, or from a failed add
            deltas.append(output_delta(output, reported))
            if output.finished:
                del self._sent[output.request_id]
        if deltas:
            self.emit(Outputs(deltas))

    def _note_scheduled(self, record):
        """A step observer: the requests whose first prompt chunk this step scheduled leave the queue (at the
        step's scheduling, not its end)."""
        if not record.scheduled.prefills:
            return
        scheduled_at = time.monotonic() - record.step_s + record.schedule_s
        for chunk in record.scheduled.prefills:
            reported = self._sent.get(chunk.request.request_id)
            if reported is not None and reported.scheduled_at is None:
                reported.scheduled_at = scheduled_at

    def _fail_all(self, message: str, step_failure: bool = False):
        request_ids, self._sent = list(self._sent), {}
        for request_id in request_ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%r) failed", request_id)
        if request_ids or step_failure:
            self.emit(Failed(request_ids, message, step_failure))

    def _shutdown(self):
        """Retire every request (its pages go back to the pool) before the loop ends."""
        for request_id in list(self._sent):
            self.engine.abort_request(request_id)
        for _ in range(MAX_SHUTDOWN_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        self._fail_all("the server is shutting down")
        self.emit(Metrics(self.engine.metrics()))


@dataclasses.dataclass
class Reported:
    """How much of one request's output the server has, and what its final delta's stats read (``request``: the
    engine's, None in tests of the deltas alone)."""

    request: object = None  # core.request.Request
    queued_at: float = 0.0  # time.monotonic()
    scheduled_at: float | None = None
    tokens: int = 0
    chars: int = 0
    prompt_logprobs: bool = False  # all of them (they are complete once the prompt is computed)

    def stats(self) -> RequestStats | None:
        r = self.request
        if r is None:
            return None
        queue_s = None if self.scheduled_at is None else max(self.scheduled_at - self.queued_at, 0.0)
        return RequestStats(len(r.prompt_token_ids), queue_s, r.num_evicted, r.peak_pages, r.num_compressions,
                            r.num_preemptions)


def output_delta(output, reported: Reported) -> OutputDelta:
    """The part of ``output`` (cumulative) not reported yet; advances ``reported``."""
    c = output.outputs[0]
    token_start, text_start = min(reported.tokens, len(c.token_ids)), min(reported.chars, len(c.text))
    reported.tokens, reported.chars = len(c.token_ids), len(c.text)
    prompt_logprobs = None if reported.prompt_logprobs else output.prompt_logprobs
    if prompt_logprobs is not None:
        reported.prompt_logprobs = None not in prompt_logprobs[1:]  # the first has none: nothing predicts it
    return OutputDelta(output.request_id, token_start, c.token_ids[token_start:], text_start, c.text[text_start:],
                       None if c.logprobs is None else c.logprobs[token_start:], c.finish_reason, c.stop_reason,
                       prompt_logprobs, reported.stats() if output.finished else None)
