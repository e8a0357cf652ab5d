"""The choices of one HTTP request as the event loop holds them, while the engine loop's deltas arrive.

Each choice is one `ChoiceOutput` that every delta is applied to on arrival: a client that lags costs that one
object per choice, however many steps behind it is (its deltas coalesce; nothing queues). A stream takes each
token once it has sent it, so what a streamed choice holds of its tokens and logprobs is only what is unsent.
"""

import asyncio

from zipage_jax.engine.messages import Accepted, OutputDelta


class EngineStepError(Exception):
    """An exception inside `engine.step()` failed this request (the loop itself keeps running)."""


class ChoiceOutput:
    """One choice's output so far. ``text`` is whole (a stop string found late retracts its tail; a reasoning
    parser splits it whole); ``token_ids`` and ``logprobs`` (None unless asked) are the tokens not taken yet, of
    ``num_tokens`` generated. ``first_token_at`` / ``last_token_at``: when (``time.monotonic()``) the server received
    its first and its latest tokens."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.num_taken = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_taken + len(self.token_ids)

    def apply(self, delta: OutputDelta, now: float | None = None):
        if delta.token_ids and now is not None:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        # where the delta's tokens go among those held; a token reported once is never taken back, so a delta never
        # starts before the taken ones (``skip`` only guards it)
        start = max(delta.token_start - self.num_taken, 0)
        skip = max(self.num_taken - delta.token_start, 0)
        del self.token_ids[start:]
        self.token_ids.extend(delta.token_ids[skip:])
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            del self.logprobs[start:]
            self.logprobs.extend(delta.logprobs[skip:])
        self.text = self.text[:delta.text_start] + delta.text
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def take_tokens(self) -> tuple[list[int], list | None]:
        """The tokens not taken yet and their logprobs (None unless asked); later calls return only newer ones."""
        token_ids, logprobs = self.token_ids, self.logprobs
        self.num_taken += len(token_ids)
        self.token_ids, self.logprobs = [], None if logprobs is None else []
        return token_ids, logprobs


class RequestGroup:
    """The choices of one HTTP request. ``accepted``: what the engine queued of each (``messages.Accepted``);
    ``arrival``: when (``time.monotonic()``) the server received the request."""

    def __init__(self, request_ids: list[str], on_close, arrival: float = 0.0):
        self.request_ids, self.arrival = request_ids, arrival
        self.outputs = [ChoiceOutput() for _ in request_ids]
        self.accepted: list[Accepted] = []
        self._on_close = on_close  # (the unfinished request ids, how many choices): abort them, give capacity back
        self._changed: set[int] = set()
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

    def apply(self, index: int, delta: OutputDelta, now: float | None = None):
        if self._closed:
            return
        self.outputs[index].apply(delta, now)
        self._changed.add(index)
        if delta.finished:
            self._finished.add(index)
        self._event.set()

    def fail(self, message: str):
        if not self._closed:
            self._error = message
            self._event.set()

    async def updates(self):
        """Yield the indices of the choices that changed since the last yield, in order, until every choice has
        finished (``outputs`` holds them)."""
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise EngineStepError(self._error)
            changed, self._changed = sorted(self._changed), set()
            if changed:
                yield changed
            if self.done:
                return

    async def results(self) -> list[ChoiceOutput]:
        """Wait for every choice to finish; their outputs, in choice order."""
        async for _ in self.updates():
            pass
        return self.outputs

    def close(self):
        """Abort what is still running and give the capacity back; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self, [rid for i, rid in enumerate(self.request_ids) if i not in self._finished])
