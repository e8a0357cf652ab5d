"""OpenAI-compatible HTTP server over one `LLMEngine`: `python -m zipage_jax.serve MODEL` (`zipage-jax serve`).

Completions and chat completions (streamed as server-sent events or not), models, vLLM's tokenizer endpoints,
health, version, Prometheus metrics. The request surface is vLLM's (`protocol`): logprobs in OpenAI's formats
(`logprob_formats`), echo, prompt logprobs, continuous usage in streams, reasoning parsers (`reasoning`), structured
outputs (`structured_requests`), tool calls (`tool_calls`, `tool_parsers`). Every
error, including validation, is a 4xx in OpenAI's `{"error": {...}}` shape. One engine loop batches the requests
of all clients; `serve` runs it in a process of its own (`engine.core_client`), so HTTP, JSON and SSE here never
hold the GIL it needs, and no request stalls the others: the HTTP guard (`http_guard`) bounds what a connection
may send and how slowly, tokenizing runs off the event loop (`tokenizing`). This module is the app (routes,
lifespan, errors) and `main`; each route's handling is ``serving_completion`` / ``serving_chat`` /
``serving_tokenization`` over ``serving_engine``, the command line ``cli_args``, the metrics ``prometheus``.
"""

import asyncio
import contextlib
import importlib.metadata
import logging
from collections import Counter

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from zipage_jax.config import EngineConfig, engine_kwargs, option_error
from zipage_jax.engine.async_engine import AsyncEngine
from zipage_jax.engine.core_client import exit_if_compiling
from zipage_jax.entrypoints.cli_args import PROG, parse_args
from zipage_jax.entrypoints.http_guard import RequestGuard, guarded_protocol
from zipage_jax.entrypoints.prometheus import ServerMetrics
from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from zipage_jax.entrypoints.reasoning import END, ReasoningParser
from zipage_jax.entrypoints.sampling_defaults import sampling_defaults
from zipage_jax.entrypoints.server_logging import log_stats, quiet_probes
from zipage_jax.entrypoints.serving_chat import OpenAIServingChat
from zipage_jax.entrypoints.serving_completion import OpenAIServingCompletion
from zipage_jax.entrypoints.serving_engine import ServingSettings
from zipage_jax.entrypoints.serving_tokenization import ServingTokenization
from zipage_jax.entrypoints.tokenizing import Tokenizing
from zipage_jax.entrypoints.tool_calls import ToolSettings
from zipage_jax.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
             "/health", "/ping", "/version", "/metrics", "/openapi.json"}
PROMPT_CHARS_PER_TOKEN = 32  # the default --max-prompt-chars per token of max_model_len: far above any text's
BODY_BYTES_PER_PROMPT_CHAR = 16  # the default --max-body-bytes: a batch of token-id prompts, or JSON's escapes


def version() -> str:
    try:
        return importlib.metadata.version("zipage_jax")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


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
               served_model_name: str | list[str] | None = None, warmup: bool = False, ready_early: bool = False,
               reasoning_parser: str | None = None, chat_template: str | None = None, generation_config: str = "auto",
               override_generation_config: dict | None = None, max_logprobs: int = MAX_LOGPROBS,
               max_prompt_chars: int | None = None, max_body_bytes: int | None = None, read_timeout: float = 30.0,
               log_requests: bool = False, max_log_len: int | None = None, log_stats_s: float | None = None,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None) -> FastAPI:
    """The ASGI app over ``engine``: an `LLMEngine` (its loop then runs on a thread of this process) or a launched
    ``core_client.ProcessCore``. Its lifespan starts the engine loop and, on shutdown, aborts what runs and waits
    for the loop to end. The options are the command line's (``cli_args``); a bad one is a ValueError naming it.

    With ``warmup`` the loop thread first compiles the engine's programs while the server already answers:
    ``/health`` says 503 ``starting`` (with progress) and requests get a 503 until it is done; with
    ``ready_early`` until a light load's programs are, the rest compiling in the background. With
    ``reasoning_parser`` (``reasoning.PARSERS``) chat replies split their thinking into ``reasoning_content``; with
    ``enable_auto_tool_choice`` and ``tool_call_parser`` (``tool_parsers.PARSERS``) ``tool_choice: auto`` is served.
    ``log_stats_s``: log the throughput line this often (None: never). Serve it with ``server_config``."""
    reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
    tool_settings = ToolSettings(enable_auto_tool_choice, tool_call_parser)
    async_engine = AsyncEngine(engine, max_queued_requests=max_queued_requests, warmup=warmup,
                               ready_early=ready_early)
    core, responses = async_engine.core, Counter()  # responses: (endpoint, HTTP status) -> count
    info = core.info
    names = tuple([served_model_name] if isinstance(served_model_name, str) else served_model_name or [info.model_name])
    max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * info.max_model_len
    settings = ServingSettings(names, sampling_defaults(generation_config, info.model_path, override_generation_config),
                               max_logprobs, log_requests, max_log_len, reasoning_end=END if reasoning else None)
    tokenizing = Tokenizing(core.tokenizer, max_prompt_chars, chat_template)
    completion = OpenAIServingCompletion(async_engine, tokenizing, settings)
    chat = OpenAIServingChat(async_engine, tokenizing, settings, reasoning, tool_settings)
    tokenization = ServingTokenization(tokenizing, info.max_model_len, completion.check_model)
    most_pages = -(-info.max_model_len // info.config.page_size) + 1  # a full context's, and one more
    metrics = ServerMetrics(names[0], info.max_model_len, most_pages,
                            lambda: (async_engine.metrics, server_counters(async_engine, responses)))
    async_engine.observer = metrics  # the request histograms move as outputs arrive

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async_engine.start()
        stats = asyncio.create_task(log_stats(lambda: async_engine.metrics, log_stats_s)) if log_stats_s else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await async_engine.stop()
            tokenizing.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="zipage_jax", version=version(), lifespan=lifespan,
                  description="OpenAI-compatible completions and chat over a Compressed PagedAttention engine.")
    app.state.async_engine, app.state.metrics, app.state.read_timeout = async_engine, metrics, read_timeout

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

    v1 = APIRouter(prefix="/v1")  # with --api-key, the guard checks the key before any body is read

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "zipage_jax", "root": names[0],
                "max_model_len": info.max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in names]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        completion.check_model(model_id)
        return model_card(model_id)

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: ``{"prompt"}`` or ``{"messages"}`` -> ``{count, max_model_len, tokens, token_strs}``."""
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: ``{"tokens"}`` -> ``{"prompt"}``."""
        return await tokenization.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return await tokenization.info()

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            raise APIError(503, "the engine loop is not running", type="service_unavailable")
        if not async_engine.ready:
            return JSONResponse({"status": "starting", "detail": async_engine.startup}, status_code=503)
        if async_engine.metrics.get("compiling_in_background"):
            return {"status": "ok", "detail": "serving; the programs of larger batches compile in the background"}
        return {"status": "ok"}

    @app.get("/ping")
    async def ping():
        """SageMaker's and vLLM's liveness probe (GET or POST): 200 when the server serves, else 503."""
        return Response(status_code=200 if async_engine.alive and async_engine.ready else 503)

    app.post("/ping", operation_id="ping_post")(ping)

    @app.get("/version")
    async def server_version():
        return {"version": version()}

    @app.get("/metrics")
    async def metrics_page(request: Request):
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    app.add_middleware(RequestGuard, api_key=api_key, read_timeout=read_timeout,
                       max_body_bytes=max_body_bytes or BODY_BYTES_PER_PROMPT_CHAR * max_prompt_chars)
    app.add_middleware(_CountResponses, counts=responses, endpoints=ENDPOINTS)
    return app


