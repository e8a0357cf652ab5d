"""One mode of the throughput benchmark on a fresh engine: a closed loop of requests through the public step loop,
sampled over time, and its steady window (``throughput`` documents what each figure means)."""

import math
import time

import numpy as np

from zipage_jax.benchmarks.throughput_report import format_row
from zipage_jax.benchmarks.workloads import Workload
from zipage_jax.sampling_params import SamplingParams

MODES = ("full", "compressed", "compressed-hybrid", "compressed-constrained")  # compressed: reserved admission


def param_bytes(model_cfg, dtype) -> tuple[int, int]:
    """(bytes of all weights, bytes a decode step reads: all but the embedding table unless it is tied)."""
    from zipage_jax.models.params import param_shapes

    total = sum(math.prod(shape) for shape in param_shapes(model_cfg).values() if shape is not None) * dtype.itemsize
    embed = model_cfg.vocab_size * model_cfg.hidden_size * dtype.itemsize
    return total, total if model_cfg.tie_word_embeddings else total - embed


def steady_window(samples, skip_tokens: int, end_s: float | None = None,
                  start_s: float | None = None) -> dict | None:
    """The steady part of a run, from its samples ``[(time_s, generated tokens)]`` in time order: from the first
    sample with at least ``skip_tokens`` generated (past the admission ramp and, with one KV budget per concurrent
    request, the first wave's first compressions), or the first at or after ``start_s`` when given, to the last
    sample at or before ``end_s`` (when the closed loop stopped adding: the tail, where requests drain, is left
    out; None: the last sample). Returns ``dict(start_s, end_s, tokens, tokens_per_s)``, or None when the window
    holds no time."""
    start = next((i for i, (t, generated) in enumerate(samples)
                  if (t >= start_s if start_s is not None else generated >= skip_tokens)), None)
    end = max((i for i, (t, _) in enumerate(samples) if end_s is None or t <= end_s), default=None)
    if start is None or end is None or samples[end][0] <= samples[start][0]:
        return None
    (t0, g0), (t1, g1) = samples[start], samples[end]
    return dict(start_s=t0, end_s=t1, tokens=g1 - g0, tokens_per_s=(g1 - g0) / (t1 - t0))


