"""Seconds from launching `python -m zipage_jax.serve` to its first `/health` 200, cold (an empty compilation
cache directory) and warm (the same directory again, after the cold server finished its background compiles).

    python scripts/serve_ready_time.py [--runs 3] [-- extra serve options]
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


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def serve_once(cache: str, port: int, options: list[str], wait_for_background: bool, limit_s: float) -> float:
    """Launch, time the first 200, optionally wait until the background compiles are done, stop."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "zipage_jax.serve", "--port", str(port),
                                "--compilation-cache-dir", cache, "--log-level", "warning", *options])
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--limit-s", type=float, default=300.0, help="give up on a run after this long")
    parser.add_argument("options", nargs="*", help="options passed to serve (after --)")
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(serve_once(cache, args.port, args.options, True, args.limit_s))
            warm.append(serve_once(cache, args.port, args.options, False, args.limit_s))
    print(f"serve {' '.join(args.options)}: /health 200 after cold {statistics.median(cold):.2f} s, warm "
          f"{statistics.median(warm):.2f} s (medians of {args.runs}; cold {[round(s, 2) for s in cold]}, warm "
          f"{[round(s, 2) for s in warm]})")


if __name__ == "__main__":
    main()
