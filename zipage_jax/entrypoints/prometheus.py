"""Prometheus text exposition (format 0.0.4) of the engine's and the server's counters, without a client library."""

import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# engine.metrics() key -> (metric name, type, help). Keys not listed are exported as gauges under their own name.
ENGINE_METRICS = {
    "num_running": ("zipage_requests_running", "gauge", "Requests in the running batch."),
    "num_waiting": ("zipage_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "num_preempted": ("zipage_preemptions", "gauge", "Preemptions reported by the scheduler."),
    "kv_pages_total": ("zipage_kv_pages_total", "gauge", "KV pages in the pool (excluding the null page)."),
    "kv_pages_used": ("zipage_kv_pages_used", "gauge", "KV pages held by requests or the prefix cache."),
    "page_occupancy": ("zipage_kv_page_occupancy", "gauge", "Fraction of KV pages in use."),
    "prefix_cache_hit_rate": ("zipage_prefix_cache_hit_rate", "gauge", "Fraction of prompt pages served from cache."),
    "prompt_tokens_total": ("zipage_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    "generation_tokens_total": ("zipage_generation_tokens_total", "counter", "Tokens generated."),
    "prefill_tokens_per_s": ("zipage_prefill_tokens_per_second", "gauge", "Recent prefill throughput."),
    "decode_tokens_per_s": ("zipage_decode_tokens_per_second", "gauge", "Recent decode throughput."),
    "compression_time_share": ("zipage_compression_time_share", "gauge",
                               "Fraction of step time spent compressing KV pages."),
    "steady_compression_time_share": ("zipage_steady_compression_time_share", "gauge",
                                      "Compression device seconds per second since warm-up, compiles excluded."),
    "num_requests_finished": ("zipage_requests_finished_total", "counter", "Requests the engine finished."),
}


def _number(value) -> str:
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        lines.append(f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return lines


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(engine_metrics: dict, *, in_flight: int, capacity: int, responses: dict[tuple[str, int], int],
           client_aborts: int, rejected: int, step_failures: int) -> str:
    """`responses` maps (endpoint, HTTP status) to a count."""
    lines = []
    for key, value in engine_metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name, kind, help_text = ENGINE_METRICS.get(key, (f"zipage_{key}", "gauge", f"Engine metric {key}."))
        lines += _family(name, kind, help_text, [({}, value)])
    lines += _family("zipage_server_requests_in_flight", "gauge",
                     "Choices admitted and not yet finished (running or queued).", [({}, in_flight)])
    lines += _family("zipage_server_request_capacity", "gauge",
                     "Choices admitted at most (max_num_seqs + max_queued_requests).", [({}, capacity)])
    lines += _family("zipage_server_responses_total", "counter", "HTTP responses by endpoint and status.",
                     [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(responses.items())])
    lines += _family("zipage_server_client_aborts_total", "counter",
                     "Requests aborted because their client disconnected.", [({}, client_aborts)])
    lines += _family("zipage_server_rejected_total", "counter",
                     "Requests refused because the queue was full.", [({}, rejected)])
    lines += _family("zipage_server_step_failures_total", "counter",
                     "engine.step() exceptions (each failed the requests in flight).", [({}, step_failures)])
    return "\n".join(lines) + "\n"
