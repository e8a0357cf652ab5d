"""`python -m zipage_jax.serve` (`zipage-jax serve`) as a process, the way its users start and stop it: a vLLM
launch line starts it; a bad option, or a vLLM flag it cannot honour, is one line and status 2 (as in eval); Ctrl-C
while it starts, SIGINT / SIGTERM while it compiles its programs, end it at once and quietly."""

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from waiting import HANG_S, wait_until
from zipage_jax import cli
from zipage_jax.config import EngineConfig, engine_kwargs, human_int
from zipage_jax.entrypoints.api_server import main
from zipage_jax.entrypoints.cli_args import parse_args
from zipage_jax.entrypoints.server_logging import QuietProbes, log_stats

ROOT = Path(__file__).resolve().parents[1]
START_S = 240.0  # bound on a server start (imports, the model, the engine) on a loaded 2-core machine
EXIT_S = 15.0  # bound on the exit after a signal: the warm-up below would compile forever

# XLA compiles that never end (an XLA compile cannot be interrupted), in every process of the server (a
# sitecustomize on the path: the engine process is spawned, a fresh interpreter): the warm-up stays in progress,
# so the server can only exit in time if it stops waiting for it.
ENDLESS_COMPILES = """
import os, pathlib, threading

if os.environ.get("COMPILING_MARKER"):
    from jax._src import stages

    def endless_compile(self, *args, **kwargs):
        pathlib.Path(os.environ["COMPILING_MARKER"]).touch()
        threading.Event().wait()

    stages.Lowered.compile = endless_compile
"""

SERVER_OPTIONS = ["--page-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len",
                  "256", "--dtype", "float32", "--compilation-cache-dir", "none", "--log-level", "info"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(*args, env: dict | None = None) -> subprocess.Popen:
    """The server as a process, with Ctrl-C's default action as from a terminal: a test run started in the background
    by a non-interactive shell ignores SIGINT, which its children inherit (Python keeps an inherited SIG_IGN, so a
    Ctrl-C before uvicorn's handlers would be lost); exec resets a handled signal to its default."""
    command = [sys.executable, "-m", "zipage_jax.serve", *args]
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def wait_compiling(proc: subprocess.Popen, url: str, marker: Path):
    """Until /health says the server is compiling its programs and an XLA compile has begun."""
    deadline = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the server did not start compiling"
        try:
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 503 and "compiling" in health.json().get("detail", "") and marker.exists():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def test_a_signal_during_warmup_ends_the_server_at_once(tmp_path):
    """SIGINT with the engine in its own process (the default), SIGTERM with the engine on a thread."""
    (tmp_path / "sitecustomize.py").write_text(ENDLESS_COMPILES)
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ports = {signal.SIGINT: free_port(), signal.SIGTERM: free_port()}
    markers = {sig: tmp_path / f"compiling-{sig.name}" for sig in ports}
    modes = {signal.SIGINT: [], signal.SIGTERM: ["--no-engine-process"]}
    procs = {sig: serve("--port", str(port), *SERVER_OPTIONS, *modes[sig],
                        env={"COMPILING_MARKER": str(markers[sig]), "PYTHONPATH": path})
             for sig, port in ports.items()}
    try:
        for sig, proc in procs.items():
            wait_compiling(proc, f"http://127.0.0.1:{ports[sig]}", markers[sig])
        for sig, proc in procs.items():
            proc.send_signal(sig)
        for sig, proc in procs.items():
            out, _ = proc.communicate(timeout=EXIT_S)
            assert proc.returncode in (0, -sig, 128 + sig), out  # as uvicorn ends on that signal
            assert "warm-up stopped for the shutdown" in out and "Traceback" not in out, out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.parametrize("args,fragment", [
    (["--page-size", "24"], "--page-size: must be a power of two"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be in (0, 1]"),
    (["--max-model-len", "100000"], "--max-model-len: 100000 exceeds the model's context"),
])
def test_an_invalid_option_is_one_line_and_status_2_like_eval(args, fragment):
    proc = serve(*args, "--port", str(free_port()))
    out, _ = proc.communicate(timeout=START_S)
    assert proc.returncode == 2, out
    [line] = out.strip().splitlines()
    assert line.startswith("python -m zipage_jax.serve: error: ") and fragment in line, out


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_a_vllm_launch_line_starts_and_serves(tmp_path):
    """A launch line as a Docker or Helm file writes it for vLLM, through the console script's module: it starts,
    serves under both names, uses the chat template file, logs one note per flag it ignores, keeps probe polls out
    of the access log, and stops on SIGTERM. (Without warm-up, to keep it short: its requests compile what they
    use.)"""
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    line = ["zipage_jax/assets/tiny-reasoner", "--port", str(port), "--served-model-name", "tiny", "alias", "-tp", "1",
            "--block-size", "16", "--max-model-len", "0.5k", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--dtype", "float", "--chat-template", str(tmp_path / "template.jinja"), "--generation-config", "vllm",
            "--max-logprobs", "5", "--trust-remote-code", "--enforce-eager", "--enable-chunked-prefill",
            "--kv-cache-dtype", "auto", "--swap-space", "4", "--enable-log-requests", "--max-log-len", "3",
            "--disable-log-stats",
            "--uvicorn-log-level", "info", "--download-dir", str(tmp_path), "--compilation-cache-dir", "none",
            "--no-warmup"]
    proc = subprocess.Popen([sys.executable, "-m", "zipage_jax.cli", "serve", *line], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # the pipe never fills
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or healthy(url), "the server to be ready")
        assert proc.poll() is None, "".join(lines)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        messages = [{"role": "user", "content": "What is 1+2?"}]
        reply = client.chat.completions.create(model="alias", messages=messages, max_tokens=4)
        assert reply.model == "tiny" and reply.usage.completion_tokens <= 4
        with pytest.raises(openai.BadRequestError, match="--max-logprobs of 5"):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=6)
        chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=HANG_S).json()
        text = httpx.post(f"{url}/tokenize", json={"prompt": "[user] What is 1+2?\n", "add_special_tokens": False},
                          timeout=HANG_S).json()
        assert chat == text and chat["max_model_len"] == 500  # rendered by the template file
        metrics = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        assert metrics["vllm:e2e_request_latency_seconds"].type == "histogram"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(EXIT_S)
        reader.join(EXIT_S)
    out = "".join(lines)
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM) and "Traceback" not in out, out
    assert "--trust-remote-code: no effect" in out and "--enforce-eager: no effect" in out, out
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in out and "GET /health" not in out, out
    assert "Received request chatcmpl-" in out and "Avg prompt throughput" not in out, out


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("when", ["at once", "while the engine starts"])
def test_ctrl_c_while_the_server_starts_ends_it_quietly(when):
    """Before uvicorn handles signals (the imports, the engine process's start) Ctrl-C ends the server with no
    traceback, its own nor its engine process's."""
    proc = serve("--port", str(free_port()), "--trust-remote-code", *SERVER_OPTIONS)
    if when != "at once":
        first = proc.stdout.readline()  # the note on --trust-remote-code, logged just before the engine starts
        assert "no effect" in first, first
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=START_S)
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in out, out


