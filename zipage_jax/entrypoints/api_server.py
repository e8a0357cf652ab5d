"""OpenAI-compatible HTTP server over one `LLMEngine`: `python -m zipage_jax.serve --help`.

Completions and chat completions (streamed as server-sent events or not), models, health, Prometheus metrics.
The request surface is vLLM's (`protocol`): logprobs in OpenAI's formats (`logprob_formats`), echo, prompt
logprobs, continuous usage in streams, reasoning parsers (`reasoning`). Every error, including validation, is a
4xx in OpenAI's `{"error": {...}}` shape. One engine loop batches the requests of all clients; `serve` runs it in
a process of its own (`engine.core_client`), so HTTP, JSON and SSE here never hold the GIL it needs.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from collections import Counter

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from zipage_jax.config import DEFAULT_MODEL, EngineConfig, add_engine_options, engine_kwargs, option_error
from zipage_jax.engine.async_engine import AsyncEngine, EngineStepError, EngineUnavailableError, QueueFullError
from zipage_jax.engine.core_client import exit_if_compiling
from zipage_jax.entrypoints import logprob_formats, prometheus
from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from zipage_jax.entrypoints.reasoning import PARSERS, ReasoningParser
from zipage_jax.sampling_params import SamplingParams, completion_budget

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json"}
CLIENT_GONE_STATUS = 499  # nobody reads it; keeps the access log honest

# -- streaming text ---------------------------------------------------------------------------------------------
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


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that always closes its request group, even if it is cancelled before it starts."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _CountResponses:
    """ASGI middleware counting responses by endpoint and status (pure ASGI: streaming and cancellation pass)."""

    def __init__(self, app, counts: Counter, endpoints: set[str]):
        self.app, self.counts, self.endpoints = app, counts, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.endpoints else (
            "/v1/models/{model}" if path.startswith("/v1/models/") else "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts[(endpoint, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


# -- the service ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    # What echo returns: the prompt as sent, a chat prompt's rendered template (reasoning parsers read its end);
    # None for token ids and truncated prompts, decoded when needed (the engine validates the ids first).
    text: str | None


class _Service:
    """Request handling shared by the routes: tokenize, validate, submit, then stream or collect."""

    def __init__(self, engine, async_engine: AsyncEngine, model_name: str, reasoning: ReasoningParser | None):
        self.async_engine = async_engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.reasoning = reasoning
        self.max_model_len = engine.max_model_len
        self.responses: Counter = Counter()
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: self.tokenizer.decode([token]))

    def check_model(self, model: str):
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def start(self, kind: "_Kind", body) -> str:
        """A new request's id, once its model is known and it asks for nothing this server cannot do; the fields
        it ignores are named in one warning (vLLM ignores unknown fields too)."""
        self.check_model(body.model)
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        ignored = body.check()
        if ignored:
            log.warning("%s: ignored fields this server does not use: %s", request_id, ", ".join(ignored))
        return request_id

    def encode(self, prompt: str | list[int], add_special_tokens: bool = False, keep: int | None = None) -> _Prompt:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids, prompt = list(prompt), None
        if keep is not None and len(ids) > keep:  # truncate_prompt_tokens: the last tokens stay
            ids, prompt = ids[-keep:], None
        return _Prompt(ids, prompt)

    def render_chat(self, body: ChatCompletionRequest) -> _Prompt:
        messages = [m.as_template_message() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {}, add_generation_prompt=body.add_generation_prompt,
                      continue_final_message=body.continue_final_message, tokenize=False)
        if body.documents is not None:
            kwargs["documents"] = body.documents
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
            if not isinstance(text, str):
                raise TypeError("chat_template_kwargs: the template did not render text")
        except Exception as exc:  # the template runs on the client's input: whatever it raises is a bad request
            raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from exc
        # Special tokens are not added by default: the chat template places them, as vLLM does.
        return _Prompt(self.encode(text, body.add_special_tokens, body.truncate_prompt_tokens).ids, text)

    def completion_budget(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """max_tokens for a prompt (default: the rest of the context); too long a request is a 400 naming the
        prompt or max_tokens (vLLM's server rule: ``sampling_params.completion_budget``)."""
        if prompt_len == 0:
            raise APIError(400, f"{param}: must not be empty", param=param)
        try:
            return completion_budget(prompt_len, max_tokens, self.max_model_len, reject=True)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise APIError(400, message, param=param if field == "prompt" else field,
                           code="context_length_exceeded") from exc

    def sampling_params(self, body, max_tokens: int, choice: int) -> SamplingParams:
        kwargs = dict(body.sampling_kwargs(), max_tokens=max_tokens, logprobs=body.logprobs_width,
                      prompt_logprobs=body.prompt_logprobs_width)
        if body.seed is not None:
            kwargs["seed"] = body.seed + choice  # distinct but reproducible choices, like LLM.generate
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            word = str(exc).split(" ", 1)[0].rstrip(":")
            raise APIError(400, str(exc), param=word if word in kwargs else None) from exc

    async def submit(self, kind: "_Kind", request_id: str, body, prompts: list[_Prompt]):
        requests = []
        max_tokens = 1 if body.echo_only else body.max_output_tokens
        for p, prompt in enumerate(prompts):
            budget = self.completion_budget(len(prompt.ids), max_tokens, "messages" if kind.chat else "prompt")
            for j in range(body.n):
                requests.append((f"{request_id}-{p * body.n + j}", prompt.ids,
                                 self.sampling_params(body, budget, j)))
        if len(requests) > self.async_engine.capacity:
            raise APIError(400, f"n: {len(requests)} choices exceed this server's capacity of "
                                f"{self.async_engine.capacity}", param="n")
        try:
            return await self.async_engine.submit(requests)
        except QueueFullError as exc:
            raise APIError(429, f"Too many requests: {exc}.", type="rate_limit_error", code="queue_full") from exc
        except EngineUnavailableError as exc:
            raise APIError(503, f"Service unavailable: {exc}.", type="service_unavailable") from exc
        except ValueError as exc:  # the engine refused the prompt or the parameters
            word = str(exc).split(":", 1)[0]
            raise APIError(400, str(exc), param=word if word.isidentifier() else None) from exc

    async def collect(self, group, request: Request) -> list:
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

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def respond(self, kind: "_Kind", request_id: str, body, prompts: list[_Prompt], request: Request):
        group = await self.submit(kind, request_id, body, prompts)
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        view = _View(self, kind, body, prompts)
        if body.stream:
            def on_close():
                if not group.done and not group.failed:
                    self.async_engine.record_client_abort()
                group.close()

            return _EventStream(self.stream(view, head, group), on_close)
        outputs = await self.collect(group, request)
        if outputs is None:
            return JSONResponse(APIError(CLIENT_GONE_STATUS, "client disconnected").body(), CLIENT_GONE_STATUS)
        choices = [view.choice(i, out) for i, out in enumerate(outputs)]
        completion_tokens = sum(view.completion_tokens(out) for out in outputs)
        response = {**head, "object": kind.object, "choices": choices,
                    "usage": self.usage(sum(len(p.ids) for p in prompts), completion_tokens)}
        if kind.chat and body.prompt_logprobs is not None:  # vLLM: chat puts them beside the choices
            response["prompt_logprobs"] = logprob_formats.prompt_logprobs(outputs[0].prompt_logprobs)
        return response

    async def stream(self, view: "_View", head: dict, group):
        body, kind = view.body, view.kind
        extra = {"usage": None} if body.include_usage else {}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            payload = {**head, "object": kind.chunk_object, "choices": choices, **extra}
            if usage is not None:
                payload["usage"] = usage
            return _sse(payload)

        streams = [view.choice_stream(i) for i in range(len(group.request_ids))]
        for s in streams:
            opening = s.opening()
            if opening is not None:
                yield chunk([opening], s.usage() if body.continuous_usage else None)
        try:
            async for batch in group.updates():
                for index, out in sorted(batch.items()):
                    s = streams[index]
                    delta = s.delta(out)
                    if delta is not None:
                        yield chunk([delta], s.usage() if body.continuous_usage else None)
            if body.include_usage:
                yield chunk([], self.usage(sum(len(p.ids) for p in view.prompts),
                                           sum(s.sent_tokens for s in streams)))
        except EngineStepError as exc:
            yield _sse(APIError(500, str(exc), type="internal_error", code="engine_error").body())
        yield _sse("[DONE]")


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What differs between the completions and chat wire formats (names)."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETION = _Kind("cmpl", "text_completion", "text_completion", chat=False)
CHAT = _Kind("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


class _View:
    """How one request's engine outputs read on the wire: echo, logprobs, reasoning, usage."""

    def __init__(self, svc: _Service, kind: _Kind, body, prompts: list[_Prompt]):
        self.svc, self.kind, self.body, self.prompts = svc, kind, body, prompts
        self.labels = logprob_formats.TokenLabels(svc.token_text, body.return_tokens_as_token_ids)
        self.reasoning = svc.reasoning if kind.chat else None

    def prompt(self, index: int) -> _Prompt:
        return self.prompts[index // self.body.n]

    def completion_tokens(self, out) -> int:
        return 0 if self.body.echo_only else len(out.outputs[0].token_ids)

    def echo_prefix(self) -> str:
        """Chat echo (vLLM): the last message's content, when the reply continues that role."""
        last = self.body.messages[-1]
        return last.text if self.body.echo and last.role == self.body.reply_role else ""

    def logprobs(self, token_ids, entries, text_offset: int = 0) -> dict | None:
        body = self.body
        if self.kind.chat:
            return logprob_formats.chat_logprobs(token_ids, entries, body.top_logprobs or 0, self.labels) \
                if body.logprobs else None
        if body.logprobs is None:
            return None
        return logprob_formats.completion_logprobs(token_ids, entries, body.logprobs, self.labels, text_offset)

    def echoed(self, index: int, out) -> tuple[str, list[int], list]:
        """What echo puts before a completion: the prompt's text, ids and logprobs (null where not computed)."""
        prompt = self.prompt(index)
        if prompt.text is None:
            prompt.text = self.svc.tokenizer.decode(prompt.ids)
        entries = out.prompt_logprobs or [None] * len(prompt.ids)
        return prompt.text, list(prompt.ids), list(entries)

    def message(self, text: str, opened: bool) -> dict:
        message = {"role": self.body.reply_role, "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, opened)
            message["content"] = content
            message["reasoning_content"] = reasoning if self.body.include_reasoning else None
        prefix = self.echo_prefix()
        if prefix:
            message["content"] = prefix + (message["content"] or "")
        return message

    def choice(self, index: int, out) -> dict:
        c = out.outputs[0]
        text, token_ids, entries = ("", [], []) if self.body.echo_only else (c.text, c.token_ids, c.logprobs or [])
        choice = {"index": index}
        if self.kind.chat:
            opened = self.reasoning is not None and self.reasoning.opens_thinking(self.prompt(index).text)
            choice["message"] = self.message(text, opened)
        else:
            if self.body.echo:
                prompt_text, prompt_ids, prompt_entries = self.echoed(index, out)
                text, token_ids, entries = prompt_text + text, prompt_ids + token_ids, prompt_entries + entries
            choice["text"] = text
        choice.update(logprobs=self.logprobs(token_ids, entries), finish_reason=c.finish_reason,
                      stop_reason=c.stop_reason)
        if not self.kind.chat and self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = logprob_formats.prompt_logprobs(out.prompt_logprobs)
        return choice

    def choice_stream(self, index: int) -> "_ChoiceStream":
        return _ChoiceStream(self, index)


class _ChoiceStream:
    """The chunks of one streamed choice: text sent only once no later token can take it back (a stop string
    or a reasoning tag may still complete), each token's logprobs with the chunk that first covers it."""

    def __init__(self, view: _View, index: int):
        self.view, self.index = view, index
        self.sent_chars = self.sent_tokens = self.text_offset = 0
        self.started = False
        holds = view.body.stop_strings
        self.opened = False
        if view.reasoning is not None:
            holds += view.reasoning.tags
            self.opened = view.reasoning.opens_thinking(view.prompt(index).text)
        self.holds = holds
        self.sent_parts = [0, 0]  # reasoning, content characters sent

    def usage(self) -> dict:
        return _Service.usage(len(self.view.prompt(self.index).ids), self.sent_tokens)

    def opening(self) -> dict | None:
        if not self.view.kind.chat:
            return None
        return {"index": self.index, "delta": {"role": self.view.body.reply_role, "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, out) -> dict | None:
        view, c = self.view, out.outputs[0]
        finish = c.finish_reason
        text, token_ids, entries = ("", [], []) if view.body.echo_only else (c.text, c.token_ids, c.logprobs)
        end = len(text) if finish else stable_text_len(text, self.holds)
        if view.reasoning is not None and not finish and not view.reasoning.decided(text[:end]):
            end = 0
        # the first chunk of a choice carries what echo adds: the prompt (completions), the last message (chat)
        echo = not self.started and view.body.echo and (not view.kind.chat or view.echo_prefix())
        if end <= self.sent_chars and finish is None and not echo:
            return None
        self.started = True
        piece = text[self.sent_chars:end]
        new_ids = list(token_ids[self.sent_tokens:])
        new_entries = list(entries[self.sent_tokens:]) if entries is not None else []
        self.sent_chars, self.sent_tokens = max(end, self.sent_chars), len(token_ids)
        if echo and not view.kind.chat:
            prompt_text, prompt_ids, prompt_entries = view.echoed(self.index, out)
            piece, new_ids, new_entries = prompt_text + piece, prompt_ids + new_ids, prompt_entries + new_entries
        lp = view.logprobs(new_ids, new_entries, self.text_offset)
        self.text_offset += len(piece)
        if not view.kind.chat:
            return {"index": self.index, "text": piece, "logprobs": lp, "finish_reason": finish,
                    "stop_reason": c.stop_reason}
        delta = self.chat_delta(text[:self.sent_chars], piece, view.echo_prefix() if echo else "")
        return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def chat_delta(self, sent_text: str, piece: str, prefix: str) -> dict:
        view = self.view
        if view.reasoning is None:
            return {"content": prefix + piece} if prefix + piece else {}
        parts = view.reasoning.split(sent_text, self.opened)
        delta = {}
        for i, (name, part) in enumerate(zip(("reasoning_content", "content"), parts)):
            new = (part or "")[self.sent_parts[i]:]
            self.sent_parts[i] += len(new)
            if new and (name == "content" or view.body.include_reasoning):
                delta[name] = new
        if prefix:
            delta["content"] = prefix + delta.get("content", "")
        return delta


# -- the app ----------------------------------------------------------------------------------------------------
def create_app(engine, *, api_key: str | None = None, max_queued_requests: int = 256,
               served_model_name: str | None = None, warmup: bool = False, ready_early: bool = False,
               reasoning_parser: str | None = None) -> FastAPI:
    """The ASGI app over ``engine``: an `LLMEngine` (its loop then runs on a thread of this process) or a launched
    ``core_client.ProcessCore``. Its lifespan starts the engine loop and, on shutdown, aborts what runs and waits
    for the loop to end.

    With ``warmup`` the loop thread first compiles the engine's programs while the server already answers:
    ``/health`` says 503 ``starting`` (with progress) and requests get a 503 until it is done; with
    ``ready_early`` until a light load's programs are, the rest compiling in the background. With
    ``reasoning_parser`` (``reasoning.PARSERS``) chat replies split their thinking into ``reasoning_content``."""
    reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
    async_engine = AsyncEngine(engine, max_queued_requests=max_queued_requests, warmup=warmup,
                               ready_early=ready_early)
    svc = _Service(async_engine.core, async_engine, served_model_name or engine.model_name, reasoning)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="zipage_jax", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat over a Compressed PagedAttention engine.")
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(APIError(500, "internal server error", type="internal_error").body(), status_code=500)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer_check(api_key))] if api_key else [])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        request_id = svc.start(COMPLETION, body)
        prompts = [svc.encode(p, body.add_special_tokens, body.truncate_prompt_tokens) for p in body.prompt_batch()]
        return await svc.respond(COMPLETION, request_id, body, prompts, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        request_id = svc.start(CHAT, body)
        return await svc.respond(CHAT, request_id, body, [svc.render_chat(body)], request)

    def model_card() -> dict:
        return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "zipage_jax",
                "max_model_len": svc.max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        svc.check_model(model_id)
        return model_card()

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            raise APIError(503, "the engine loop is not running", type="service_unavailable")
        if not async_engine.ready:
            return JSONResponse({"status": "starting", "detail": async_engine.startup}, status_code=503)
        if async_engine.metrics.get("compiling_in_background"):
            return {"status": "ok", "detail": "serving; the programs of larger batches compile in the background"}
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        text = prometheus.render(async_engine.metrics, in_flight=async_engine.in_flight,
                                 capacity=async_engine.capacity, responses=svc.responses,
                                 client_aborts=async_engine.client_aborts, rejected=async_engine.rejected,
                                 step_failures=async_engine.step_failures)
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)

    app.add_middleware(_CountResponses, counts=svc.responses, endpoints=ENDPOINTS)
    return app


def _bearer_check(api_key: str):
    scheme = HTTPBearer(auto_error=False, description="The server's --api-key.")
    expected = api_key.encode()

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)):
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected):
            raise APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    return check


