"""Compressed requests under memory pressure (``python -m zipage_jax.bench scheduling``): asynchronous vs
synchronous compression, reserved vs hybrid vs constrained admission, one run per variant from the same weights.

Engine options are ``EngineConfig``'s, but for those each variant sets (``SIZED``)."""

import dataclasses
import json
import time

import jax
import numpy as np

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.benchmarks.probes import CompressionTimer
from zipage_jax.config import ADMISSIONS, EngineConfig, add_engine_options, engine_kwargs
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker.worker import resolve_dtype

SCHEDULING_VARIANTS = (("async", "reserved"), ("async", "hybrid"), ("sync", "reserved"), ("async", "constrained"))
# engine options set per variant (compression mode and admission) or by the workload (prompt + output length)
SIZED = ("compression", "async_compression", "admission", "max_model_len")
DEFAULTS = dict(max_num_batched_tokens=8192, max_num_prefill_seqs=8, metrics_interval_steps=16,
                enable_prefix_caching=False)


def scheduling_benchmark(model_shape: str, num_requests: int, prompt_len: int, output_len: int,
                         engine_options: dict | None = None, variants=SCHEDULING_VARIANTS, warmup: bool = True,
                         progress=print, on_result=None):
    """Long outputs under memory pressure, one run per (compression mode, admission) variant from the same params.

    ``engine_options``: ``EngineConfig`` fields over ``DEFAULTS``, except ``SIZED`` (``max_num_seqs`` is capped at
    the number of requests; ``seed`` seeds the weights and prompts too; ``compilation_cache_dir`` lets later
    variants load the steps the first compiled). Per variant: throughput, host time per step (excluding the
    read-back wait), time blocked on the read-back, an upper bound of GPU idle per step (a step whose read-back
    did not block may have left the device idle for at most its host time; one that blocked left it none), the
    compression share of device time, the metrics history, and every request's tokens (greedy: identical across
    variants when all is lossless).
    """
    for name, value in (("num_requests", num_requests), ("prompt_len", prompt_len), ("output_len", output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int (got {value!r})")
    if model_shape not in MODEL_SHAPES:
        raise ValueError(f"model_shape: unknown {model_shape!r}; have {sorted(MODEL_SHAPES)}")
    options = {**DEFAULTS, **(engine_options or {})}
    if set(options) & set(SIZED):
        raise ValueError(f"engine_options: {sorted(set(options) & set(SIZED))} are set by the benchmark")
    model_cfg = MODEL_SHAPES[model_shape]
    base = EngineConfig.from_kwargs(f"random:{model_shape}", **options, compression=True,
                                    max_model_len=prompt_len + output_len)
    base = dataclasses.replace(base, max_num_seqs=min(base.max_num_seqs, num_requests))
    params = weights.init_random_params(model_cfg, jax.random.key(base.seed), resolve_dtype(base.dtype, model_cfg))
    rng = np.random.default_rng(base.seed)
    prompts = [rng.integers(0, model_cfg.vocab_size, size=prompt_len).tolist() for _ in range(num_requests)]
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    report = dict(benchmark="scheduling", model_shape=model_shape, device=str(jax.devices()[0]),
                  device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  config=dict(num_requests=num_requests, prompt_len=prompt_len, output_len=output_len,
                              **base.options()),
                  results=[])
    for mode, admission in variants:
        config = dataclasses.replace(base, async_compression=mode == "async", admission=admission)
        engine = LLMEngine(config, model_cfg, params)
        if config.async_compression:  # synchronous compressions are timed anyway: the host waits for them
            engine.add_compression_observer(CompressionTimer())
        if warmup:  # so no measured step compiles
            engine.warmup()
        engine.reset_metrics_history()  # its rates from the workload's start on
        steps = []  # per step: host s apart from the read-back wait, that wait, whether it scheduled nothing
        engine.add_step_observer(lambda s: steps.append((s.step_s - s.read_back_s, s.read_back_s, s.scheduled.empty)))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sampling)
        outputs = {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step(only_finished=True))
            if len(steps) > 1 and steps[-1][2] and steps[-2][2] and engine.has_unfinished_requests():
                # a second step that scheduled nothing had nothing in flight either: nothing will change
                raise RuntimeError("scheduling benchmark: no progress (the pool cannot hold one request)")
        wall = time.perf_counter() - start
        done = [outputs[f"r{i}"] for i in range(num_requests)]
        host, blocked = [h for h, _, _ in steps], [b for _, b, _ in steps]
        metrics = engine.metrics()
        tokens = [out.outputs[0].token_ids for out in done]
        row = dict(
            mode=mode, admission=admission, wall_s=wall, steps=len(steps),
            output_tokens=sum(map(len, tokens)), tokens_per_s=sum(map(len, tokens)) / wall,
            host_ms_per_step=float(np.mean(host)) * 1e3, blocked_ms_per_step=float(np.mean(blocked)) * 1e3,
            gpu_idle_upper_ms_per_step=float(np.mean([h if b < 1e-4 else 0.0 for h, b in zip(host, blocked)])) * 1e3,
            compression_time_share=engine.stats().worker.compression_s / wall,
            num_compressions=sum(out.metrics["num_compressions"] for out in done),
            num_swaps=metrics["num_swaps"], num_preemptions=metrics["num_preempted"],
            sizing=engine.memory_plan.as_dict(), history=engine.metrics_history(), tokens=tokens)
        report["results"].append(row)
        progress(f"{mode:>5} {admission:>11}: {row['tokens_per_s']:9.1f} tok/s, {len(steps)} steps, host "
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


def add_arguments(parser):
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=4096)
    parser.add_argument("--variants", nargs="+", default=[f"{m}-{a}" for m, a in SCHEDULING_VARIANTS],
                        help="MODE-ADMISSION, MODE in async/sync, ADMISSION in reserved/hybrid/constrained")
    parser.add_argument("--no-warmup", action="store_true", help="compile on first use (smoke runs)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--png", help="write the metrics plot here")
    parser.set_defaults(engine_fields=add_engine_options(parser, exclude=SIZED + ("tokenizer",), defaults=DEFAULTS))


def main(args):
    variants = [tuple(v.split("-", 1)) for v in args.variants]
    if any(len(v) != 2 or v[0] not in ("async", "sync") or v[1] not in ADMISSIONS for v in variants):
        raise ValueError(f"variants: expected MODE-ADMISSION with MODE async|sync and ADMISSION one of {ADMISSIONS}, "
                         f"got {args.variants}")
    options = engine_kwargs(args, args.engine_fields)
    print(f"scheduling benchmark: {args.model_shape} on {jax.devices()[0].device_kind}, {args.requests} requests "
          f"x ({args.prompt_len} + {args.output_len}) tokens, engine options {options}")

    def write(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    report = scheduling_benchmark(args.model_shape, args.requests, args.prompt_len, args.output_len, options,
                                  variants, not args.no_warmup, progress=lambda line: print(line, flush=True),
                                  on_result=write)
    write(report)
    if args.png:
        plot_scheduling(report, args.png)
    return report, None
