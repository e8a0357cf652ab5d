"""Fan one engine loop's outputs out to asyncio consumers.

The loop (``engine_core.EngineCore``) runs where its ``core`` says (``core_client``: a thread of this process, or a
process of its own); the event loop sends it commands and receives its events (``messages``), each handed to the
event loop with ``call_soon_threadsafe``. Every HTTP request becomes a `request_group.RequestGroup` (its n choices
× prompts), which the engine validates and queues all or none. An ``observer`` (the server's metrics) sees each
delta as it arrives and each group as it closes.
"""

import asyncio
import itertools
import logging
import time

from zipage_jax.engine.core_client import ThreadCore
from zipage_jax.engine.messages import (Abort, Added, AddRequests, Event, Exited, Failed, Metrics, NewRequest, Outputs,
                                        Ready, Refused, Startup, Stop, Stopped)
from zipage_jax.engine.request_group import RequestGroup

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or its loop is gone."""


class RequestRefused(Exception):
    """The engine refused a request's input; ``refused`` (``messages.Refused``) says which field and why."""

    def __init__(self, refused: Refused):
        super().__init__(refused.message)
        self.refused = refused


class AsyncEngine:
    """The event-loop side of one engine loop. ``engine``: an `LLMEngine` (its loop then runs on a thread of this
    process) or a started core (``core_client.ProcessCore``). `submit` / `RequestGroup.close` are called from the
    event loop only.

    ``observer``: ``delta(group, index, delta, now)``, called before the delta is applied to its choice (its
    previous token time is still there), and ``closed(group, num_unfinished)``."""

    def __init__(self, engine, *, max_queued_requests: int, warmup: bool = False, ready_early: bool = False,
                 observer=None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.core = engine if hasattr(engine, "send") else ThreadCore(engine, warmup, ready_early)
        self.ready = not warmup
        self.startup = "waiting for the engine loop" if warmup else "ready"  # what start-up is doing now
        self.capacity = self.core.info.config.max_num_seqs + max_queued_requests
        self.in_flight = 0  # admitted choices not yet closed
        self.client_aborts = 0
        self.rejected = 0
        self.step_failures = 0
        self.metrics: dict = {}  # the loop's latest engine.metrics()
        self.observer = observer
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # request id -> its group, its choice index
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

    async def submit(self, requests: list[NewRequest], arrival: float | None = None) -> RequestGroup:
        """Queue ``requests`` as one group, all or none; the group's ``accepted`` says what the engine queued.
        ``arrival``: when the HTTP request came (``time.monotonic()``; default now).

        Raises QueueFullError, EngineUnavailableError, or RequestRefused for input the engine refuses.
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
        group = RequestGroup([r.request_id for r in requests], self._close,
                             time.monotonic() if arrival is None else arrival)
        for index, request in enumerate(requests):
            self._routes[request.request_id] = (group, index)
        token = next(self._tokens)
        added = self._adding[token] = self._loop.create_future()
        self.core.send(AddRequests(token, requests))
        try:
            group.accepted = await added
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
        self.core.send(Stop())
        await asyncio.to_thread(self.core.join, timeout)

    def _close(self, group: RequestGroup, unfinished: list[str]):
        if unfinished:
            for request_id in unfinished:
                self._routes.pop(request_id, None)
            self.core.send(Abort(unfinished))
        self.in_flight -= len(group.request_ids)
        if self.observer is not None and group.accepted:  # a group the engine refused never ran
            self.observer.closed(group, len(unfinished))

    # -- events (on the event loop) --------------------------------------------------------------------------
    def _on_event(self, event: Event):
        match event:
            case Outputs(deltas):
                now = time.monotonic()
                for delta in deltas:
                    route = self._routes.get(delta.request_id)
                    if route is None:
                        continue  # closed by its client meanwhile
                    if delta.finished:
                        del self._routes[delta.request_id]
                    group, index = route
                    if self.observer is not None:
                        self.observer.delta(group, index, delta, now)
                    group.apply(index, delta, now)
            case Added(token, accepted):
                self._answer(token, lambda future: future.set_result(accepted))
            case Refused(token, message, bad_input=bad_input):
                error = RequestRefused(event) if bad_input else RuntimeError(message)
                self._answer(token, lambda future: future.set_exception(error))
            case Metrics(values):
                self.metrics = values
            case Startup(detail):
                self.startup = detail
            case Ready():
                self.startup, self.ready = "ready", True
            case Failed(request_ids, message, step_failure):
                self.step_failures += step_failure
                self._fail(request_ids, message)
            case Exited():  # the engine process ended without being asked to
                self._exited = True
                if not self._stopping:
                    log.error("the engine process exited; failing %d in-flight request(s)", len(self._routes))
                for future in self._adding.values():
                    if not future.done():
                        future.set_exception(EngineUnavailableError("the engine process exited"))
                self._fail(list(self._routes), "the engine process exited")
            case Stopped():
                pass

    def _answer(self, token: int, settle):
        future = self._adding.pop(token)
        if not future.done():  # its client went away meanwhile
            settle(future)

    def _fail(self, request_ids, message: str):
        groups = {}
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is not None:
                group, _ = route
                groups[id(group)] = group
        for group in groups.values():
            group.fail(message)
