"""The command line of ``python -m zipage_jax.serve``: the server's own options, then every engine option (generated
from `EngineConfig`'s fields, as eval's and the benchmarks' are)."""

import argparse

from zipage_jax.config import DEFAULT_MODEL, add_engine_options
from zipage_jax.entrypoints.reasoning import PARSERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.serve",
                                     description="Serve one model over an OpenAI-compatible HTTP API (completions, "
                                                 "chat, models, health, Prometheus metrics).")
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