# -- command line -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.serve", description="Serve one model over an OpenAI-compatible HTTP API (completions, chat, "
                                                 "models, health, Prometheus metrics).")
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=DEFAULT_MODEL, help="model directory (HF layout) or Hugging Face Hub id "
                                                               "(default: the shipped tiny-reasoner)")
    server.add_argument("--served-model-name", default=None,
                        help="model id clients send (default: the model directory's name, e.g. tiny-reasoner, or "
                             "the Hub id)")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    server.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* (default: "
                                                        "no authentication)")
    server.add_argument("--max-queued-requests", type=int, default=256,
                        help="choices that may wait beyond max_num_seqs; more are refused with 429 "
                             "(default: %(default)s)")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run on after a shutdown signal before they are "
                             "aborted (default: %(default)s)")
    server.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every shape bucket before serving requests; meanwhile /health answers 503 "
                             "'starting' (default: %(default)s)")
    server.add_argument("--ready-early", action=argparse.BooleanOptionalAction, default=True,
                        help="with --warmup, serve as soon as the programs of a light load are compiled (the "
                             "smallest batch and prompt-chunk buckets) and compile the rest in the background; "
                             "until then steps stay within the compiled buckets, so no request waits on a compile "
                             "(default: %(default)s)")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine loop in a process of its own, so that HTTP, JSON and SSE never hold "
                             "the GIL the loop needs to keep the device fed (default: %(default)s)")
    server.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                        help="split chat replies' <think>...</think> into reasoning_content, as vLLM does")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="(default: %(default)s)")
    parser.set_defaults(engine_fields=add_engine_options(parser))
    return parser


