"""The command line of ``python -m zipage_jax.serve`` (``zipage-jax serve``): vLLM's launch line (a positional
model, vLLM's spellings and switches, ``vllm_flags``), the server's own options, then every engine option
(generated from `EngineConfig`'s fields, as eval's and the benchmarks' are). A bad option is one line and status
2, never the usage."""

import argparse
import json
import logging
import pathlib

from zipage_jax.config import DEFAULT_MODEL, add_engine_options, human_int
from zipage_jax.entrypoints.reasoning import PARSERS
from zipage_jax.entrypoints.tool_parsers import PARSERS as TOOL_PARSERS
from zipage_jax.entrypoints.vllm_flags import add_vllm_flags, vllm_flag_notes
from zipage_jax.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)

PROG = "python -m zipage_jax.serve"
ENGINE_ALIASES = {"tensor_parallel_size": ("-tp",), "page_size": ("--block-size",)}  # vLLM's spellings
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is ``PROG: error: ...`` alone (the usage is ``--help``'s)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Serve one model over an OpenAI-compatible HTTP API (completions, "
                                                  "chat, models, tokenize, health, Prometheus metrics).")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model directory (HF layout) or Hugging Face "
                                                                      "Hub id, as vLLM's `vllm serve MODEL`")
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=None, help="the same as MODEL (default: the shipped tiny-reasoner)")
    server.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    server.add_argument("--download-dir", default=None, help="where a Hub id is downloaded (default: the Hugging "
                                                             "Face cache)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model ids clients may send; responses and /v1/models name the first (default: the "
                             "model directory's name, e.g. tiny-reasoner, or the Hub id)")
    server.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 (or ::) listens on every "
                                                            "interface (default: %(default)s, this machine only)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    server.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* (default: "
                                                        "no authentication)")
    server.add_argument("--chat-template", default=None, help="a chat template file, or the template itself "
                                                              "(default: the tokenizer's)")
    server.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="sampling defaults for fields a request leaves unset: from the model's "
                             "generation_config.json (auto), none (vllm), or DIR's (default: %(default)s, as vLLM)")
    server.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                        help='sampling defaults over those, e.g. \'{"temperature": 0.6}\'')
    server.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                        help=f"most logprobs / top_logprobs / prompt_logprobs a request may ask (at most "
                             f"{MAX_LOGPROBS}, what every step computes; default: %(default)s)")
    server.add_argument("--max-prompt-chars", type=human_int, default=None,
                        help="longest prompt (or chat messages) in characters, refused with a 400 before it is "
                             "tokenized (default: 32 x max_model_len)")
    server.add_argument("--max-body-bytes", type=human_int, default=None,
                        help="largest request body, refused with a 413 (default: 16 x --max-prompt-chars: a batch "
                             "of prompts as token ids, or a prompt of non-ASCII escapes)")
    server.add_argument("--request-read-timeout", type=float, default=30.0,
                        help="seconds a client has to send a request's headers (from its connection or its "
                             "previous response) and then its body; slower ones are closed (default: %(default)s)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default: %(default)s)")
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
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice 'auto' (the default of requests with tools): the model's calls are "
                             "read from its reply by --tool-call-parser, as vLLM does")
    server.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls: hermes (Qwen3, Qwen2.5, Hermes: <tool_call> JSON "
                             "</tool_call>)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    logs.add_argument("--uvicorn-log-level", default=None, choices=[*LOG_LEVELS, "trace"],
                      help="uvicorn's own (default: --log-level)")
    logs.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                      help="one line per request: its id, prompt and sampling parameters (default: %(default)s)")
    logs.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                      default=argparse.SUPPRESS, help="the default (vLLM's older spelling)")
    logs.add_argument("--max-log-len", type=int, default=None, help="characters of a logged prompt (default: all)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no throughput line every 10 s while requests run")
    logs.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    add_vllm_flags(parser)
    parser.set_defaults(engine_fields=add_engine_options(parser, aliases=ENGINE_ALIASES))
    return parser


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the command line it parsed, checked: ``model`` set (MODEL or --model), the chat template
    read, ``notes`` the harmless vLLM flags given (the server logs them). A contradiction is a one-line error."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} name different models")
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    args.notes, error = vllm_flag_notes(args)
    if error:
        parser.error(error)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice: needs --tool-call-parser")
    if args.max_queued_requests < 0:
        parser.error("--max-queued-requests must be >= 0")
    if args.generation_config not in ("auto", "vllm") and not pathlib.Path(args.generation_config).is_dir():
        parser.error(f"--generation-config: {args.generation_config!r} is neither auto, vllm nor a directory")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        parser.error(f"--max-logprobs: must be in [0, {MAX_LOGPROBS}], what every step computes")
    for name in ("max_prompt_chars", "max_body_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    if getattr(args, "num_processes", None) not in (None, 1):  # followers would have to mirror every step
        parser.error("--num-processes: the server drives one process; several processes serve offline batches "
                     "(README, Several GPUs and hosts)")
    try:
        args.chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        parser.error(str(e))
    return parser, args


def json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


json_object.__name__ = "JSON object"


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a file's content if ``value`` names one, the value itself if it reads as a template (it has
    braces or a line break), else a ValueError (a file that is not there)."""
    if value is None:
        return None
    path = pathlib.Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: no file {value!r} (a template itself has braces)")
