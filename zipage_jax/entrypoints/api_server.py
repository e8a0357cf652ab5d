"""OpenAI-compatible HTTP server over one `LLMEngine`: `python -m zipage_jax.serve --help`.

Completions and chat completions (streamed as server-sent events or not), models, health, Prometheus metrics.
Every error, including validation, is a 4xx in OpenAI's `{"error": {...}}` shape; the engine runs on one
background thread (see `async_engine`), so requests from all clients are batched together.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections import Counter

import jinja2
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from zipage_jax.config import DEFAULT_MODEL, EngineConfig, add_engine_options, engine_kwargs, option_error
from zipage_jax.engine.async_engine import AsyncEngine, EngineStepError, EngineUnavailableError, QueueFullError
from zipage_jax.entrypoints import prometheus
from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
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
class _Service:
    """Request handling shared by the routes: tokenize, validate, submit, then stream or collect."""

    def __init__(self, engine, async_engine: AsyncEngine, model_name: str):
        self.async_engine = async_engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = getattr(engine, "max_model_len", None) or engine.config.max_model_len
        self.responses: Counter = Counter()

    def check_model(self, model: str):
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def encode(self, prompt: str | list[int]) -> list[int]:
        # Special tokens are not added: a chat template already places them, and `LLM.generate` does the same.
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt

    def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_message() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from exc
        return self.encode(text)

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

    def sampling_params(self, body, max_tokens: int, logprobs: bool, choice: int) -> SamplingParams:
        kwargs = dict(body.sampling_kwargs(), max_tokens=max_tokens, logprobs=True if logprobs else None)
        if body.seed is not None:
            kwargs["seed"] = body.seed + choice  # distinct but reproducible choices, like LLM.generate
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            word = str(exc).split(" ", 1)[0].rstrip(":")
            raise APIError(400, str(exc), param=word if word in kwargs else None) from exc

    async def submit(self, kind: "_Kind", request_id: str, body, prompts: list[list[int]], max_tokens,
                     logprobs: bool):
        requests = []
        for p, ids in enumerate(prompts):
            budget = self.completion_budget(len(ids), max_tokens, "messages" if kind.chat else "prompt")
            for j in range(body.n):
                requests.append((f"{request_id}-{p * body.n + j}", ids,
                                 self.sampling_params(body, budget, logprobs, j)))
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

    def token_logprobs(self, token_ids, logprobs) -> tuple[list[str], list[float]]:
        return [self.tokenizer.decode([t]) for t in token_ids], list(logprobs)

    def usage(self, prompts, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def respond(self, kind: "_Kind", body, prompts, max_tokens, logprobs: bool, request: Request):
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        group = await self.submit(kind, request_id, body, prompts, max_tokens, logprobs)
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            def on_close():
                if not group.done and not group.failed:
                    self.async_engine.record_client_abort()
                group.close()

            return _EventStream(self.stream(kind, head, group, body, prompts, logprobs), on_close)
        outputs = await self.collect(group, request)
        if outputs is None:
            return JSONResponse(APIError(CLIENT_GONE_STATUS, "client disconnected").body(), CLIENT_GONE_STATUS)
        choices = [kind.choice(self, i, out.outputs[0], logprobs) for i, out in enumerate(outputs)]
        usage = self.usage(prompts, sum(len(out.outputs[0].token_ids) for out in outputs))
        return {**head, "object": kind.object, "choices": choices, "usage": usage}

    async def stream(self, kind: "_Kind", head: dict, group, body, prompts, logprobs: bool):
        n = len(group.request_ids)
        stops = body.stop_strings
        sent_chars, sent_tokens = [0] * n, [0] * n
        extra = {"usage": None} if body.include_usage else {}

        def chunk(choices: list[dict]) -> str:
            return _sse({**head, "object": kind.chunk_object, "choices": choices, **extra})

        for i in range(n):
            opening = kind.opening(i)
            if opening is not None:
                yield chunk([opening])
        try:
            async for batch in group.updates():
                for index, out in sorted(batch.items()):
                    completion = out.outputs[0]
                    finish = completion.finish_reason
                    end = len(completion.text) if finish else stable_text_len(completion.text, stops)
                    if end <= sent_chars[index] and finish is None:
                        continue
                    delta = completion.text[sent_chars[index]:end]
                    new_ids = completion.token_ids[sent_tokens[index]:]
                    new_logprobs = (completion.logprobs[sent_tokens[index]:]
                                    if logprobs and completion.logprobs is not None else None)
                    sent_chars[index], sent_tokens[index] = max(end, sent_chars[index]), len(completion.token_ids)
                    yield chunk([kind.delta(self, index, delta, new_ids, new_logprobs, finish)])
            if body.include_usage:
                yield _sse({**head, "object": kind.chunk_object, "choices": [],
                            "usage": self.usage(prompts, sum(sent_tokens))})
        except EngineStepError as exc:
            yield _sse(APIError(500, str(exc), type="internal_error", code="engine_error").body())
        yield _sse("[DONE]")


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What differs between the completions and chat wire formats."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, svc: _Service, index: int, completion, logprobs: bool) -> dict:
        lp = self._logprobs(svc, completion.token_ids, completion.logprobs) if logprobs else None
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": completion.text},
                    "logprobs": lp, "finish_reason": completion.finish_reason}
        return {"index": index, "text": completion.text, "logprobs": lp, "finish_reason": completion.finish_reason}

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, svc: _Service, index: int, text: str, token_ids, logprobs, finish) -> dict:
        lp = self._logprobs(svc, token_ids, logprobs) if logprobs is not None else None
        if self.chat:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": lp,
                    "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def _logprobs(self, svc: _Service, token_ids, logprobs) -> dict:
        tokens, values = svc.token_logprobs(token_ids, logprobs or [])
        if self.chat:
            # A token that is part of a multi-byte character has no text of its own: its bytes are unknown here.
            return {"content": [{"token": t, "logprob": v, "top_logprobs": [],
                                 "bytes": None if "\ufffd" in t else list(t.encode())}
                                for t, v in zip(tokens, values)]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


COMPLETION = _Kind("cmpl", "text_completion", "text_completion", chat=False)
CHAT = _Kind("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


# -- the app ----------------------------------------------------------------------------------------------------
def create_app(engine, *, api_key: str | None = None, max_queued_requests: int = 256,
               served_model_name: str | None = None, warmup: bool = False) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine loop thread and, on shutdown, aborts and joins it.

    With ``warmup`` the loop thread first compiles the engine's programs while the server already answers:
    ``/health`` says 503 ``starting`` (with progress) and requests get a 503 until it is done."""
    async_engine = AsyncEngine(engine, max_queued_requests=max_queued_requests, warmup=warmup)
    svc = _Service(engine, async_engine, served_model_name or engine.model_name)

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
        svc.check_model(body.model)
        prompts = [svc.encode(p) for p in body.prompt_batch()]
        return await svc.respond(COMPLETION, body, prompts, body.max_tokens, body.logprobs is not None, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        svc.check_model(body.model)
        prompts = [svc.render_chat(body)]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await svc.respond(CHAT, body, prompts, max_tokens, body.logprobs, request)

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
    from zipage_jax.engine.llm_engine import LLMEngine  # imported late so --help needs no accelerator runtime

    try:
        engine = LLMEngine.from_kwargs(args.model, **options)
    except ValueError as e:  # what only the model and the device tell: its context, the memory plan, a Hub id
        option_error(parser, e)
    app = create_app(engine, api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                     served_model_name=args.served_model_name, warmup=args.warmup)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn passes it on once it has shut down
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    if engine.runner.programs.compiling_unused:  # a warm-up the shutdown stopped: do not wait for its compiles
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
