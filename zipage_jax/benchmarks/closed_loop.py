"""One mode of the throughput benchmark on a fresh engine: a closed loop of requests through the public step loop,
sampled over time, and its steady window (``throughput`` documents what each figure means)."""

import math
import time

import numpy as np

from zipage_jax.benchmarks.steady_state import StepTime, prefill_over_s, steadiness, steady_window, time_split
from zipage_jax.benchmarks.throughput_report import format_row
from zipage_jax.benchmarks.workloads import Workload
from zipage_jax.sampling_params import SamplingParams

MODES = ("full", "compressed", "compressed-hybrid", "compressed-constrained")  # compressed: reserved admission
# Of a mode's deadline, kept for its decode-capacity probe after the loop: the probe and the process's exit took
# at most ~28 s of it on an H100 (full KV's 47 rows x 7.7k tokens, 2026-12-07).
CAPACITY_RESERVE_S = 40


def param_bytes(model_cfg, dtype) -> tuple[int, int]:
    """(bytes of all weights, bytes a decode step reads: all but the embedding table unless it is tied)."""
    from zipage_jax.models.params import param_shapes

    total = sum(math.prod(shape) for shape in param_shapes(model_cfg).values() if shape is not None) * dtype.itemsize
    embed = model_cfg.vocab_size * model_cfg.hidden_size * dtype.itemsize
    return total, total if model_cfg.tie_word_embeddings else total - embed


def resident_capacity(engine, workload: Workload) -> int:
    """How many of an aged start's requests the engine holds at once: with compression, the steady-state holders
    the memory plan allows; with full KV, as many (in order) as their contexts' pages fit in the pool."""
    count = len(workload.fresh or [])
    plan = engine.memory_plan
    if engine.config.compression:
        return min(count, plan.max_compressed_concurrency)
    pages, size, held = plan.num_pages - 1, engine.config.page_size, 0
    for i, prompt in enumerate(workload.prompts[:min(count, engine.config.max_num_seqs)]):
        held += len(prompt) // size + 1
        if held > pages:
            return i
    return min(count, engine.config.max_num_seqs)


