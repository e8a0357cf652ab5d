"""Drive one `LLMEngine` from one background thread and fan its outputs out to asyncio consumers.

The engine is not thread-safe, so only the loop thread ever touches it: the event loop hands it commands
(add / abort / stop) through a thread-safe queue, and the loop thread hands outputs back with
`call_soon_threadsafe`. Every HTTP request becomes a `RequestGroup` (its n choices × prompts); a group keeps
only the latest cumulative output per choice, so a slow client costs memory O(1) per choice, not per token.
"""

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = 0.05  # pause after an engine exception so a persistent fault cannot spin the CPU
METRICS_INTERVAL_S = 0.25  # the loop thread refreshes /metrics' numbers at most this often while busy
MAX_SHUTDOWN_STEPS = 10_000  # steps allowed to retire aborted requests when stopping


class QueueFullError(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or its loop thread is gone."""


class EngineStepError(Exception):
    """An exception inside `engine.step()` failed this request (the loop itself keeps running)."""


class RequestGroup:
    """The choices of one HTTP request, as seen from the event loop."""

    def __init__(self, owner: "AsyncEngine", request_ids: list[str]):
        self.request_ids = request_ids
        self._owner = owner
        self._latest: dict[int, object] = {}  # choice index -> newest RequestOutput not yet consumed
        self._finished: set[int] = set()
        self._error: str | None = None
        self._event = asyncio.Event()
        self._closed = False

    @property
    def done(self) -> bool:
        return len(self._finished) == len(self.request_ids)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _post(self, index: int, output):
        if self._closed:
            return
        self._latest[index] = output
        if output.finished:
            self._finished.add(index)
        self._event.set()

    def _fail(self, message: str):
        if not self._closed:
            self._error = message
            self._event.set()

    async def updates(self):
        """Yield `{choice index: latest RequestOutput}` batches until every choice has finished."""
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise EngineStepError(self._error)
            batch, self._latest = self._latest, {}
            if batch:
                yield batch
            if self.done:
                return

    async def results(self) -> list:
        """Wait for every choice; the final RequestOutput of each, in choice order."""
        final = {}
        async for batch in self.updates():
            final.update(batch)
        return [final[i] for i in range(len(self.request_ids))]

    def close(self):
        """Abort what is still running and give the capacity back; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        unfinished = [rid for i, rid in enumerate(self.request_ids) if i not in self._finished]
        if unfinished:
            self._owner._abort(unfinished)
        self._owner._release(len(self.request_ids))


class AsyncEngine:
    """Owns the loop thread. `submit` / `RequestGroup.close` are called from the event loop only."""

    def __init__(self, engine, *, max_queued_requests: int, warmup: bool = False):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self.warmup = warmup  # the loop thread compiles the engine's programs before it serves
        self.ready = not warmup
        self.startup = "waiting for the engine loop" if warmup else "ready"  # what start-up is doing now
        self.capacity = engine.config.max_num_seqs + max_queued_requests
        self.in_flight = 0  # admitted choices not yet closed (event-loop side)
        self.client_aborts = 0
        self.rejected = 0
        self.step_failures = 0
        self.metrics: dict = {}  # latest engine.metrics(), published by the loop thread
        self._metrics_at = 0.0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # loop-thread side
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_warmup = concurrent.futures.Future()  # done on shutdown: a warm-up still compiling ends at once

    # -- event-loop side -------------------------------------------------------------------------------------
    def start(self):
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def submit(self, requests: list[tuple]) -> RequestGroup:
        """Add `(request_id, prompt_token_ids, SamplingParams)` requests as one group, all or none.

        Raises QueueFullError, EngineUnavailableError, or the engine's ValueError for bad input.
        """
        if not self.alive:
            raise EngineUnavailableError("the server is shutting down")
        if not self.ready:
            raise EngineUnavailableError(f"the server is starting ({self.startup})")
        if self.in_flight + len(requests) > self.capacity:
            self.rejected += 1
            raise QueueFullError(f"the request queue is full ({self.in_flight} of {self.capacity} slots in use); "
                                 "retry later")
        self.in_flight += len(requests)
        group = RequestGroup(self, [r[0] for r in requests])
        added = self._loop.create_future()
        self._commands.put(("add", group, requests, added))
        try:
            await added
        except BaseException:
            group.close()
            raise
        return group

    def record_client_abort(self):
        self.client_aborts += 1

    async def stop(self):
        """Abort everything still running, retire it in the engine and join the loop thread."""
        self._stopping = True
        if not self._stop_warmup.done():
            self._stop_warmup.set_result(None)
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)

    def _abort(self, request_ids: list[str]):
        self._commands.put(("abort", request_ids))

    def _release(self, count: int):
        self.in_flight -= count

    # -- loop-thread side ------------------------------------------------------------------------------------
    def _run(self):
        self.metrics = self.engine.metrics()
        if self.warmup:
            self._warm_up()
        while True:
            try:
                busy = self.engine.has_unfinished_requests()
                for command in self._drain(block=not busy):
                    if command[0] == "stop":
                        self._shutdown()
                        return
                    self._execute(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_metrics()
            except Exception:  # a bug outside engine.step: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all("internal engine error")
                time.sleep(FAILURE_BACKOFF_S)

    def _publish_metrics(self):
        """``engine.metrics()`` for /metrics, at most every ``METRICS_INTERVAL_S`` while busy (it sums the rate
        window on the loop thread, between the steps that keep the device fed) and always once the engine idles,
        so a scrape after the load sees it drained."""
        now = time.monotonic()
        if self.engine.has_unfinished_requests() and now - self._metrics_at < METRICS_INTERVAL_S:
            return
        self.metrics, self._metrics_at = self.engine.metrics(), now

    def _warm_up(self):
        """Compile every program before serving; meanwhile ``startup`` says how far it got (for /health)."""
        def progress(done, total, name, seconds):
            self.startup = f"compiled {done}/{total} programs, last: {name}"

        self.startup = "compiling programs"
        try:
            self.engine.warmup(progress, stop=self._stop_warmup)
        except Exception as error:
            if self._stop_warmup.done():  # shutting down: compiles still running are left to finish unused
                log.info("warm-up stopped for the shutdown (%s)", error)
                return
            log.exception("warm-up failed; programs compile on first use")  # serving beats refusing to start
        self.startup, self.ready = "ready", True

    def _drain(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _execute(self, command):
        if command[0] == "add":
            _, group, requests, added = command
            self._add(group, requests, added)
        else:
            for request_id in command[1]:
                self._routes.pop(request_id, None)
                self.engine.abort_request(request_id)

    def _add(self, group, requests, added):
        done = []
        try:
            for index, (request_id, prompt, params) in enumerate(requests):
                self.engine.add_request(request_id, prompt, params)
                done.append(request_id)
                self._routes[request_id] = (group, index)
        except Exception as exc:
            for request_id in done:
                self._routes.pop(request_id, None)
                self.engine.abort_request(request_id)
            self._loop.call_soon_threadsafe(_settle, added, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, added, None)

    def _step(self):
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine cannot say which requests the failed step held, so every request in flight fails.
            log.exception("engine.step failed; failing %d in-flight request(s)", len(self._routes))
            self.step_failures += 1
            self._fail_all("the engine failed while generating this request")
            time.sleep(FAILURE_BACKOFF_S)
            return
        deliveries = []
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted by its client, or from a failed add
            if output.finished:
                del self._routes[output.request_id]
            deliveries.append((route[0], route[1], output))
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, message: str):
        routes, self._routes = self._routes, {}
        for request_id in routes:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%r) failed", request_id)
        groups = {id(g): g for g, _ in routes.values()}.values()
        if groups:
            self._loop.call_soon_threadsafe(_fail_groups, list(groups), message)

    def _shutdown(self):
        """Retire every request (its pages go back to the pool) before the thread ends."""
        for request_id in list(self._routes):
            self.engine.abort_request(request_id)
        for _ in range(MAX_SHUTDOWN_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
        self._fail_all("the server is shutting down")
        self.metrics = self.engine.metrics()


def _settle(future: asyncio.Future, exc: Exception | None):
    if not future.done():
        future.set_result(None) if exc is None else future.set_exception(exc)


def _deliver(deliveries):
    for group, index, output in deliveries:
        group._post(index, output)


def _fail_groups(groups, message: str):
    for group in groups:
        group._fail(message)
