"""Engine benchmarks with random weights of real model shapes (no checkpoint, no tokenizer needed).

    python -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 256 --ctx 1024 --steps 64 \
        --json out.json

``decode`` prefills every prompt (``ctx`` random tokens) once; its full pages stay in the prefix cache. Then, for
each batch size, that many requests start from those prompts (only each prompt's last page is computed again),
each held out of scheduling (``probes.HoldingScheduler``) until all are prefilled, and the engine's step loop
(``LLMEngine.step``: schedule → dispatch → read back the previous step) decodes them, observed step by step
(``LLMEngine.add_step_observer``). Reported per batch size:

- engine tokens/s: ``batch * steps / wall`` of ``steps`` pipelined engine steps;
- device step time: the same decode step dispatched back to back with no host work in between
  (``probes.DecodeReplay``);
- host time per step: wall time of one engine step call, excluding the time it blocks reading back the
  previous result; split into the time inside the jitted call (dispatch, plus any wait the runtime imposes
  there: ``Programs.call_s``) and the Python work around it (scheduling, packing, read-back bookkeeping);
- idle gap: engine step time minus device step time (time the GPU waits for the host per step);
- roofline fraction: bytes one decode step must read (weights + live KV) / step time / HBM peak.

Engine options are ``EngineConfig``'s (``--page-size``, ``--max-num-batched-tokens``, ``--attention-backend``,
...) but for those the benchmark sizes itself (``SIZED``): the pool holds every request at full length.
"""

import dataclasses
import functools
import time

import jax
import numpy as np

from zipage_jax.benchmarks.hlo import collectives, pool_copies
from zipage_jax.benchmarks.model_shapes import (
    MODEL_SHAPES,
    hbm_peak_bytes_per_s,
    kv_bytes_per_token,
    weight_bytes_per_step,
)
from zipage_jax.benchmarks.decode_steps import time_decode_steps
from zipage_jax.benchmarks.probes import DecodeReplay, HoldingScheduler
from zipage_jax.benchmarks.profiling import kernel_breakdown
from zipage_jax.config import SCORING_FIELDS, EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker import device_memory
from zipage_jax.worker.worker import Worker, resolve_dtype

# engine options the benchmark sets itself: full KV, the pool sized for every request at full length, the prefix
# cache carrying the prefilled prompts from one batch size to the next
SIZED = ("max_model_len", "max_num_seqs", "num_gpu_pages_override", "kv_cache_memory_bytes",
         "gpu_memory_utilization", "enable_prefix_caching", "compression")
DEFAULTS = dict(max_num_batched_tokens=8192, max_num_prefill_seqs=8, compilation_cache_dir=None)
# options with nothing to act on here (random weights without a tokenizer, full KV): left off the command line
UNUSED = ("tokenizer", "kv_budget_pages", *SCORING_FIELDS, "num_query_rows", "admission", "async_compression",
          "max_compression_pages", "compression_min_batch", "compression_max_wait_steps")


