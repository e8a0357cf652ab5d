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
  M + 1 pages: ``--aged-start`` brings many) and HBM roofline fraction (below); how steady it was (the drift of
  the running count and of pages per request, the spread of the rate over its second half) and where its time
  went, step by step (``steady_state``); and the yardstick: the engine's own decode step at the window's mean
  running rows and context, timed on the same engine after the window (``--capacity-steps``), and the window's
  tok/s as a share of it.

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
instead (``aged_start``: as many requests as the mode's engine holds at once caught mid-trace, their generated part
prefilled, the rest of the loop fresh, so no aged request waits to bring its long context into the window;
compressed mode prefills only the latest M + 1 pages of each trace, all its steady state holds) and starts the
window when that prefill is over. ``--time-budget`` fits one command, start-ups included,
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
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from zipage_jax.benchmarks.closed_loop import MODES, run_mode
from zipage_jax.benchmarks.throughput_report import format_report, plot, ratios
from zipage_jax.benchmarks.workloads import WORKLOADS, Workload, aged_start, make_workload
from zipage_jax.config import DEFAULT_MODEL, EngineConfig, add_engine_options, engine_kwargs


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
                        help="closed loop: enter it at its steady state, the requests a mode holds at once caught "
                             "mid-trace (their generated part prefilled; the rest of the loop fresh); the window "
                             "starts when that prefill is over (full KV otherwise needs a request lifetime, minutes, "
                             "to settle)")
    parser.add_argument("--capacity-steps", type=int, default=16,
                        help="closed loop: after the window, time this many decode steps at the window's mean "
                             "running rows and context on the same engine, the yardstick of its tok/s (0: off)")
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

    from zipage_jax.benchmarks.probes import HoldingScheduler
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
        return LLMEngine(config, params=params, scheduler_cls=HoldingScheduler)  # holds the capacity probe's rows

    for i, mode in enumerate(args.modes):
        now = time.perf_counter()
        deadline = None if args.time_budget is None else \
            now + (started + args.time_budget - now) / (len(args.modes) - i)
        report["results"].append(run_mode(mode, make_engine, workload, args.duration, not args.no_warmup,
                                          args.sample_interval_s, progress=lambda line: print(line, flush=True),
                                          concurrency=concurrency, deadline=deadline,
                                          budget_tokens=budget, aged=args.aged_start,
                                          capacity_steps=args.capacity_steps))
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
