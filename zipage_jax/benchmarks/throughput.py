"""Offline throughput of the whole engine, compressed against full KV, through the public ``LLMEngine`` API.

    python -m zipage_jax.bench throughput --workload reasoning --json out.json --png out.png [--peer hf]
    python -m zipage_jax.bench throughput --small          # tiny random model on CPU, in seconds
    python -m zipage_jax.bench throughput --workload long-reasoning --gpu-memory-utilization 0.9 --time-budget 480

Each mode (``full``: compression off, the vLLM-like baseline; ``compressed``: Compressed PagedAttention) runs the
same requests on a fresh engine in this process. Start-up (building the engine, ``warmup()``) is timed apart
from generation; the generation window starts when the requests are added and ends when they finish or after
``--duration`` seconds (the tokens generated so far count). Reported per mode:

- generated tokens/s over the generation window (compiles met after warm-up subtracted: steady state), over
  its second half (past the admission ramp and the first compressions), and including start-up;
- running requests (mean over steps, peak), page occupancy, preemptions (recompute), swaps, stalled request-steps;
- the steady-state compression share of device time (``metrics()["steady_compression_time_share"]``);
- the HBM roofline fraction of the decode steps: (weight bytes + KV bytes of the pages in use) per decode step,
  summed, over the window, against the card's peak bandwidth (``hbm_peak_bytes_per_s``; of all
  ``--tensor-parallel-size`` devices together);
- samples over time (throughput, concurrency, pages per running request) for the plots;
- with a closed loop (``--concurrency``), the steady window's tok/s, running requests, pages per running request,
  page occupancy, compression share of the time (also without the first compressions of contexts wider than
  M + 1 pages: ``--aged-start`` brings many) and HBM roofline fraction (below).

``--workload long-reasoning`` is the paper's regime: a KV budget of 2048 tokens (``--page-size 256
--kv-budget-pages 8``, the workload's defaults unless the command line sets others), short prompts (a shared
one-page system prefix plus a question of 1/8 to 1/2 page, as token ids), outputs log-normal with a mean of 7
budgets before clipping at ``--max-model-len`` (32768; ~6.4 budgets after), run as a closed loop: ``--concurrency``
requests (default ``--max-num-seqs``) are kept in the engine, each one that finishes replaced by the next of
4096 through ``add_request``, so the engine stays full for the whole window instead of draining a batch. Its
steady window (``steady_window``) starts once the engine has generated one budget per concurrent request, or a
pool's worth of tokens if less (the admission ramp and the first wave's first compressions; full KV: its pool has
filled once), and ends when the loop stops adding (the workload ran out: the tail, where requests drain, is left
out) or generation stops. Full KV is still filling toward its own steady state then (its requests' contexts keep
growing for as long as they live): the window flatters it. ``--aged-start`` enters the loop at its steady state
instead (``aged_start``: the first ``--concurrency`` requests caught mid-trace, their generated part prefilled) and
starts the window when that prefill is over. ``--time-budget`` fits one command, start-ups included,
into a device limit: each mode gets an equal share of the seconds left when it starts. ``--small
--workload long-reasoning`` runs it scaled down on CPU (page 16, M=2, 6 requests, concurrency 3).

Weights: ``--model`` (an HF checkpoint directory) or ``--model-shape`` (random weights of a real model's shapes,
made in device memory: ``weights.init_random_params``; the tokenizer is the shipped model's, prompts are ids).
``--peer hf`` first runs the same requests through HF transformers' continuous batching in a subprocess on the
same device (``zipage_jax.benchmarks.hf_peer``), before this process touches the accelerator.

Engine options are ``EngineConfig``'s (``--page-size``, ``--kv-budget-pages``, ``--max-num-seqs``, ...; each mode
sets ``compression`` and ``admission``). Without a pool size (``--kv-cache-memory-bytes``,
``--num-gpu-pages-override`` or ``--gpu-memory-utilization``) the KV pool gets what an 80 GB card keeps at 0.9
utilization after its share of the weights, the same on every card.
"""

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from zipage_jax.config import DEFAULT_MODEL, EngineConfig, add_engine_options, engine_kwargs
from zipage_jax.sampling_params import SamplingParams

