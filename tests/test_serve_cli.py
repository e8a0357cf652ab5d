"""`python -m zipage_jax.serve` as a process, the way its users start and stop it: a bad option is one line and
status 2 (as in eval); SIGINT / SIGTERM while the server compiles its programs ends it at once."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
    command = [sys.executable, "-m", "zipage_jax.serve", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


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
