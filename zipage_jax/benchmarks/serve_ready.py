"""Seconds from launching `python -m zipage_jax.serve` to its first `/health` 200, cold (an empty compilation cache
directory) and warm (the same directory again, once the cold server's background compiles are done):
`python -m zipage_jax.bench serve-ready`.

    python -m zipage_jax.bench serve-ready [--runs 3] [-- extra serve options, e.g. --no-ready-early]

Prints the medians over ``--runs`` cold/warm pairs, each pair in a fresh cache directory.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SERVE = [sys.executable, "-m", "zipage_jax.serve"]


def health(port: int) -> dict | None:
    """The server's `/health` body once it answers 200, else None."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def serve_once(cache: str, port: int, options: list[str], wait_for_background: bool, limit_s: float,
               command=SERVE) -> float:
    """Launch, time the first 200, optionally wait until the background compiles are done (`/health` drops its
    `detail`), stop."""
    start = time.perf_counter()
    process = subprocess.Popen([*command, "--port", str(port), "--compilation-cache-dir", cache,
                                "--log-level", "warning", *options])
    try:
        while (state := health(port)) is None:
            if process.poll() is not None or time.perf_counter() - start > limit_s:
                raise RuntimeError(f"serve did not become healthy (exit code {process.poll()})")
            time.sleep(0.05)
        ready = time.perf_counter() - start
        while wait_for_background and "detail" in state:
            time.sleep(0.2)
            state = health(port) or state
        return ready
    finally:
        process.terminate()
        process.wait(60)


def ready_times(runs: int, port: int, options: list[str], limit_s: float, command=SERVE) -> dict:
    cold, warm = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(serve_once(cache, port, options, True, limit_s, command))
            warm.append(serve_once(cache, port, options, False, limit_s, command))
    return dict(options=options, cold_s=cold, warm_s=warm, cold_median_s=statistics.median(cold),
                warm_median_s=statistics.median(warm))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench serve-ready", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--limit-s", type=float, default=300.0, help="give up on a run after this long")
    parser.add_argument("options", nargs="*", help="options passed to serve (after --)")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    report = ready_times(args.runs, args.port, args.options, args.limit_s)
    print(f"serve {' '.join(args.options)}: /health 200 after cold {report['cold_median_s']:.2f} s, warm "
          f"{report['warm_median_s']:.2f} s (medians of {args.runs}; cold {[round(s, 2) for s in report['cold_s']]}, "
          f"warm {[round(s, 2) for s in report['warm_s']]})")
    return report