@pytest.mark.parametrize("args,fragment", [
    (["--port", "80a"], "argument --port: invalid int value: '80a'"),
    (["--max-model-len", "32q"], "argument --max-model-len: invalid int value: '32q'"),
    (["-pp", "2"], "--pipeline-parallel-size 2: no pipeline parallelism"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: must be one of ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2')"),
    (["--quantization", "awq"], "--quantization awq: quantized checkpoints are not supported"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: prompts are always prefilled in chunks"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template: no file 'no-such-file.jinja'"),
    (["--max-logprobs", "21"], "--max-logprobs: must be in [0, 20]"),
    (["some/model", "--model", "other/model"], "name different models"),
    (["--generation-config", "no-such-dir"], "--generation-config: 'no-such-dir' is neither auto, vllm nor"),
])
def test_what_the_server_cannot_honour_is_one_line_and_status_2(args, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and line.startswith("python -m zipage_jax.serve: error: ") and fragment in line, line


def test_vllm_spellings_are_the_engines_options():
    _, args = parse_args(["org/model", "-tp", "2", "--block-size", "32", "--max-model-len", "32k", "--dtype", "half",
                          "--kv-cache-memory-bytes", "2G", "--served-model-name", "a", "b", "--enforce-eager",
                          "--kv-cache-dtype", "fp8"])
    options = engine_kwargs(args, args.engine_fields)
    assert options == {"tensor_parallel_size": 2, "page_size": 32, "max_model_len": 32000, "dtype": "half",
                       "kv_cache_memory_bytes": 2**31, "kv_cache_dtype": "fp8"}
    assert EngineConfig.from_kwargs(args.model, **options).dtype == "float16"
    assert (args.model, args.served_model_name, args.host) == ("org/model", ["a", "b"], "127.0.0.1")
    assert args.notes == ["--enforce-eager: no effect (the engine runs XLA-compiled programs, there are no CUDA "
                          "graphs to turn off)"]
    assert [human_int(text) for text in ("1k", "1K", "25.6k", "3M", "7")] == [1000, 1024, 25600, 3 * 2**20, 7]
    assert not parse_args(["--enable-log-requests", "--disable-log-requests"])[1].enable_log_requests


def test_the_console_script_is_zipage_jax(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"zipage-jax": "zipage_jax.cli:main"}
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: zipage-jax serve")


def test_probe_polls_stay_out_of_the_access_log_unless_debug():
    def line(path):
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    access, quiet = logging.getLogger("uvicorn.access"), QuietProbes()
    level = access.level
    try:
        access.setLevel(logging.INFO)
        assert [quiet.filter(line(p)) for p in ("/health", "/metrics?x=1", "/v1/models")] == [False, False, True]
        access.setLevel(logging.DEBUG)
        assert quiet.filter(line("/health"))
    finally:
        access.setLevel(level)


def test_the_throughput_line_is_logged_while_requests_run(caplog):
    metrics = {"prefill_tokens_per_s": 120.0, "decode_tokens_per_s": 30.0, "num_running": 2, "num_waiting": 1,
               "page_occupancy": 0.25, "prefix_cache_hit_rate": 0.5}

    async def first_line():
        task = asyncio.create_task(log_stats(lambda: metrics, interval_s=0.0))
        while not caplog.records:
            await asyncio.sleep(0)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="zipage_jax.entrypoints.stats"):
        asyncio.run(first_line())
    assert caplog.records[0].getMessage() == (
        "Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 30.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%")
