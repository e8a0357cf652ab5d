"""What completions and chat share (vLLM's ``serving_engine``): a request's id, its SamplingParams (the server's
sampling defaults under what the client set), submitting its choices to the engine (which validates them: the
server checks no prompt or budget itself, beyond the prompt's characters), collecting their outputs or streaming
them as server-sent events, usage.

Each route adds its own wire format: a `RequestView` (how a request's choices read) and a `ChoiceStream` (how one
choice streams), in ``serving_completion`` and ``serving_chat``.
"""

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from zipage_jax.engine.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestRefused
from zipage_jax.engine.messages import Accepted, NewRequest, Refused, field_of
from zipage_jax.engine.request_group import ChoiceOutput, EngineStepError, RequestGroup
from zipage_jax.entrypoints import logprob_formats, structured_requests
from zipage_jax.entrypoints.protocol import APIError
from zipage_jax.entrypoints.tokenizing import Tokenizing
from zipage_jax.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

CLIENT_GONE_STATUS = 499  # nobody reads it; keeps the access log honest


def stable_text_len(text: str, stops: tuple[str, ...]) -> int:
    """How much of a still-running choice's text can be sent without a later token retracting it.

    Holds back a trailing U+FFFD (an incomplete UTF-8 sequence) and the longest suffix that begins a stop
    string: if the stop string completes, the engine drops it from the text.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), hold, -1):
            if text.endswith(stop[:k], 0, end):
                hold = k
                break
    return end - hold


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class EventStream(StreamingResponse):
    """An SSE response that always closes its request group, even if it is cancelled before it starts."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """What every route shares of the server's options. ``model_names``: the ids a request may name (the first is
    the one responses carry); ``sampling_defaults``: SamplingParams fields for what a request leaves unset (the
    model's generation config, ``sampling_defaults``); ``max_logprobs``: the most logprobs a request may ask;
    ``reasoning_end``: where a constraint starts (``</think>`` with a reasoning parser: after the thinking, as vLLM's
    structured outputs do on every route)."""

    model_names: tuple[str, ...]
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    log_requests: bool = False
    max_log_len: int | None = None
    reasoning_end: str | None = None


class RequestView:
    """How one request's choices read on the wire. ``accepted``: what the engine queued of each prompt (each has
    ``n`` choices)."""

    def __init__(self, serving: "OpenAIServing", body, accepted: list[Accepted]):
        self.serving, self.body, self.accepted = serving, body, accepted
        self.labels = logprob_formats.TokenLabels(serving.token_text, body.return_tokens_as_token_ids)

    def prompt_tokens(self, index: int | None = None) -> int:
        """Of choice ``index``'s prompt (after truncation), or of every prompt."""
        if index is None:
            return sum(a.num_prompt_tokens for a in self.accepted)
        return self.accepted[index // self.body.n].num_prompt_tokens

    def completion_tokens(self, output: ChoiceOutput) -> int:
        return 0 if self.body.echo_only else output.num_tokens

    def choice(self, index: int, output: ChoiceOutput) -> dict:
        raise NotImplementedError

    def stream(self, index: int) -> "ChoiceStream":
        raise NotImplementedError

    def extras(self, outputs: list[ChoiceOutput]) -> dict:
        """What a response carries beside its choices."""
        return {}


class ChoiceStream:
    """The chunks of one streamed choice: text sent only once no later token can take it back (a stop string,
    or what a route adds in ``sendable``, may still complete), each token with the chunk that first covers it."""

    def __init__(self, view: RequestView, index: int, holds: tuple[str, ...], echo: bool):
        self.view, self.index, self.holds = view, index, holds
        self.echo = echo  # the first chunk carries what echo adds, even without text of its own
        self.sent_chars = 0

    def opening(self) -> dict | None:
        """A chunk sent before any output (chat: the role)."""
        return None

    def sendable(self, text: str, end: int) -> int:
        """How much of ``text`` (stable up to ``end``) a running choice may send."""
        return end

    def content(self, output: ChoiceOutput, piece: str, token_ids: list[int], logprobs: list) -> dict:
        """The chunk's own fields for the new text ``piece`` and the new tokens (and, if ``echo``, what echo
        adds)."""
        raise NotImplementedError

    def chunk(self, output: ChoiceOutput) -> dict | None:
        """The next chunk of ``output``, or None while it has nothing to send."""
        finish = output.finish_reason
        text = "" if self.view.body.echo_only else output.text
        end = len(text) if finish else self.sendable(text, stable_text_len(text, self.holds))
        if end <= self.sent_chars and finish is None and not self.echo:
            return None
        piece = text[self.sent_chars:end]
        self.sent_chars = max(end, self.sent_chars)
        token_ids, logprobs = output.take_tokens()
        if self.view.body.echo_only:
            token_ids, logprobs = [], []
        content = self.content(output, piece, token_ids, logprobs or [])
        self.echo = False
        return {"index": self.index, **content, "finish_reason": finish, "stop_reason": output.stop_reason}


class OpenAIServing:
    """One route's request handling, from its body to its response. Subclasses name the route's objects."""

    id_prefix: str
    object: str
    chunk_object: str
    prompt_field: str  # the body field a prompt error names

    def __init__(self, async_engine: AsyncEngine, tokenizing: Tokenizing, settings: ServingSettings):
        self.async_engine, self.tokenizing, self.settings = async_engine, tokenizing, settings
        self.model_name = settings.model_names[0]
        self.token_text = tokenizing.token_text  # one token's text, memoized (logprobs' labels)

    def check_model(self, model: str | None):
        """A request may leave ``model`` out (vLLM), or name any served name."""
        if model is not None and model not in self.settings.model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def start(self, body) -> str:
        """A new request's id, once its model is known and it asks for nothing this server cannot do; the fields
        it ignores are named in one warning (vLLM ignores unknown fields too)."""
        self.check_model(body.model)
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        ignored = body.check()
        for field, width in body.logprob_widths().items():
            if width is not None and width > self.settings.max_logprobs:
                raise APIError(400, f"{field}: {width} exceeds this server's --max-logprobs of "
                                    f"{self.settings.max_logprobs}", param=field)
        if ignored:
            log.warning("%s: ignored fields this server does not use: %s", request_id, ", ".join(ignored))
        return request_id

    async def constraints(self, body, found: list[structured_requests.Constraint], reasoning_end: str | None) -> dict:
        """The SamplingParams fields of ``body``'s constraint (``found``, compiled off the event loop: a schema may be
        large; starting after ``reasoning_end``) and of its ``logit_bias``; a 400 naming the field for a bad one,
        before anything is queued."""
        extra = {}
        bias = structured_requests.logit_bias(body)
        if bias:
            extra["logit_bias"] = bias
        if found:
            extra["structured_outputs"] = await self.tokenizing.run(
                structured_requests.compile_constraint, structured_requests.with_whitespace(found, body), reasoning_end)
        return extra

    def sampling_params(self, body, max_tokens: int | None, choice: int, extra: dict | None = None) -> SamplingParams:
        kwargs = dict(self.settings.sampling_defaults, **body.sampling_kwargs(), max_tokens=max_tokens,
                      logprobs=body.logprobs_width, prompt_logprobs=body.prompt_logprobs_width, **(extra or {}))
        if body.seed is not None:
            kwargs["seed"] = body.seed + choice  # distinct but reproducible choices, like LLM.generate
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param=field_of(exc)) from exc

    async def submit(self, request_id: str, body, prompts: list[list[int]], arrival: float,
                     extra: dict | None = None) -> RequestGroup:
        """Queue ``n`` choices per prompt, all or none (``RequestGroup.accepted``: what the engine queued of each,
        truncated where ``truncate_prompt_tokens`` asks). ``max_tokens`` goes as the client asked it (or as the
        sampling defaults say, where it asked none): the engine fits it to the context or refuses the request, a
        refusal this answers with a 400. ``arrival``: when the request came (``time.monotonic()``); ``extra``:
        SamplingParams fields the route decided (``constraints``)."""
        max_tokens = body.max_output_tokens
        if max_tokens is None:
            max_tokens = self.settings.sampling_defaults.get("max_tokens")
        max_tokens = 1 if body.echo_only else max_tokens
        params = [self.sampling_params(body, max_tokens, j, extra) for j in range(body.n)]
        requests = [NewRequest(f"{request_id}-{p * body.n + j}", ids, params[j])
                    for p, ids in enumerate(prompts) for j in range(body.n)]
        if len(requests) > self.async_engine.capacity:
            raise APIError(400, f"n: {len(requests)} choices exceed this server's capacity of "
                                f"{self.async_engine.capacity}", param="n")
        if self.settings.log_requests:
            self.log_request(request_id, prompts, params[0])
        try:
            group = await self.async_engine.submit(requests, arrival)
        except QueueFullError as exc:
            raise APIError(429, f"Too many requests: {exc}.", type="rate_limit_error", code="queue_full") from exc
        except EngineUnavailableError as exc:
            raise APIError(503, f"Service unavailable: {exc}.", type="service_unavailable") from exc
        except RequestRefused as exc:
            raise self.refusal(exc.refused) from exc
        return group

    def log_request(self, request_id: str, prompts: list[list[int]], params: SamplingParams):
        """--enable-log-requests: one line per request (its prompts' tokens up to --max-log-len)."""
        shown = [ids[:self.settings.max_log_len] if self.settings.max_log_len is not None else ids for ids in prompts]
        log.info("Received request %s: %d prompt(s) of %s tokens, params: %s, prompt_token_ids: %s", request_id,
                 len(prompts), [len(ids) for ids in prompts], params, shown)

    def refusal(self, refused: Refused) -> APIError:
        """The engine's refusal as a 400 naming the field (a context overflow in vLLM's words and code)."""
        param = self.prompt_field if refused.field == "prompt" else refused.field
        if refused.over_context:
            return APIError(400, refused.reason, param=param, code="context_length_exceeded")
        return APIError(400, refused.message, param=param)

    async def respond(self, request_id: str, view: RequestView, group: RequestGroup, request: Request):
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if view.body.stream:
            def on_close():
                if not group.done and not group.failed:
                    self.async_engine.record_client_abort()
                group.close()

            return EventStream(self.stream(view, head, group), on_close)
        outputs = await self.collect(group, request)
        if outputs is None:
            return JSONResponse(APIError(CLIENT_GONE_STATUS, "client disconnected").body(), CLIENT_GONE_STATUS)
        choices = [view.choice(i, out) for i, out in enumerate(outputs)]
        return {**head, "object": self.object, "choices": choices,
                "usage": usage(view.prompt_tokens(), sum(view.completion_tokens(out) for out in outputs)),
                **view.extras(outputs)}

    async def collect(self, group: RequestGroup, request: Request) -> list[ChoiceOutput] | None:
        """All final outputs, or None if the client disconnected first (its choices are then aborted)."""
        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        results = asyncio.ensure_future(group.results())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            gone = not results.done()
            if gone:  # cancel() only schedules the cancellation: the task is not done yet, so never read it
                results.cancel()
                self.async_engine.record_client_abort()
            group.close()
        if gone:
            return None
        try:
            return results.result()
        except EngineStepError as exc:
            raise APIError(500, str(exc), type="internal_error", code="engine_error") from exc

    async def stream(self, view: RequestView, head: dict, group: RequestGroup):
        body = view.body
        extra = {"usage": None} if body.include_usage else {}

        def chunk(choices: list[dict], usage_now: dict | None = None) -> str:
            payload = {**head, "object": self.chunk_object, "choices": choices, **extra}
            if usage_now is not None:
                payload["usage"] = usage_now
            return sse(payload)

        def sent_tokens(index: int) -> int:
            return 0 if body.echo_only else group.outputs[index].num_taken

        def choice_usage(index: int) -> dict | None:
            return usage(view.prompt_tokens(index), sent_tokens(index)) if body.continuous_usage else None

        streams = [view.stream(i) for i in range(len(group.request_ids))]
        for s in streams:
            opening = s.opening()
            if opening is not None:
                yield chunk([opening], choice_usage(s.index))
        try:
            async for changed in group.updates():
                for index in changed:
                    delta = streams[index].chunk(group.outputs[index])
                    if delta is not None:
                        yield chunk([delta], choice_usage(index))
            if body.include_usage:
                yield chunk([], usage(view.prompt_tokens(), sum(map(sent_tokens, range(len(streams))))))
        except EngineStepError as exc:
            yield sse(APIError(500, str(exc), type="internal_error", code="engine_error").body())
        yield sse("[DONE]")