def prefill_over_s(samples, end_s: float | None = None, share: float = 0.8) -> float | None:
    """When an aged start's initial prefill is over, from the samples (``num_prefilling``, ``num_running``): the
    first sample, after one with a request mid-prefill, at which none is and the engine runs at least ``share`` of
    its typical concurrency (the median running count over the second half of the samples up to ``end_s``). A
    pause in the prefill while admission waits for pages (compressed mode prefills the long contexts a few at a
    time, each compressed before the next fits) is not the end of the ramp. None: it never ended."""
    loop = [h for h in samples if end_s is None or h["time_s"] <= end_s]
    busy = next((i for i, h in enumerate(loop) if h["num_prefilling"]), None)
    if busy is None:
        return None
    typical = float(np.median([h["num_running"] for h in loop[len(loop) // 2:]]))
    return next((h["time_s"] for h in loop[busy:]
                 if h["num_prefilling"] == 0 and h["num_running"] >= share * typical), None)


def run_mode(mode: str, make_engine, workload: Workload, duration: float | None, warmup: bool = True,
             sample_interval_s: float = 1.0, progress=print, concurrency: int | None = None,
             deadline: float | None = None, budget_tokens: int = 0, aged: bool = False) -> dict:
    """One fresh engine, start-up timed apart, then the workload through ``add_request`` / ``step``.

    ``concurrency`` None: every request is added at once. Otherwise a closed loop: ``concurrency`` requests are
    added, and each one that finishes is replaced by the workload's next, until the workload runs out (then the
    rest drain). Generation stops after ``duration`` seconds or at ``deadline`` (a ``time.perf_counter()``: the
    mode's share of the command's time budget, start-up included), whichever comes first. The steady window
    (``steady_window``) of a closed loop starts once the engine has generated one KV budget (``budget_tokens``) per
    concurrent request or, if less, a pool's worth of tokens (full KV: its pool has filled once; compressed: every
    resident request is past its first compression), and ends where the loop stopped adding. ``aged``: the
    workload starts mid-trace (``aged_start``); the window then starts when the initial prefill of the long
    contexts is over (``prefill_over_s``)."""
    import jax

    from zipage_jax.benchmarks.model_shapes import hbm_peak_bytes_per_s
    from zipage_jax.benchmarks.probes import CompressionTimer
    from zipage_jax.worker import kv_cache

    t0 = time.perf_counter()
    engine = make_engine(mode)
    timer = CompressionTimer()  # asynchronous compressions timed on their first dispatches of each shape
    engine.add_compression_observer(timer)
    init_s = time.perf_counter() - t0
    warm = engine.warmup() if warmup else dict(programs=0, compile_s=0.0)
    startup_s = time.perf_counter() - t0
    progress(f"{mode}: engine {init_s:.1f}s, warm-up {warm['compile_s']:.1f}s ({warm['programs']} programs)")
    stats = engine.stats()
    compiles, compile_wall = stats.num_compiles, stats.worker.compile_s
    dtype = engine.memory_plan.dtype
    total_bytes, step_weight_bytes = param_bytes(engine.model_cfg, dtype)
    page_bytes = kv_cache.page_bytes(engine.model_cfg, engine.config.page_size, dtype)
    scheduler, bm = engine.scheduler, engine.page_manager
    pages = bm.num_pages - 1
    skip_tokens = min((concurrency or 0) * budget_tokens, pages * engine.config.page_size)

    requests = []
    queue = list(zip(workload.prompts, workload.max_tokens))[::-1]

    def add_next():
        prompt, max_tokens = queue.pop()
        request_id = f"{mode}-{len(requests)}"
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        requests.append(engine.requests[request_id])

    start = time.perf_counter()
    stop = min(start + duration if duration is not None else math.inf, deadline or math.inf)
    for _ in range(min(concurrency or len(queue), len(queue))):
        add_next()
    loop_end_s = None if queue else 0.0  # when the closed loop stopped adding (the workload ran out)

    def generated():
        return sum(len(r.output_logprobs) for r in requests)

    samples, steps, running_sum, peak_running, occupancy_sum, peak_occupancy = [], 0, 0, 0, 0.0, 0.0
    stalled, decode_steps, bytes_read = 0, 0, 0.0
    last_sample = -math.inf
    finished = 0
    def compressing() -> dict:
        worker = engine.stats().worker
        return dict(compression_seconds=worker.compression_s or 0.0,
                    wide_compression_seconds=worker.wide_compression_s)

    while engine.has_unfinished_requests():
        decoded = engine.meter.totals["decode_tokens"]
        used = bm.num_used_pages
        finished += len(engine.step(only_finished=True))
        now = time.perf_counter() - start
        while queue and len(requests) - finished < (concurrency or 0):
            add_next()
        if loop_end_s is None and not queue:
            loop_end_s = now
        steps += 1
        running = len(scheduler.running)
        running_sum += running
        peak_running = max(peak_running, running)
        occupancy_sum += used / pages
        peak_occupancy = max(peak_occupancy, used / pages)
        stalled += scheduler.num_stalled
        if engine.meter.totals["decode_tokens"] > decoded:  # a decode step was read back: it read the weights and KV
            decode_steps += 1
            bytes_read += step_weight_bytes + used * page_bytes
        if now - last_sample >= sample_interval_s:
            last_sample = now
            held = [len(r.page_ids) for r in scheduler.running]
            prefilling = sum(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running)
            samples.append(dict(
                time_s=now, generated=generated(), num_running=running, num_waiting=len(scheduler.waiting),
                num_in_flight=len(requests) - finished,
                num_swapped=len(scheduler.swapped), num_stalled=scheduler.num_stalled, kv_pages_used=bm.num_used_pages,
                page_occupancy=bm.num_used_pages / pages, query_rows_used=scheduler.query_rows.num_used,
                pages_per_running_mean=float(np.mean(held)) if held else 0.0,
                pages_per_running_max=max(held, default=0), num_preemptions=scheduler.num_preemptions,
                num_swaps=scheduler.num_swaps, **compressing(), num_prefilling=prefilling, bytes_read=bytes_read))
        if time.perf_counter() >= stop:
            break
    engine.drain(only_finished=True)  # the steps in flight when generation stopped
    wall = time.perf_counter() - start
    tokens = generated()
    samples.append(dict(samples[-1] if samples else {}, time_s=wall, generated=tokens, bytes_read=bytes_read,
                        **compressing()))
    prefilled_s = None  # aged: the window starts when the initial prefill is over, not after skip_tokens
    if aged:
        skip_tokens, prefilled_s = 0, prefill_over_s(samples, loop_end_s)
    steady = concurrency and not (aged and prefilled_s is None) and steady_window(
        [(h["time_s"], h["generated"]) for h in samples], skip_tokens, loop_end_s, prefilled_s)
    hbm_peak = hbm_peak_bytes_per_s(jax.devices()[0].device_kind) * engine.config.tensor_parallel_size
    if steady:
        inside = [h for h in samples if steady["start_s"] <= h["time_s"] <= steady["end_s"]]
        span = max(inside[-1]["time_s"] - inside[0]["time_s"], 1e-9)

        def per_s(key):  # a counter's growth over the window, a second
            return (inside[-1][key] - inside[0][key]) / span

        steady.update(skip_tokens=skip_tokens, hbm_roofline_fraction=per_s("bytes_read") / hbm_peak,
                      compression_time_share=per_s("compression_seconds"),
                      # without the first compressions of contexts wider than M + 1 pages (the aged start's)
                      compression_time_share_at_budget=per_s("compression_seconds")
                      - per_s("wide_compression_seconds"),
                      running_mean=float(np.mean([h["num_running"] for h in inside])),
                      pages_per_running_mean=float(np.mean([h["pages_per_running_mean"] for h in inside])),
                      page_occupancy_mean=float(np.mean([h["page_occupancy"] for h in inside])))
    stats = engine.stats()
    compile_after = stats.worker.compile_s - compile_wall
    steady_wall = max(wall - compile_after, 1e-9)
    half = next((s for s in samples if s["time_s"] >= wall / 2), samples[-1])
    second_half_s = wall - half["time_s"]
    metrics = engine.metrics()
    peak_pages = [r.peak_pages for r in requests if r.peak_pages]
    row = dict(
        mode=mode, init_s=init_s, warmup_s=warm["compile_s"], programs=warm["programs"], startup_s=startup_s,
        compiles_after_warmup=stats.num_compiles - compiles, compile_s_after_warmup=compile_after,
        generation_s=wall, complete=not engine.has_unfinished_requests() and not queue,
        requests_added=len(requests), requests_finished=finished, concurrency=concurrency,
        steady_skip_tokens=skip_tokens if concurrency else None, aged_start=aged, prefilled_s=prefilled_s,
        closed_loop_end_s=loop_end_s if concurrency else None, steady=steady or None,
        steady_tokens_per_s=steady["tokens_per_s"] if steady else None,
        generated_tokens=tokens, steps=steps, decode_steps=decode_steps,
        tokens_per_s=tokens / steady_wall,
        tokens_per_s_second_half=(tokens - half["generated"]) / second_half_s if second_half_s > 0 else None,
        tokens_per_s_incl_startup=tokens / (startup_s + wall),
        mean_running=running_sum / max(steps, 1), peak_running=peak_running,
        mean_page_occupancy=occupancy_sum / max(steps, 1), peak_page_occupancy=peak_occupancy,
        num_preemptions=scheduler.num_preemptions, num_swaps=scheduler.num_swaps, stalled_request_steps=stalled,
        num_compressions=metrics["num_compressions"],
        compression_dispatches=timer.profile(),
        compression_time_share_steady=metrics["steady_compression_time_share"],
        compression_time_share_since_start=metrics["compression_time_share"],
        hbm_roofline_fraction=bytes_read / steady_wall / hbm_peak,
        weight_bytes=total_bytes, page_bytes=page_bytes, kv_pages=pages,
        num_query_rows=metrics["num_query_rows"], max_concurrency=metrics["max_concurrency"],
        pages_per_request_peak_mean=float(np.mean(peak_pages)) if peak_pages else 0.0,
        pages_per_request_peak=np.bincount(peak_pages).tolist() if peak_pages else [],
        history=samples)
    progress(format_row(row))
    return row