WORKLOADS = ("reasoning", "mixed", "prefix", "long-reasoning")
MODES = ("full", "compressed", "compressed-hybrid", "compressed-constrained")  # compressed: reserved admission


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests as token ids and their output lengths (``ignore_eos``: a request's length is its ``max_tokens``)."""

    name: str
    prompts: list
    max_tokens: list
    description: str

    def summary(self) -> dict:
        prompt = [len(p) for p in self.prompts]
        return dict(name=self.name, description=self.description, requests=len(self.prompts),
                    prompt_tokens_mean=float(np.mean(prompt)), prompt_tokens_max=int(max(prompt)),
                    output_tokens_mean=float(np.mean(self.max_tokens)),
                    output_tokens_p50=float(np.percentile(self.max_tokens, 50)),
                    output_tokens_p99=float(np.percentile(self.max_tokens, 99)),
                    output_tokens_max=int(max(self.max_tokens)), output_tokens_total=int(sum(self.max_tokens)))


def long_tail(rng, mean: float, count: int, low: int, high: int, sigma: float = 0.8) -> list[int]:
    """Log-normal lengths of the given mean (before clipping to ``[low, high]``): reasoning traces are long-tailed."""
    mu = math.log(mean) - sigma ** 2 / 2
    return np.clip(rng.lognormal(mu, sigma, size=count), low, high).astype(int).tolist()


def make_workload(name: str, num_requests: int, budget_tokens: int, page_size: int, vocab: int,
                  max_model_len: int, seed: int = 0) -> Workload:
    """A named workload, scaled by the KV budget ``M * S`` (tokens) and the page size.

    - ``reasoning``: a shared system prefix (one page) plus a short question; outputs long-tailed with a mean of
      4.5 budgets (each request is compressed several times; full KV cannot hold every request at full length);
    - ``mixed``: short answers (under half a budget) interleaved with long reasoning outputs: admission matters;
    - ``prefix``: four long shared prompts (4 pages each) plus a short question, outputs around one budget: the
      prefix cache matters;
    - ``long-reasoning``: the paper's regime: a shared system prefix (one page) plus a short question (1/8 to 1/2
      page); outputs long-tailed with a mean of 7 budgets before clipping to ``max_model_len`` (~6.4 after: each
      request is compressed dozens of times). Run as a closed loop (``run_mode``'s ``concurrency``).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; have {WORKLOADS}")
    if num_requests < 1:
        raise ValueError(f"requests: must be >= 1 (got {num_requests})")
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(0, vocab, size=int(n)).tolist()

    def fit(prompts, outputs):  # every request fits max_model_len
        return [min(o, max_model_len - len(p)) for p, o in zip(prompts, outputs)]

    if name == "reasoning":
        system = ids(page_size)
        prompts = [system + ids(n) for n in rng.integers(page_size // 8, page_size, size=num_requests)]
        outputs = long_tail(rng, 4.5 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        text = f"shared {page_size}-token prefix + short question; long-tailed outputs, mean 4.5 x budget"
    elif name == "mixed":
        prompts = [ids(n) for n in rng.integers(page_size // 8, 2 * page_size, size=num_requests)]
        short = rng.integers(16, max(17, budget_tokens // 2), size=num_requests).tolist()
        long = long_tail(rng, 4.5 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        outputs = [s if i % 2 == 0 else t for i, (s, t) in enumerate(zip(short, long))]
        text = "short answers (< budget/2) interleaved with long-tailed reasoning outputs (mean 4.5 x budget)"
    elif name == "long-reasoning":
        system = ids(page_size)
        prompts = [system + ids(n) for n in rng.integers(page_size // 8, page_size // 2, size=num_requests)]
        outputs = long_tail(rng, 7 * budget_tokens, num_requests, budget_tokens // 2, max_model_len)
        text = (f"shared {page_size}-token system prefix + short question; long-tailed outputs, mean 7 x budget "
                f"before clipping at {max_model_len} tokens")
    else:
        shared = [ids(4 * page_size) for _ in range(4)]
        prompts = [shared[i % 4] + ids(n) for i, n in enumerate(rng.integers(8, page_size // 2, size=num_requests))]
        outputs = long_tail(rng, budget_tokens, num_requests, 16, max_model_len)
        text = f"4 shared {4 * page_size}-token prompts + short question; outputs mean 1 x budget"
    return Workload(name, prompts, fit(prompts, outputs), text)


def aged_start(workload: Workload, count: int, vocab: int, seed: int = 0) -> Workload:
    """The workload entered at a closed loop's steady state: its first ``count`` requests are replaced by requests
    caught mid-trace, as the ``count`` slots of a loop that has run for a long time hold them. A slot holds a
    request with probability proportional to its length (a long request holds its slot longer), at an age uniform
    over its length; what it has generated so far joins its prompt (its K/V is prefilled, as after a recompute)
    and its output is the rest. Full KV then starts with its pool full of long contexts, where a loop started
    with ``count`` fresh requests grows them together for a request lifetime (minutes) before it settles; the rest
    of the workload follows fresh. Every request keeps its prompt + output length."""
    if not 1 <= count <= len(workload.prompts):
        raise ValueError(f"concurrency: an aged start needs 1 to {len(workload.prompts)} requests (got {count})")
    rng = np.random.default_rng(seed + 1)
    lengths = np.array(workload.max_tokens, float)
    picks = rng.choice(len(lengths), size=count, replace=False, p=lengths / lengths.sum())
    ages = [int(rng.integers(0, workload.max_tokens[j])) for j in picks]  # at least one token left to generate
    prompts = [workload.prompts[j] + rng.integers(0, vocab, size=age).tolist() for j, age in zip(picks, ages)]
    outputs = [workload.max_tokens[j] - age for j, age in zip(picks, ages)]
    taken = set(picks.tolist())
    rest = [i for i in range(len(workload.prompts)) if i not in taken]
    return Workload(workload.name, prompts + [workload.prompts[i] for i in rest],
                    outputs + [workload.max_tokens[i] for i in rest],
                    f"{workload.description}; the first {count} entered mid-trace (aged start: length-biased, "
                    f"uniform ages)")


# -- the engine under test ---------------------------------------------------------------------------------------
def random_model_dir(shape: str, directory: str) -> str:
    """An HF config of a ``bench.MODEL_SHAPES`` entry plus the shipped tokenizer: what ``LLMEngine`` reads besides
    the weights (which come from memory)."""
    from transformers import Qwen3Config

    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.config import DEFAULT_MODEL

    s = MODEL_SHAPES[shape]
    Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta,
                tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=s.max_position_embeddings,
                eos_token_id=2, dtype=s.dtype).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pathlib.Path(DEFAULT_MODEL) / name, directory)
    return directory


def param_bytes(params, model_cfg, dtype) -> tuple[int, int]:
    """(bytes of all weights, bytes a decode step reads: all but the embedding table unless it is tied)."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(params))
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
    from zipage_jax.worker import kv_cache

    t0 = time.perf_counter()
    engine = make_engine(mode)
    init_s = time.perf_counter() - t0
    warm = engine.warmup() if warmup else dict(programs=0, compile_s=0.0)
    startup_s = time.perf_counter() - t0
    progress(f"{mode}: engine {init_s:.1f}s, warm-up {warm['compile_s']:.1f}s ({warm['programs']} programs)")
    programs, compiles = engine.runner.programs, engine.compile_counter.count
    compile_wall = programs.compile_wall_s
    total_bytes, step_weight_bytes = param_bytes(engine.params, engine.model_cfg, engine.dtype)
    page_bytes = kv_cache.page_bytes(engine.model_cfg, engine.config.page_size, engine.dtype)
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
    while engine.has_unfinished_requests():
        decoded = engine.totals["decode_tokens"]
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
        if engine.totals["decode_tokens"] > decoded:  # a decode step was read back: it read the weights and KV
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
                page_occupancy=bm.num_used_pages / pages, query_rows_used=scheduler.num_query_rows
                - len(scheduler.free_query_rows), pages_per_running_mean=float(np.mean(held)) if held else 0.0,
                pages_per_running_max=max(held, default=0), num_preemptions=scheduler.num_preemptions,
                num_swaps=scheduler.num_swaps, compression_seconds=engine.runner.compression_seconds,
                wide_compression_seconds=engine.runner.wide_compression_seconds, num_prefilling=prefilling,
                bytes_read=bytes_read))
        if time.perf_counter() >= stop:
            break
    engine.drain(only_finished=True)  # the steps in flight when generation stopped
    wall = time.perf_counter() - start
    tokens = generated()
    samples.append(dict(samples[-1] if samples else {}, time_s=wall, generated=tokens, bytes_read=bytes_read,
                        compression_seconds=engine.runner.compression_seconds,
                        wide_compression_seconds=engine.runner.wide_compression_seconds))
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
    compile_after = programs.compile_wall_s - compile_wall
    steady_wall = max(wall - compile_after, 1e-9)
    half = next((s for s in samples if s["time_s"] >= wall / 2), samples[-1])
    second_half_s = wall - half["time_s"]
    metrics = engine.metrics()
    peak_pages = [r.peak_pages for r in requests if r.peak_pages]
    row = dict(
        mode=mode, init_s=init_s, warmup_s=warm["compile_s"], programs=warm["programs"], startup_s=startup_s,
        compiles_after_warmup=engine.compile_counter.count - compiles, compile_s_after_warmup=compile_after,
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
        compression_dispatches=engine.runner.compression_profile(),
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


HEADER = (f"{'mode':>10} {'tok/s':>8} {'steady':>8} {'2nd half':>8} {'w/ start':>8} {'start s':>7} {'gen s':>6} {'tokens':>8} "
          f"{'run avg':>7} {'peak':>5} {'occ':>5} {'preempt':>7} {'swaps':>5} {'stalls':>6} {'comp %':>6} "
          f"{'roofline':>8} {'compiles':>8}")


def format_row(r: dict) -> str:
    second, steady = r.get("tokens_per_s_second_half"), r.get("steady_tokens_per_s")
    return (f"{r['mode']:>10} {r['tokens_per_s']:>8.1f} {steady if steady is not None else float('nan'):>8.1f} "
            f"{second if second is not None else float('nan'):>8.1f} "
            f"{r['tokens_per_s_incl_startup']:>8.1f} {r['startup_s']:>7.1f} {r['generation_s']:>6.1f} "
            f"{r['generated_tokens']:>8d} {r['mean_running']:>7.1f} {r['peak_running']:>5d} "
            f"{r['mean_page_occupancy']:>5.0%} {r['num_preemptions']:>7d} {r['num_swaps']:>5d} "
            f"{r['stalled_request_steps']:>6d} {r['compression_time_share_steady']:>6.1%} "
            f"{r['hbm_roofline_fraction']:>8.1%} {r['compiles_after_warmup']:>8d}")


def format_steady(r: dict) -> str:
    """One line on a closed-loop run's steady window (or why it has none)."""
    w = r.get("steady")
    head = f"{r['mode']}: closed loop of {r['concurrency']}, {r['requests_added']} requests added, " \
           f"{r['requests_finished']} finished, pool {r['kv_pages']} pages"
    aged = r.get("aged_start")
    if not w:
        why = "the initial prefill did not end" if aged else f"fewer than {r.get('steady_skip_tokens')} tokens"
        return head + f"; no steady window ({why} before it ended)"
    after = "the initial prefill" if aged else f"{w['skip_tokens']} tokens"
    return (head + f"; steady window {w['start_s']:.1f}-{w['end_s']:.1f} s (after {after}): "
            f"{w['tokens_per_s']:.1f} tok/s, running {w['running_mean']:.1f}, pages per running request "
            f"{w['pages_per_running_mean']:.1f}, page occupancy {w['page_occupancy_mean']:.0%}, compression "
            f"{w['compression_time_share']:.1%} of the time ({w['compression_time_share_at_budget']:.1%} without "
            f"first compressions wider than M + 1 pages), decode steps at {w['hbm_roofline_fraction']:.0%} of the "
            f"HBM roofline")


def format_compressions(r: dict) -> str:
    """One line on a mode's compression dispatches by shape: how many, how full, and what one costs."""
    parts = []
    for d in r["compression_dispatches"]:
        cost = f" at {d['seconds'] * 1e3:.2f} ms" if d["seconds"] is not None else ""
        parts.append(f"{d['rows']} rows x {d['width']} pages: {d['dispatches']} ({d['requests']} requests){cost}")
    return f"{r['mode']}: compression dispatches " + "; ".join(parts)


def format_report(report: dict) -> str:
    lines = [f"throughput benchmark, workload {report['workload']['name']}: {report['workload']['description']}",
             f"{report['workload']['requests']} requests, outputs mean {report['workload']['output_tokens_mean']:.0f} "
             f"(p99 {report['workload']['output_tokens_p99']:.0f}) tokens; {report['config']}", HEADER]
    lines += [format_row(r) for r in report["results"]]
    lines += [format_steady(r) for r in report["results"] if r.get("concurrency")]
    lines += [format_compressions(r) for r in report["results"] if r.get("compression_dispatches")]
    ratios = report.get("ratios", {})
    lines += [f"{k}: {v:.2f}x" for k, v in ratios.items() if v is not None]
    peer = report.get("peer")
    if peer:
        second = peer.get("tokens_per_s_second_half")
        lines.append(f"peer {peer.get('name')}: " + (f"{peer['tokens_per_s']:.1f} tok/s"
                                                    + (f" ({second:.1f} over the second half)" if second else "")
                                                    + f", {peer['generated_tokens']} tokens in "
                                                    f"{peer['generation_s']:.1f}s ({peer['requests']} requests)"
                                                    if "tokens_per_s" in peer else f"failed: {peer.get('error')}"))
    return "\n".join(lines)


def ratios(results: list, peer: dict | None) -> dict:
    by = {r["mode"]: r for r in results}
    out = {}
    if "full" in by and "compressed" in by:
        full, comp = by["full"], by["compressed"]
        out["compressed / full (steady)"] = comp["tokens_per_s"] / full["tokens_per_s"]
        if comp.get("steady_tokens_per_s") and full.get("steady_tokens_per_s"):
            out["compressed / full (steady window)"] = comp["steady_tokens_per_s"] / full["steady_tokens_per_s"]
        if comp["tokens_per_s_second_half"] and full["tokens_per_s_second_half"]:
            out["compressed / full (second half)"] = (comp["tokens_per_s_second_half"]
                                                      / full["tokens_per_s_second_half"])
        out["compressed / full (incl. start-up)"] = (comp["tokens_per_s_incl_startup"]
                                                     / full["tokens_per_s_incl_startup"])
    for other in ("compressed-hybrid", "compressed-constrained"):
        if "compressed" in by and other in by:
            out[f"compressed / {other} (steady)"] = by["compressed"]["tokens_per_s"] / by[other]["tokens_per_s"]
    if peer and peer.get("tokens_per_s") and "full" in by:
        out["full / hf peer (steady)"] = by["full"]["tokens_per_s"] / peer["tokens_per_s"]
        full_steady, peer_steady = by["full"].get("steady_tokens_per_s"), peer.get("tokens_per_s_second_half")
        if full_steady and peer_steady:  # both at their steady state: the engine's window, the peer's second half
            out["full steady window / hf peer second half"] = full_steady / peer_steady
    return out


def plot(report: dict, path: str):
    """Throughput and concurrency over time, page occupancy, and pages per running request, one colour a mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    (rate, conc), (occ, pages) = axes
    for i, r in enumerate(report["results"]):
        h, c = r["history"], f"C{i}"
        t = [x["time_s"] for x in h]
        gen = [x["generated"] for x in h]
        rates = [(g1 - g0) / max(t1 - t0, 1e-9) for t0, t1, g0, g1 in zip(t, t[1:], gen, gen[1:])]
        rate.plot(t[1:], rates, c, label=f"{r['mode']} ({r['tokens_per_s']:.0f} tok/s)")
        if r.get("steady"):  # the closed loop's steady window
            w = r["steady"]
            rate.axvspan(w["start_s"], w["end_s"], color=c, alpha=0.1,
                         label=f"{r['mode']} steady window ({w['tokens_per_s']:.0f} tok/s)")
        conc.plot(t, [x.get("num_running", 0) for x in h], c, label=f"{r['mode']} running")
        conc.plot(t, [x.get("num_waiting", 0) for x in h], c, ls=":", label=f"{r['mode']} waiting")
        occ.plot(t, [x.get("page_occupancy", 0) for x in h], c, label=r["mode"])
        pages.plot(t, [x.get("pages_per_running_mean", 0) for x in h], c, label=f"{r['mode']} mean")
        pages.plot(t, [x.get("pages_per_running_max", 0) for x in h], c, ls="--", label=f"{r['mode']} max")
    peer = report.get("peer") or {}
    if peer.get("tokens_per_s"):
        rate.axhline(peer["tokens_per_s"], color="k", ls=":", label=f"HF peer ({peer['tokens_per_s']:.0f} tok/s)")
    for ax, title in ((rate, "generated tokens/s"), (conc, "requests"), (occ, "KV page occupancy"),
                      (pages, "pages per running request")):
        ax.set_title(title)
        ax.set_xlabel("s since the requests were added")
        ax.legend(fontsize=7)
    config = report["config"]
    fig.suptitle(f"{report['workload']['name']}, {config['model']} on {config.get('device_kind')}: page "
                 f"{config['page_size']}, M={config['kv_budget_pages']}, {report['workload']['requests']} requests",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the command -------------------------------------------------------------------------------------------------
# engine options each mode sets (compression and admission); the command's own defaults of the others
SIZED = ("compression", "admission")
DEFAULTS = dict(max_model_len=32768, metrics_interval_steps=0, compilation_cache_dir=None)
# --small: the tiny random model on CPU in seconds (a preset: it overrides what the command line says)
SMALL = dict(model=None, model_shape="tiny", requests=6, duration=None, sample_interval_s=0.0, peer=None,
             no_warmup=True)
SMALL_ENGINE = dict(page_size=16, kv_budget_pages=2, max_num_seqs=4, max_num_batched_tokens=32,
                    max_num_prefill_seqs=4, max_model_len=256, num_gpu_pages_override=24)
# long-reasoning: the paper's budget (M=8 pages of 256 = 2048 tokens) unless the command line sets another; a closed
# loop (concurrency: max_num_seqs unless --concurrency) over more requests than a run finishes
WORKLOAD_ENGINE = {"long-reasoning": dict(page_size=256, kv_budget_pages=8)}
CLOSED_LOOP_REQUESTS = {"long-reasoning": 4096}
SMALL_WORKLOAD = {"long-reasoning": dict(requests=6, concurrency=3)}  # --small: a ramp, turnover and a tail
CARD_BYTES = 80e9  # without a pool size, the KV budget is what an 80 GB card keeps at 0.9 after its weights' share


def add_arguments(parser):
    parser.add_argument("--workload", choices=WORKLOADS, default="reasoning")
    parser.add_argument("--small", action="store_true",
                        help="random weights of the tiny shape on CPU, in seconds, compiling on first use (CI smoke "
                             "of the code path and the report)")
    parser.add_argument("--model", help="HF checkpoint directory (default: random weights of --model-shape)")
    parser.add_argument("--model-shape", default="qwen3-8b", help="random weights of these shapes (bench.MODEL_SHAPES)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:2]),
                        help="compressed-hybrid / compressed-constrained: compressed mode under another admission")
    parser.add_argument("--requests", type=int,
                        help=f"requests of the workload (default: 256; closed-loop workloads {CLOSED_LOOP_REQUESTS})")
    parser.add_argument("--concurrency", type=int,
                        help="closed loop: keep this many requests in the engine, adding the workload's next one "
                             "whenever one finishes (default: all at once; long-reasoning: --max-num-seqs)")
    parser.add_argument("--aged-start", action="store_true",
                        help="closed loop: enter it at its steady state, the first --concurrency requests caught "
                             "mid-trace (their generated part prefilled); the window starts when that prefill is "
                             "over (full KV otherwise needs a request lifetime, minutes, to settle)")
    parser.add_argument("--duration", type=float, help="seconds of generation per mode (default: to completion)")
    parser.add_argument("--time-budget", type=float,
                        help="seconds for the whole command, start-ups included: each mode gets an equal share of "
                             "what is left when it starts, and its generation stops when the share is spent")
    parser.add_argument("--sample-interval-s", type=float, default=1.0)
    parser.add_argument("--no-warmup", action="store_true", help="compile on first use (counted, not excluded)")
    parser.add_argument("--peer", choices=["hf"], help="also run HF transformers' continuous batching (subprocess)")
    parser.add_argument("--peer-requests", type=int, help="the first N requests of the workload for the peer")
    parser.add_argument("--peer-duration", type=float, default=60.0, help="the peer's generation window, seconds")
    parser.add_argument("--peer-timeout", type=float, default=240.0, help="kill the peer after this many seconds")
    parser.add_argument("--json", help="write the report here (rewritten after each mode)")
    parser.add_argument("--png", help="write the plots here")
    parser.set_defaults(engine_fields=add_engine_options(parser, exclude=SIZED, defaults=DEFAULTS))


def base_config(args, model_cfg) -> EngineConfig:
    """The engine options of every mode (validated): those of the command line over the workload's, or
    ``--small``'s."""
    small = SMALL_ENGINE if args.small else {}
    options = {**WORKLOAD_ENGINE.get(args.workload, {}), **engine_kwargs(args, args.engine_fields), **small}
    limit = model_cfg.max_position_embeddings
    options["max_model_len"] = min(options["max_model_len"] or limit, limit)
    return EngineConfig.from_kwargs(args.model or DEFAULT_MODEL, **options)


def main(args) -> dict:
    started = time.perf_counter()
    if args.small:
        args = argparse.Namespace(**{**vars(args), **SMALL, **SMALL_WORKLOAD.get(args.workload, {})})
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1 (got {args.concurrency})")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ValueError(f"time_budget: must be > 0 seconds (got {args.time_budget})")
    from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
    from zipage_jax.models.config import ModelConfig

    if args.model:
        model_cfg = ModelConfig.from_pretrained(args.model)
    elif args.model_shape in MODEL_SHAPES:
        model_cfg = MODEL_SHAPES[args.model_shape]
    else:
        raise ValueError(f"model_shape: unknown {args.model_shape!r}; have {sorted(MODEL_SHAPES)}")
    base = base_config(args, model_cfg)
    budget = base.kv_budget_pages * base.page_size
    requests = args.requests or CLOSED_LOOP_REQUESTS.get(args.workload, 256)
    workload = make_workload(args.workload, requests, budget, base.page_size, model_cfg.vocab_size,
                             base.max_model_len, base.seed)
    concurrency = args.concurrency or (base.max_num_seqs if args.workload in CLOSED_LOOP_REQUESTS else None)
    if args.aged_start:
        if concurrency is None:
            raise ValueError("aged_start: needs a closed loop (--concurrency)")
        workload = aged_start(workload, concurrency, model_cfg.vocab_size, base.seed)
    tmp = tempfile.mkdtemp(prefix="zipage_throughput_")
    report = dict(benchmark="throughput", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  workload=workload.summary(), config=None, results=[], peer=None, ratios={})

    def write():
        report["ratios"] = ratios(report["results"], report["peer"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    if args.peer:  # before this process allocates device memory
        report["peer"] = run_peer(args, workload, base, tmp)
        print(f"peer: {json.dumps({k: v for k, v in report['peer'].items() if k != 'history'})}", flush=True)
        write()

    import jax
    import jax.numpy as jnp

    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.models import weights
    from zipage_jax.worker import device_memory

    with device_memory.start_backend(base.gpu_memory_utilization):  # the engines' share, before jax starts
        jax.devices()
    dtype = jnp.dtype(model_cfg.dtype)
    if base.kv_cache_memory_bytes is None and base.num_gpu_pages_override is None \
            and "gpu_memory_utilization" not in vars(args):  # no pool size given: see CARD_BYTES
        shapes = jax.eval_shape(lambda key: weights.init_random_params(model_cfg, key, dtype), jax.random.key(0))
        share = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) / base.tensor_parallel_size
        base = dataclasses.replace(base, kv_cache_memory_bytes=int(0.9 * CARD_BYTES - share))
    model_dir = args.model or random_model_dir(args.model_shape, os.path.join(tmp, "model"))
    report["config"] = dict(base.options(), model=args.model or f"random:{args.model_shape}",
                            device=str(jax.devices()[0]), device_kind=jax.devices()[0].device_kind,
                            jax_version=jax.__version__, duration_s=args.duration,
                            time_budget_s=args.time_budget, concurrency=concurrency)

    def make_engine(mode):
        """A fresh engine; random weights are made again (same seed) by the engine once its pool is placed, so
        that only its copy is on the device and the pool meets an allocator they did not fragment."""
        config = dataclasses.replace(base, model=model_dir, compression=mode.startswith("compressed"),
                                     admission=mode.partition("-")[2] or "reserved")
        params = None
        if not args.model:
            params = functools.partial(weights.init_random_serving_params, model_cfg, jax.random.key(base.seed),
                                       dtype, base.tensor_parallel_size)
        return LLMEngine(config, params=params)

    for i, mode in enumerate(args.modes):
        now = time.perf_counter()
        deadline = None if args.time_budget is None else \
            now + (started + args.time_budget - now) / (len(args.modes) - i)
        report["results"].append(run_mode(mode, make_engine, workload, args.duration, not args.no_warmup,
                                          args.sample_interval_s, progress=lambda line: print(line, flush=True),
                                          concurrency=concurrency, deadline=deadline,
                                          budget_tokens=budget, aged=args.aged_start))
        gc.collect()  # the engine's pool goes before the next mode allocates its own
        write()
    print(format_report(report))
    if args.png:
        plot(report, args.png)
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def run_peer(args, workload: Workload, config, tmp: str) -> dict:
    """HF transformers' continuous batching on the same requests (``config``: the engine's page size, batch and
    seed), in a subprocess with a hard timeout."""
    count = args.peer_requests or len(workload.prompts)
    spec = dict(model=args.model, model_shape=None if args.model else args.model_shape, seed=config.seed,
                prompts=workload.prompts[:count], max_tokens=workload.max_tokens[:count],
                duration=args.peer_duration, page_size=config.page_size, max_batch=config.max_num_seqs)
    spec_path, out_path = os.path.join(tmp, "peer_spec.json"), os.path.join(tmp, "peer_out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "zipage_jax.benchmarks.hf_peer", spec_path, out_path],
                              timeout=args.peer_timeout, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {args.peer_timeout}s: " + str(e.stdout or "")[-1000:]
    result = dict(name="hf", requests=count, wall_s=time.perf_counter() - start)
    if os.path.exists(out_path):
        with open(out_path) as f:
            result.update(json.load(f))
    if "tokens_per_s" not in result:
        result["error"] = tail
    return result