def main(argv: list[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_queued_requests < 0:
        parser.error("--max-queued-requests must be >= 0")
    if getattr(args, "num_processes", None) not in (None, 1):  # followers would have to mirror every step
        parser.error("--num-processes: the server drives one process; several processes serve offline batches "
                     "(README, Several GPUs and hosts)")
    options = engine_kwargs(args, args.engine_fields)
    try:
        EngineConfig.from_kwargs(args.model, **options)  # a bad option: one line and status 2, before any loading
    except ValueError as e:
        option_error(parser, e)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))  # its backend probing
    try:
        if args.engine_process:  # the engine is built in its process, jax's backend starts there
            from zipage_jax.engine.core_client import ProcessCore

            engine = ProcessCore.launch(args.model, options, warmup=args.warmup, log_level=args.log_level.upper(),
                                        ready_early=args.ready_early)
        else:
            from zipage_jax.engine.llm_engine import LLMEngine  # late: --help needs no accelerator runtime

            engine = LLMEngine.from_kwargs(args.model, **options)
    except ValueError as e:  # what only the model and the device tell: its context, the memory plan, a Hub id
        option_error(parser, e)
    except RuntimeError as e:  # the engine process failed to start
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    app = create_app(engine, api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                     served_model_name=args.served_model_name, warmup=args.warmup, ready_early=args.ready_early,
                     reasoning_parser=args.reasoning_parser)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn passes it on once it has shut down
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    if not args.engine_process:  # the engine process ends its own
        exit_if_compiling(engine)


if __name__ == "__main__":
    main()
