"""``/metrics`` through ``prometheus_client``: vLLM's names for what this server shares with vLLM, so vLLM's Grafana
dashboards and alerts read it (docs/grafana-dashboard.json reads both), and this engine's own under ``zipage:``.

Every engine metric carries vLLM's labels ``model_name`` (the first served name) and ``engine`` ("0"). Gauges and
counters of the engine are read, at each scrape, from the latest ``engine.metrics()`` the loop published; the
request histograms are observed as outputs arrive (``ServerMetrics`` is the ``AsyncEngine``'s observer). What each
histogram measures, and on which clock:

- ``vllm:time_to_first_token_seconds``: from the route receiving the request (its body parsed, before tokenizing)
  to the server receiving the choice's first token from the engine loop; one sample per choice;
- ``vllm:inter_token_latency_seconds``: between the arrivals of a choice's successive tokens at the server (a
  delta of k tokens counts k samples of its gap / k);
- ``vllm:e2e_request_latency_seconds``: from the same arrival to the server receiving the choice's final output;
- ``vllm:request_queue_time_seconds``: from the engine loop queuing the choice to its first scheduled step,
  measured by the loop (``messages.RequestStats``);
- ``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens``, ``zipage:request_kv_pages`` (the most KV pages
  a choice held), ``zipage:evicted_tokens_total`` (tokens compression dropped from finished choices).

``vllm:request_success_total`` counts finished choices by ``finished_reason``: ``stop``, ``length``, ``abort``
(the client left, or the server shut down) and ``error`` (the engine failed while running them).
"""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

# engine.metrics() key -> (name, kind, help); vLLM's names where vLLM has the metric. Other numeric keys are gauges
# named zipage:<key>.
ENGINE_METRICS = {
    "num_running": ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    "page_occupancy": ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    "prompt_tokens_total": ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    "num_preempted": ("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine."),
    "num_compressions": ("zipage:compressions", "counter", "KV compressions (one request's pages, once)."),
    "num_swaps": ("zipage:swaps", "counter", "Compressed requests swapped out to host memory."),
    "num_requests_finished": ("zipage:requests_finished", "counter", "Requests the engine finished."),
    "num_compiles": ("zipage:compiles", "counter", "XLA compiles since the engine started."),
    "num_compiles_waited_on": ("zipage:compiles_waited_on", "counter", "Programs a step waited to compile."),
    "kv_pages_total": ("zipage:kv_pool_pages", "gauge", "KV pages in the pool (excluding the null page)."),
    "kv_pages_used": ("zipage:kv_pages_used", "gauge", "KV pages held by requests or the prefix cache."),
    "prefix_cache_hit_rate": ("zipage:prefix_cache_hit_rate", "gauge", "Fraction of prompt pages served from cache."),
    "prefill_tokens_per_s": ("zipage:prefill_tokens_per_second", "gauge", "Prefill throughput over the last 10 s."),
    "decode_tokens_per_s": ("zipage:decode_tokens_per_second", "gauge", "Decode throughput over the last 10 s."),
    "compression_time_share": ("zipage:compression_time_share", "gauge",
                               "Fraction of the engine's time spent compressing KV pages (absent: not measured)."),
    "steady_compression_time_share": ("zipage:steady_compression_time_share", "gauge",
                                      "Compression device seconds per second since warm-up, compiles excluded "
                                      "(absent: not measured)."),
}


def bucket_ladder(top: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``top`` (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > top:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class ServerMetrics:
    """The server's registry. ``snapshot()`` gives, at each scrape, the engine's latest ``metrics()`` and the server's
    counters (``AsyncEngine``'s and the HTTP responses by endpoint and status)."""

    def __init__(self, model_name: str, max_model_len: int, max_pages: int, snapshot):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}

        def histogram(name, help_text, buckets):
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       bucket_ladder(max_model_len))
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           bucket_ladder(max_model_len))
        self.kv_pages = histogram("zipage:request_kv_pages", "The most KV pages a request held.",
                                  bucket_ladder(max(max_pages, 1)))
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # each reason's series exists from the start, at 0
            self._success.labels(**self.labels, finished_reason=reason)
        self.evicted = Counter("zipage:evicted_tokens", "Tokens KV compression evicted from finished requests.",
                               LABELS, registry=self.registry).labels(**self.labels)
        self.registry.register(_Snapshot(snapshot, self.labels))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition in the format the scraper accepts (Prometheus text 0.0.4 by default), its content type."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type

    # -- AsyncEngine's observer -----------------------------------------------------------------------------
    def delta(self, group, index: int, delta, now: float):
        """One delta of choice ``index`` of ``group``, before it is applied (its last token time is the previous)."""
        output = group.outputs[index]
        if delta.token_ids:
            if output.last_token_at is None:
                self.ttft.observe(now - group.arrival)
            else:
                gap = (now - output.last_token_at) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.itl.observe(gap)
        if not delta.finished:
            return
        self.e2e.observe(now - group.arrival)
        self.finished(delta.finish_reason)
        self.generation_tokens.observe(delta.token_start + len(delta.token_ids))
        stats = delta.stats
        if stats is not None:
            self.prompt_tokens.observe(stats.num_prompt_tokens)
            if stats.queue_s is not None:
                self.queue.observe(stats.queue_s)
            self.kv_pages.observe(stats.peak_kv_pages)
            self.evicted.inc(stats.num_evicted_tokens)

    def closed(self, group, num_unfinished: int):
        """A group closed: its unfinished choices ended without their engine's final output."""
        if num_unfinished:
            self.finished("error" if group.failed else "abort", num_unfinished)

    def finished(self, reason: str, count: int = 1):
        self._success.labels(**self.labels, finished_reason=reason).inc(count)


class _Snapshot:
    """A collector of what the scrape reads off the latest snapshot: the engine's gauges and counters, the
    server's own."""

    def __init__(self, snapshot, labels: dict):
        self.snapshot, self.labels = snapshot, labels

    def collect(self):
        engine, server = self.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        for key, value in engine.items():
            if value is None or not isinstance(value, (int, float)):
                continue  # a share not measured is absent, not a made-up 0
            name, kind, help_text = ENGINE_METRICS.get(key, (f"zipage:{key}", "gauge", f"Engine metric {key}."))
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, labels=names)
            family.add_metric(values, float(value))
            yield family
        for name, help_text, kind in SERVER_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"zipage:server_{name}", help_text, value=server[name])
            yield family
        responses = CounterMetricFamily("zipage:server_responses", "HTTP responses by endpoint and status.",
                                        labels=["endpoint", "status"])
        for (endpoint, status), count in sorted(server["responses"].items()):
            responses.add_metric([endpoint, str(status)], count)
        yield responses


SERVER_METRICS = (  # (key of the server's snapshot, help, kind)
    ("requests_in_flight", "Choices admitted and not yet finished (running or queued).", "gauge"),
    ("request_capacity", "Choices admitted at most (max_num_seqs + max_queued_requests).", "gauge"),
    ("client_aborts", "Requests aborted because their client disconnected.", "counter"),
    ("rejected", "Requests refused because the queue was full.", "counter"),
    ("step_failures", "engine.step() exceptions (each failed the requests in flight).", "counter"),
)