def decode_capacity(engine, rows: int, kv_tokens: float, steps: int, seed: int = 0) -> dict:
    """The engine's own decode step at ``rows`` rows of ``kv_tokens`` each (a window's mean shape), through the
    step loop and alone (``decode_steps``), after everything in flight is aborted. A compressed engine's probe stays
    short of its first compression (its prompts are capped there), and the rows are as many as the pool holds at
    once at that length (full KV's window preempts to hold more): ``rows`` and ``ctx`` say what was measured."""
    from zipage_jax.benchmarks.decode_steps import time_decode_steps
    from zipage_jax.benchmarks.probes import DecodeReplay

    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)
    config, warmup_steps = engine.config, 3
    ctx = max(1, round(kv_tokens))
    if config.compression:
        ctx = min(ctx, (config.kv_budget_pages + 1) * config.page_size - config.scoring.window - warmup_steps - steps - 2)
    ctx = min(ctx, engine.max_model_len - warmup_steps - steps - 2)
    # every row holds its pages at once (held until all are prefilled): as many rows as the pool holds so
    pages_per_row = -(-(ctx + warmup_steps + steps + 2) // config.page_size)
    rows = max(1, min(rows, (engine.num_pages - 1) // pages_per_row))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, engine.model_cfg.vocab_size, size=ctx).tolist() for _ in range(rows)]
    timing, _ = time_decode_steps(engine, DecodeReplay.of(engine), prompts, steps, warmup_steps, tag="capacity")
    return dict(rows=rows, kv_tokens=kv_tokens, ctx=ctx, engine_step_ms=timing.engine_step_s * 1e3,
                device_step_ms=timing.device_step_s * 1e3, tokens_per_s=timing.tokens_per_s,
                device_tokens_per_s=timing.device_tokens_per_s)


def run_mode(mode: str, make_engine, workload: Workload, duration: float | None, warmup: bool = True,
             sample_interval_s: float = 1.0, progress=print, concurrency: int | None = None,
             deadline: float | None = None, budget_tokens: int = 0, aged: bool = False,
             capacity_steps: int = 0) -> dict:
    """One fresh engine, start-up timed apart, then the workload through ``add_request`` / ``step``.

    ``concurrency`` None: every request is added at once. Otherwise a closed loop: ``concurrency`` requests are
    added, and each one that finishes is replaced by the workload's next, until the workload runs out (then the
    rest drain). Generation stops after ``duration`` seconds or at ``deadline`` (a ``time.perf_counter()``: the
    mode's share of the command's time budget, start-up included), whichever comes first. The steady window
    (``steady_window``) of a closed loop starts once the engine has generated one KV budget (``budget_tokens``) per
    concurrent request or, if less, a pool's worth of tokens (full KV: its pool has filled once; compressed: every
    resident request is past its first compression), and ends where the loop stopped adding. ``aged``: the
    workload starts mid-trace (``aged_start``), with as many aged requests as this engine holds at once
    (``resident_capacity``; the others fresh; compressed mode's with only their latest ``M + 1`` pages of trace,
    what its steady state holds: ``Workload.with_residents``); the window then starts when their prefill is over
    (``prefill_over_s``). ``capacity_steps``: then measure the decode step at the window's mean rows and context
    (``decode_capacity``), that many steps, within the deadline."""
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
    page_bytes = kv_cache.page_bytes(engine.model_cfg, engine.config.page_size, engine.memory_plan.kv_dtype)
    scheduler, bm = engine.scheduler, engine.page_manager
    pages = bm.num_pages - 1
    skip_tokens = min((concurrency or 0) * budget_tokens, pages * engine.config.page_size)
    residents = history_tokens = None
    if aged:
        residents = resident_capacity(engine, workload)
        if engine.config.compression:  # its steady state holds only the latest M + 1 pages of a trace
            history_tokens = (engine.config.kv_budget_pages + 1) * engine.config.page_size
        workload = workload.with_residents(residents, history_tokens)

    requests = []
    queue = list(zip(workload.prompts, workload.max_tokens))[::-1]

    def add_next():
        prompt, max_tokens = queue.pop()
        request_id = f"{mode}-{len(requests)}"
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        requests.append(engine.requests[request_id])

    start = time.perf_counter()
    reserve = CAPACITY_RESERVE_S if capacity_steps and concurrency else 0.0
    stop = min(start + duration if duration is not None else math.inf, (deadline or math.inf) - reserve)
    step_times = []

    def note_step(record):
        s = record.scheduled
        step_times.append(StepTime(time.perf_counter() - start, record.step_s, record.read_back_s, len(s.decodes),
                                   sum(c.num_tokens for c in s.prefills), len(s.stalled), len(s.compressions)))

    engine.add_step_observer(note_step)
    for _ in range(min(concurrency or len(queue), len(queue))):
        add_next()
    unprefilled = list(requests[:residents or 0])  # aged requests not yet through their prompt once
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
        if unprefilled:
            unprefilled = [r for r in unprefilled
                           if not r.status.finished and r.num_computed_tokens < len(r.prompt_token_ids)]
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
                kv_tokens_per_running_mean=float(np.mean([r.num_physical_tokens for r in scheduler.running]))
                if scheduler.running else 0.0,
                pages_per_running_max=max(held, default=0), num_preemptions=scheduler.num_preemptions,
                num_swaps=scheduler.num_swaps, **compressing(), num_prefilling=prefilling,
                num_aged_unprefilled=len(unprefilled), bytes_read=bytes_read))
        if time.perf_counter() >= stop:
            break
    engine.drain(only_finished=True)  # the steps in flight when generation stopped
    engine.remove_step_observer(note_step)
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
                      kv_tokens_per_running_mean=float(np.mean([h["kv_tokens_per_running_mean"] for h in inside])),
                      page_occupancy_mean=float(np.mean([h["page_occupancy"] for h in inside])),
                      steadiness=steadiness(inside), time_split=time_split(step_times, steady["start_s"],
                                                                           steady["end_s"]))
    stats, metrics, complete = engine.stats(), engine.metrics(), not engine.has_unfinished_requests() and not queue
    if steady and capacity_steps and round(steady["running_mean"]) >= 1:  # after the run's own figures are taken
        try:
            capacity = decode_capacity(engine, round(steady["running_mean"]), steady["kv_tokens_per_running_mean"],
                                       capacity_steps, engine.config.seed)
        except Exception as error:  # the yardstick failing must not cost the run's own figures
            progress(f"{mode}: decode capacity not measured: {type(error).__name__}: {error}")
            steady.update(decode_capacity=None, capacity_efficiency=None)
        else:
            steady.update(decode_capacity=capacity,
                          capacity_efficiency=steady["tokens_per_s"] / capacity["tokens_per_s"])
    compile_after = stats.worker.compile_s - compile_wall
    steady_wall = max(wall - compile_after, 1e-9)
    half = next((s for s in samples if s["time_s"] >= wall / 2), samples[-1])
    second_half_s = wall - half["time_s"]
    peak_pages = [r.peak_pages for r in requests if r.peak_pages]
    row = dict(
        mode=mode, init_s=init_s, warmup_s=warm["compile_s"], programs=warm["programs"], startup_s=startup_s,
        compiles_after_warmup=stats.num_compiles - compiles, compile_s_after_warmup=compile_after,
        generation_s=wall, complete=complete,
        requests_added=len(requests), requests_finished=finished, concurrency=concurrency,
        workload_output_tokens=int(sum(workload.max_tokens)),
        steady_skip_tokens=skip_tokens if concurrency else None, aged_start=aged, aged_residents=residents,
        aged_history_tokens=history_tokens,
        prefilled_s=prefilled_s,
        closed_loop_end_s=loop_end_s if concurrency else None, steady=steady or None,
        steady_tokens_per_s=steady["tokens_per_s"] if steady else None,
        generated_tokens=tokens, steps=steps, decode_steps=decode_steps,
        tokens_per_s=tokens / steady_wall,
        tokens_per_s_second_half=(tokens - half["generated"]) / second_half_s if second_half_s > 0 else None,
        tokens_per_s_incl_startup=tokens / (startup_s + wall),
        mean_running=running_sum / max(steps, 1), peak_running=peak_running,
        mean_page_occupancy=occupancy_sum / max(steps, 1), peak_page_occupancy=peak_occupancy,
        num_preemptions=stats.scheduler.num_preemptions, num_swaps=stats.scheduler.num_swaps,
        stalled_request_steps=stalled,
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