def decode_benchmark(model_shape: str, batches: list[int], ctx: int, steps: int, engine_options: dict | None = None,
                     warmup_steps: int = 3, inspect_hlo: bool = True, profile: bool = False, progress=print,
                     on_result=None):
    """Run the decode benchmark; returns (report dict, the last batch size's ``RequestOutput``s).

    ``engine_options``: ``EngineConfig`` fields (flat, as ``EngineConfig.from_kwargs`` takes them) over
    ``DEFAULTS``, except ``SIZED``. ``seed`` seeds the random weights and prompts too. With
    ``tensor_parallel_size`` devices the rooflines are those of all their HBM together (each device reads its
    shards; the replicated embedding and LM head, read by every device, count once), and the compiled step's
    collectives are reported; the profile is the first device's.

    ``on_result(partial_report)`` is called after each batch size, so a run cut short keeps what it measured.
    ``profile`` adds each batch size's kernel breakdown of the device step (``profiling.kernel_breakdown``).
    """
    for name, value in (("ctx", ctx), ("steps", steps), ("warmup_steps", warmup_steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int (got {value!r})")
    if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
        raise ValueError(f"batch: must be positive ints (got {batches!r})")
    if model_shape not in MODEL_SHAPES:
        raise ValueError(f"model_shape: unknown {model_shape!r}; have {sorted(MODEL_SHAPES)}")
    options = {**DEFAULTS, **(engine_options or {})}
    if set(options) & set(SIZED):
        raise ValueError(f"engine_options: {sorted(set(options) & set(SIZED))} are sized by the benchmark")
    model_cfg = MODEL_SHAPES[model_shape]
    max_batch = max(batches)
    max_model_len = ctx + 1 + warmup_steps + steps
    config = EngineConfig.from_kwargs(f"random:{model_shape}", **options)
    page_size = config.page_size
    pages_per_seq = -(-max_model_len // page_size)
    config = dataclasses.replace(config, max_model_len=max_model_len, max_num_seqs=max_batch,
                                 enable_prefix_caching=True, compression=False)
    dtype = resolve_dtype(config.dtype, model_cfg)
    tensor_parallel_size = config.tensor_parallel_size
    t = time.perf_counter()
    # the pool is sized from the card and must hold every request's pages: jax starts with the engine's share of
    # the card, the pool is placed first, and the engine then makes the random weights layer by layer in the
    # serving layout (no stacked copy whose freed buffers would fragment the memory the pool needs)
    with device_memory.start_backend(config.gpu_memory_utilization):
        progress(f"decode benchmark: {model_shape} on {jax.devices()[0].device_kind}, batches {batches}")
    params = functools.partial(weights.init_random_serving_params, model_cfg, jax.random.key(config.seed), dtype,
                               tensor_parallel_size)
    worker = Worker.create(config, model_cfg, params=params)
    engine = LLMEngine(config, model_cfg, worker=worker, scheduler_cls=HoldingScheduler)
    replay = DecodeReplay(worker)
    num_pages = engine.num_pages
    if num_pages < max_batch * pages_per_seq + 1:
        raise ValueError(f"batch: {max_batch} requests of {max_model_len} tokens need {max_batch * pages_per_seq} "
                         f"pages; the KV pool the card leaves holds {num_pages - 1} (lower --batch or --ctx)")
    progress(f"random params + KV pool ({num_pages} pages of {page_size}): {time.perf_counter() - t:.1f}s")
    rng = np.random.default_rng(config.seed)
    prompts = [rng.integers(0, model_cfg.vocab_size, size=ctx).tolist() for _ in range(max_batch)]
    t = time.perf_counter()
    once = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)  # ends after its prefill: pages cached
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{i}", prompt, once)
    prefill_steps = 0
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)
        prefill_steps += 1
    prefill_s = time.perf_counter() - t
    progress(f"prefill {max_batch} x {ctx} tokens in {prefill_steps} steps: {prefill_s:.1f}s (incl. compile)")

    per_token_kv = kv_bytes_per_token(model_cfg, dtype)
    hbm_peak = hbm_peak_bytes_per_s(jax.devices()[0].device_kind) * tensor_parallel_size

    def make_report(results, hlo):
        return dict(
            benchmark="decode", model_shape=model_shape, device=str(jax.devices()[0]),
            device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            config=dict(ctx=ctx, steps=steps, warmup_steps=warmup_steps, **engine.config.options(),
                        num_pages=num_pages, num_params=sum(x.size for x in jax.tree.leaves(worker.params))),
            hbm_peak_bytes_per_s=hbm_peak / tensor_parallel_size, prefill_s_incl_compile=prefill_s,
            results=list(results), hlo=hlo)

    results, hlo, hlo_key, outputs = [], None, None, []
    for batch in batches:
        timing, outputs = time_decode_steps(engine, replay, prompts[:batch], steps, warmup_steps, tag="batch")
        hlo_key = hlo_key or replay.program_key
        breakdown = kernel_breakdown(replay) if profile else None
        weight_bytes = weight_bytes_per_step(worker.params, model_cfg, batch)
        kv_bytes = timing.kv_tokens * per_token_kv
        step_bytes = weight_bytes + kv_bytes
        row = dict(
            batch=batch, mean_kv_len=timing.kv_tokens / batch, steps=steps,
            engine_step_ms=timing.engine_step_s * 1e3, device_step_ms=timing.device_step_s * 1e3,
            host_ms_per_step=timing.host_s * 1e3, blocked_ms_per_step=timing.blocked_s * 1e3,
            jit_call_ms_per_step=timing.jit_call_s * 1e3, python_ms_per_step=(timing.host_s - timing.jit_call_s) * 1e3,
            idle_gap_ms=max(0.0, timing.engine_step_s - timing.device_step_s) * 1e3,
            tokens_per_s=timing.tokens_per_s, device_tokens_per_s=timing.device_tokens_per_s,
            weight_bytes=weight_bytes, kv_bytes=kv_bytes,
            kv_bytes_gathered_by_reference=batch * pages_per_seq * page_size * per_token_kv,
            roofline_fraction=step_bytes / timing.engine_step_s / hbm_peak,
            device_roofline_fraction=step_bytes / timing.device_step_s / hbm_peak,
            first_step_s_incl_compile=timing.first_step_s, profile=breakdown)
        results.append(row)
        progress(format_row(row))
        if on_result:
            on_result(make_report(results, None))
    if inspect_hlo:  # last, so a slow recompile never costs the measurements
        t = time.perf_counter()
        kv_heads = model_cfg.num_kv_heads // tensor_parallel_size  # the compiled step holds one shard's pool
        shape = (model_cfg.num_layers, num_pages, kv_heads, page_size, model_cfg.head_dim)
        text = worker.programs.compiled[hlo_key].as_text()
        hlo = dict(batch=batches[0], **pool_copies(text, shape, dtype), collectives=collectives(text))
        hlo["inspect_s"] = time.perf_counter() - t
    return make_report(results, hlo), outputs


HEADER = (f"{'batch':>5} {'kv_len':>7} {'tok/s':>9} {'engine ms':>9} {'device ms':>9} {'host ms':>8} "
          f"{'in jit':>7} {'python':>7} {'gap ms':>7} {'roofline':>8} {'dev roof':>8} {'1st step s':>10}")


def format_row(r: dict) -> str:
    return (f"{r['batch']:>5} {r['mean_kv_len']:>7.0f} {r['tokens_per_s']:>9.1f} {r['engine_step_ms']:>9.2f} "
            f"{r['device_step_ms']:>9.2f} {r['host_ms_per_step']:>8.2f} {r['jit_call_ms_per_step']:>7.2f} "
            f"{r['python_ms_per_step']:>7.2f} {r['idle_gap_ms']:>7.2f} "
            f"{r['roofline_fraction']:>8.1%} {r['device_roofline_fraction']:>8.1%} "
            f"{r['first_step_s_incl_compile']:>10.1f}")


def format_profile(row: dict) -> str:
    p = row["profile"]
    parts = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in p["categories_us"].items() if v >= 1)
    return (f"batch {row['batch']}: device busy {p['busy_us'] / 1e3:.2f} ms over a {p['span_us'] / 1e3:.2f} ms span, "
            f"{p['launches']:.0f} kernels; ms by category: {parts}")