def server_counters(async_engine: AsyncEngine, responses: Counter) -> dict:
    return dict(requests_in_flight=async_engine.in_flight, request_capacity=async_engine.capacity,
                client_aborts=async_engine.client_aborts, rejected=async_engine.rejected,
                step_failures=async_engine.step_failures, responses=responses)


def server_config(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, keep_alive_s: float = 5.0,
                  log_level: str = "info", access_log: bool = True, shutdown_timeout: float | None = None,
                  **kwargs) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: its connections close when a request's headers do not arrive within
    the app's read timeout (``http_guard.guarded_protocol``), idle keep-alive ones after ``keep_alive_s``; probe
    polls stay out of the access log."""
    quiet_probes()
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(app.state.read_timeout),
                          timeout_keep_alive=keep_alive_s, log_level=log_level, access_log=access_log,
                          timeout_graceful_shutdown=shutdown_timeout, **kwargs)


def main(argv: list[str] | None = None, prog: str = PROG):
    parser, args = parse_args(argv, prog)
    options = engine_kwargs(args, args.engine_fields)
    model, names = args.model, args.served_model_name
    try:
        if args.revision or args.download_dir:  # the Hub snapshot is fetched here; the engine gets its directory
            from zipage_jax.models import hub

            model, names = hub.local_dir(args.model, revision=args.revision, cache_dir=args.download_dir), \
                names or [args.model]
        EngineConfig.from_kwargs(model, **options)  # a bad option: one line and status 2, before any loading
    except ValueError as e:
        option_error(parser, e)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))  # its backend probing
    for note in args.notes:
        log.info("%s", note)
    try:
        if args.engine_process:  # the engine is built in its process, jax's backend starts there
            from zipage_jax.engine.core_client import ProcessCore

            engine = ProcessCore.launch(model, options, warmup=args.warmup, log_level=args.log_level.upper(),
                                        ready_early=args.ready_early)
        else:
            from zipage_jax.engine.llm_engine import LLMEngine  # late: --help needs no accelerator runtime

            engine = LLMEngine.from_kwargs(model, **options)
        app = create_app(engine, api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                         served_model_name=names, warmup=args.warmup, ready_early=args.ready_early,
                         reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
                         generation_config=args.generation_config,
                         override_generation_config=args.override_generation_config, max_logprobs=args.max_logprobs,
                         max_prompt_chars=args.max_prompt_chars, max_body_bytes=args.max_body_bytes,
                         read_timeout=args.request_read_timeout, log_requests=args.enable_log_requests,
                         max_log_len=args.max_log_len, log_stats_s=None if args.disable_log_stats else 10.0,
                         enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser)
    except ValueError as e:  # what only the model and the device tell: its context, the memory plan, a Hub id
        option_error(parser, e)
    except RuntimeError as e:  # the engine process failed to start
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    config = server_config(app, host=args.host, port=args.port, keep_alive_s=args.timeout_keep_alive,
                           log_level=args.uvicorn_log_level or args.log_level,
                           access_log=not args.disable_uvicorn_access_log, shutdown_timeout=args.shutdown_timeout)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn passes it on once it has shut down
        uvicorn.Server(config).run()
    if not args.engine_process:  # the engine process ends its own
        exit_if_compiling(engine)
