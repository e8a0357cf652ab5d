"""Compressed requests under memory pressure (``python -m zipage_jax.bench scheduling``): asynchronous vs
synchronous compression, reserved vs hybrid vs constrained admission, one run per variant from the same weights."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.decode import _Recorder
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import ADMISSIONS, EngineConfig
from zipage_jax.core.request import Request
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.metrics import MetricsHistory
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams

SCHEDULING_VARIANTS = (("async", "reserved"), ("async", "hybrid"), ("sync", "reserved"), ("async", "constrained"))


def scheduling_benchmark(model_shape: str, num_requests: int, prompt_len: int, output_len: int,
                         kv_budget_pages: int = 8, page_size: int = 256, num_pages: int | None = None,
                         num_query_rows: int | None = None, max_num_seqs: int = 256,
                         attention_backend: str = "reference", dtype: str = "bfloat16", prefill_tokens: int = 8192,
                         prefill_seqs: int = 8, metrics_interval_steps: int = 16, seed: int = 0,
                         variants=SCHEDULING_VARIANTS, warmup: bool = True,
                         compilation_cache_dir: str | None = None, progress=print, on_result=None):
    """Long outputs under memory pressure, one run per (compression mode, admission) variant from the same params.

    Per variant: throughput, host time per step (excluding the read-back wait), time blocked on the read-back,
    an upper bound of GPU idle per step (a step whose read-back did not block may have left the device idle
    for at most its host time; one that blocked left it none), the compression share of device time, the
    metrics history, and every request's tokens (greedy: identical across variants when all is lossless).
    """
    for name, value in (("num_requests", num_requests), ("prompt_len", prompt_len), ("output_len", output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int (got {value!r})")
    if model_shape not in MODEL_SHAPES:
        raise ValueError(f"model_shape: unknown {model_shape!r}; have {sorted(MODEL_SHAPES)}")
    model_cfg = MODEL_SHAPES[model_shape]
    if compilation_cache_dir:  # the variants compile the same steps: later ones load them from the cache
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(compilation_cache_dir))
    params = weights.init_random_params(model_cfg, jax.random.key(seed), jnp.dtype(dtype))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model_cfg.vocab_size, size=prompt_len).tolist() for _ in range(num_requests)]
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    report = dict(benchmark="scheduling", model_shape=model_shape, device=str(jax.devices()[0]),
                  device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  config=dict(num_requests=num_requests, prompt_len=prompt_len, output_len=output_len,
                              kv_budget_pages=kv_budget_pages, page_size=page_size, num_pages=num_pages,
                              num_query_rows=num_query_rows, max_num_seqs=max_num_seqs, dtype=dtype,
                              attention_backend=attention_backend),
                  results=[])
    for mode, admission in variants:
        config = EngineConfig.from_kwargs(f"random:{model_shape}", dtype=dtype, page_size=page_size,
                              max_model_len=prompt_len + output_len, max_num_seqs=min(max_num_seqs, num_requests),
                              max_num_batched_tokens=prefill_tokens, max_num_prefill_seqs=prefill_seqs,
                              num_gpu_pages_override=num_pages, attention_backend=attention_backend, seed=seed,
                              enable_prefix_caching=False, compilation_cache_dir=None, compression=True,
                              kv_budget_pages=kv_budget_pages, num_query_rows=num_query_rows,
                              async_compression=mode == "async", admission=admission,
                              metrics_interval_steps=metrics_interval_steps)
        engine = LLMEngine(config, model_cfg, params)
        recorder = _Recorder(engine.runner)
        if warmup:  # so no measured step compiles
            engine.warmup()
        engine.history = MetricsHistory(metrics_interval_steps)  # its rates from the workload's start on
        requests = [Request(f"r{i}", p, sampling, i, seed=i) for i, p in enumerate(prompts)]
        for r in requests:
            engine.add(r)
        host, blocked, idle, steps, empty = [], [], [], 0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            scheduled, h, b = recorder.engine_step(engine)
            steps += 1
            host.append(h)
            blocked.append(b)
            idle.append(h if b < 1e-4 else 0.0)
            empty = empty + 1 if scheduled.empty else 0  # a second one saw nothing in flight: nothing will change
            if empty > 1 and engine.scheduler.has_work():
                raise RuntimeError("scheduling benchmark: no progress (the pool cannot hold one request)")
        wall = time.perf_counter() - start
        row = dict(
            mode=mode, admission=admission, wall_s=wall, steps=steps,
            output_tokens=sum(len(r.output_token_ids) for r in requests),
            tokens_per_s=sum(len(r.output_token_ids) for r in requests) / wall,
            host_ms_per_step=float(np.mean(host)) * 1e3, blocked_ms_per_step=float(np.mean(blocked)) * 1e3,
            gpu_idle_upper_ms_per_step=float(np.mean(idle)) * 1e3,
            compression_time_share=engine.runner.compression_seconds / wall,
            num_compressions=sum(r.num_compressions for r in requests),
            num_swaps=engine.scheduler.num_swaps, num_preemptions=engine.scheduler.num_preemptions,
            sizing=engine.memory_plan.as_dict(), history=engine.metrics_history(),
            tokens=[r.output_token_ids for r in requests])
        report["results"].append(row)
        progress(f"{mode:>5} {admission:>11}: {row['tokens_per_s']:9.1f} tok/s, {steps} steps, host "
                 f"{row['host_ms_per_step']:.2f} ms/step, blocked {row['blocked_ms_per_step']:.2f}, idle <= "
                 f"{row['gpu_idle_upper_ms_per_step']:.2f}, compression {row['compression_time_share']:.1%}, "
                 f"{row['num_swaps']} swaps, {row['num_preemptions']} recomputes")
        if on_result:
            on_result(report)
    return report


def plot_scheduling(report: dict, path: str):
    """One column per variant: requests by state and page occupancy over time, decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 6), squeeze=False, sharex="col")
    for col, r in enumerate(results):
        h = r["history"]
        t = [x["time_s"] for x in h]
        top, bottom = axes[0][col], axes[1][col]
        for key in ("num_running", "num_waiting", "num_stalled", "num_swapped"):
            top.plot(t, [x[key] for x in h], label=key[4:])
        occupancy = top.twinx()
        occupancy.plot(t, [x["page_occupancy"] for x in h], "k--", label="page occupancy")
        occupancy.set_ylim(0, 1.05)
        top.set_title(f"{r['mode']} / {r['admission']}: {r['tokens_per_s']:.0f} tok/s")
        top.legend(loc="upper left", fontsize=7)
        bottom.plot(t, [x["decode_tokens_per_s"] for x in h], label="decode tok/s")
        share = bottom.twinx()
        share.plot(t, [x["compression_time_share"] for x in h], "r:", label="compression share")
        share.set_ylim(0, 1.05)
        bottom.set_xlabel("s")
        bottom.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args):
    variants = [tuple(v.split("-", 1)) for v in args.variants]
    if any(len(v) != 2 or v[0] not in ("async", "sync") or v[1] not in ADMISSIONS for v in variants):
        raise ValueError(f"variants: expected MODE-ADMISSION with MODE async|sync and ADMISSION one of {ADMISSIONS}, "
                         f"got {args.variants}")
    print(f"scheduling benchmark: {args.model_shape} on {jax.devices()[0].device_kind}, {args.requests} requests "
          f"x ({args.prompt_len} + {args.output_len}) tokens, budget {args.kv_budget_pages} pages")

    def write(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    report = scheduling_benchmark(
        args.model_shape, args.requests, args.prompt_len, args.output_len, args.kv_budget_pages, args.page_size,
        args.num_pages, args.num_query_rows, args.max_num_seqs, args.attention_backend, args.dtype,
        args.prefill_tokens, args.prefill_seqs, args.metrics_interval_steps, args.seed, variants, not args.no_warmup,
        args.compilation_cache_dir,
        progress=lambda line: print(line, flush=True), on_result=write)
    write(report)
    if args.png:
        plot_scheduling(report, args.png)
    return report, None
