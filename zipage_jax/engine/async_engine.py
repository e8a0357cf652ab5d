"""Fan one engine loop's outputs out to asyncio consumers.

The loop (``engine_core.EngineCore``) runs where its ``core`` says (``core_client``: a thread of this process, or a
process of its own); the event loop sends it commands (add / abort / stop) and receives its events, each handed
to the event loop with ``call_soon_threadsafe``. Every HTTP request becomes a `RequestGroup` (its n choices ×
prompts); a group keeps only the latest cumulative output per choice (the loop's deltas are merged into it), so a
slow client costs memory O(1) per choice, not per token.
"""

import asyncio
import itertools
import logging

from zipage_jax.engine.core_client import ThreadCore
from zipage_jax.engine.engine_core import merge
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)


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
    """The event-loop side of one engine loop. ``engine``: an `LLMEngine` (its loop then runs on a thread of this
    process) or a started core (``core_client.ProcessCore``). `submit` / `RequestGroup.close` are called from the
    event loop only."""

    def __init__(self, engine, *, max_queued_requests: int, warmup: bool = False, ready_early: bool = False):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.core = engine if hasattr(engine, "send") else ThreadCore(engine, warmup, ready_early)
        self.ready = not warmup
        self.startup = "waiting for the engine loop" if warmup else "ready"  # what start-up is doing now
        self.capacity = self.core.config.max_num_seqs + max_queued_requests
        self.in_flight = 0  # admitted choices not yet closed
        self.client_aborts = 0
        self.rejected = 0
        self.step_failures = 0
        self.metrics: dict = {}  # the loop's latest engine.metrics()
        self._routes: dict[str, tuple[RequestGroup, int, RequestOutput]] = {}
        self._adding: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._exited = False

    def start(self):
        self._loop = asyncio.get_running_loop()
        self.core.start(lambda event: self._loop.call_soon_threadsafe(self._on_event, event))

    @property
    def alive(self) -> bool:
        return self.core.alive and not self._stopping and not self._exited

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
        for index, (request_id, prompt, _) in enumerate(requests):
            output = RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [], None, None)], False)
            self._routes[request_id] = (group, index, output)
        token = next(self._tokens)
        added = self._adding[token] = self._loop.create_future()
        self.core.send(("add", token, requests))
        try:
            await added
        except BaseException:
            for request_id in group.request_ids:
                self._routes.pop(request_id, None)
            group.close()
            raise
        return group

    def record_client_abort(self):
        self.client_aborts += 1

    async def stop(self, timeout: float = 30.0):
        """Abort everything still running, retire it in the engine and wait for the loop to end."""
        self._stopping = True
        self.core.send(("stop",))
        await asyncio.to_thread(self.core.join, timeout)

    def _abort(self, request_ids: list[str]):
        for request_id in request_ids:
            self._routes.pop(request_id, None)
        self.core.send(("abort", request_ids))

    def _release(self, count: int):
        self.in_flight -= count

    # -- events (on the event loop) --------------------------------------------------------------------------
    def _on_event(self, event):
        kind = event[0]
        if kind == "outputs":
            for delta in event[1]:
                route = self._routes.get(delta.request_id)
                if route is None:
                    continue  # closed by its client meanwhile
                group, index, output = route
                merge(output, delta)
                if delta.finished:
                    del self._routes[delta.request_id]
                group._post(index, output)
        elif kind == "added":
            future = self._adding.pop(event[1])
            if not future.done():
                if event[2] is None:
                    future.set_result(None)
                else:
                    is_value_error, message = event[2]
                    future.set_exception((ValueError if is_value_error else RuntimeError)(message))
        elif kind == "metrics":
            self.metrics = event[1]
        elif kind == "startup":
            self.startup = event[1]
        elif kind == "ready":
            self.startup, self.ready = "ready", True
        elif kind == "failed":
            _, request_ids, message, step_failure = event
            self.step_failures += step_failure
            self._fail(request_ids, message)
        elif kind == "exited":  # the engine process ended without being asked to
            self._exited = True
            if not self._stopping:
                log.error("the engine process exited; failing %d in-flight request(s)", len(self._routes))
            for future in self._adding.values():
                if not future.done():
                    future.set_exception(EngineUnavailableError("the engine process exited"))
            self._fail(list(self._routes), "the engine process exited")

    def _fail(self, request_ids, message: str):
        groups = {}
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is not None:
                groups[id(route[0])] = route[0]
        for group in groups.values():
            group._fail(message)
