"""What the server logs beside its requests' own warnings: uvicorn's access log without the polls of health probes
and metric scrapers (an orchestrator polls /health through the whole start: its lines would drown the compile
lines; at debug level they show), and vLLM's line of throughput every 10 s while requests run
(``--disable-log-stats`` turns it off)."""

import asyncio
import logging

log = logging.getLogger("zipage_jax.entrypoints.stats")

PROBES = frozenset({"/health", "/ping", "/metrics", "/version"})
STATS_INTERVAL_S = 10.0


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines of probe polls unless its access logger shows debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5):  # uvicorn's (client, method, path, version, status)
            return True
        probe = str(args[2]).partition("?")[0] in PROBES
        return not probe or logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG)


def quiet_probes():
    """Install the filter on uvicorn's access logger (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietProbes) for f in access.filters):
        access.addFilter(QuietProbes())


async def log_stats(metrics, interval_s: float = STATS_INTERVAL_S):
    """Every ``interval_s`` while the engine has had work since the last line: its prompt and generation throughput
    (over the engine's last 10 s), running and waiting requests, KV cache usage and prefix-cache hits.
    ``metrics()``: the engine's latest ``metrics()``."""
    busy_before = False
    while True:
        await asyncio.sleep(interval_s)
        m = metrics()
        prefill, decode = m.get("prefill_tokens_per_s", 0.0), m.get("decode_tokens_per_s", 0.0)
        busy = bool(prefill or decode or m.get("num_running") or m.get("num_waiting"))
        if busy or busy_before:
            log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                     "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%", prefill, decode,
                     m.get("num_running", 0), m.get("num_waiting", 0), 100 * m.get("page_occupancy", 0.0),
                     100 * m.get("prefix_cache_hit_rate", 0.0))
        busy_before = busy
