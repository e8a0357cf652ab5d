"""OpenAI-compatible HTTP server over one `LLMEngine`: `python -m zipage_jax.serve --help`.

Completions and chat completions (streamed as server-sent events or not), models, health, Prometheus metrics.
The request surface is vLLM's (`protocol`): logprobs in OpenAI's formats (`logprob_formats`), echo, prompt
logprobs, continuous usage in streams, reasoning parsers (`reasoning`). Every error, including validation, is a
4xx in OpenAI's `{"error": {...}}` shape. One engine loop batches the requests of all clients; `serve` runs it in
a process of its own (`engine.core_client`), so HTTP, JSON and SSE here never hold the GIL it needs. This module
is the app (routes, lifespan, errors) and `main`; each route's handling is ``serving_completion`` /
``serving_chat`` over ``serving_engine``, the command line ``cli_args``.
"""

import contextlib
import logging
import secrets
from collections import Counter

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from zipage_jax.config import EngineConfig, engine_kwargs, option_error
from zipage_jax.engine.async_engine import AsyncEngine
from zipage_jax.engine.core_client import exit_if_compiling
from zipage_jax.entrypoints import prometheus
from zipage_jax.entrypoints.cli_args import build_parser
from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from zipage_jax.entrypoints.reasoning import ReasoningParser
from zipage_jax.entrypoints.serving_chat import OpenAIServingChat
from zipage_jax.entrypoints.serving_completion import OpenAIServingCompletion

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json"}


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
    core = async_engine.core
    model_name = served_model_name or core.info.model_name
    completion = OpenAIServingCompletion(async_engine, core.tokenizer, model_name)
    chat = OpenAIServingChat(async_engine, core.tokenizer, model_name, reasoning)
    responses: Counter = Counter()  # (endpoint, HTTP status) -> count

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
        return await completion.create(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "zipage_jax",
                "max_model_len": core.info.max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        completion.check_model(model_id)
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
                                 capacity=async_engine.capacity, responses=responses,
                                 client_aborts=async_engine.client_aborts, rejected=async_engine.rejected,
                                 step_failures=async_engine.step_failures)
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)

    app.add_middleware(_CountResponses, counts=responses, endpoints=ENDPOINTS)
    return app


def _bearer_check(api_key: str):
    scheme = HTTPBearer(auto_error=False, description="The server's --api-key.")
    expected = api_key.encode()

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)):
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected):
            raise APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    return check


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
