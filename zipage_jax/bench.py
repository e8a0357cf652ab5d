"""Engine benchmarks with random weights of real model shapes (no checkpoint, no tokenizer needed).

    python -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 256 --ctx 1024 --steps 64 \
        --json out.json

``decode`` prefills every request with ``ctx`` random prompt tokens, then, for each batch size (starting from
that same prefilled state), runs the engine's step loop (``LLMEngine.step``: schedule → dispatch → read back the
previous step) and reports:

- engine tokens/s: ``batch * steps / wall`` of ``steps`` pipelined engine steps;
- device step time: the same decode step dispatched back to back with no host work in between;
- host time per step: wall time of one engine step call, excluding the time it blocks reading back the
  previous result; split into the time inside the jitted call (dispatch, plus any wait the runtime imposes
  there) and the Python work around it (scheduling, packing, read-back bookkeeping);
- idle gap: engine step time minus device step time (time the GPU waits for the host per step);
- roofline fraction: bytes one decode step must read (weights + live KV) / step time / HBM peak.
"""

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax import kv_cache, weights
from zipage_jax.config import ADMISSIONS, EngineConfig, add_engine_options, engine_kwargs
from zipage_jax.engine import LLMEngine, MetricsHistory
from zipage_jax.models.config import ModelConfig
from zipage_jax.profiling import kernel_breakdown
from zipage_jax.request import Request
from zipage_jax.runner import ModelRunner
from zipage_jax.sampling import SamplingParams
from zipage_jax.scheduler import SchedulerOutput

HBM_PEAK_BYTES_PER_S = 4.8e12  # H200

MODEL_SHAPES = {
    "qwen3-8b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=False, qk_norm=True,
                            max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-32b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                             num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                             rope_theta=1e6, tie_word_embeddings=False, qk_norm=True,
                             max_position_embeddings=40960, dtype="bfloat16"),
    "qwen3-0.6b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1e6, tie_word_embeddings=True, qk_norm=True,
                              max_position_embeddings=40960, dtype="bfloat16"),
    "tiny": ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                        tie_word_embeddings=False, qk_norm=True, max_position_embeddings=4096, dtype="float32"),
}


def weight_bytes_per_step(params, model_cfg: ModelConfig, batch: int) -> int:
    """Parameter bytes a decode step reads: everything but the embedding table, of which it gathers ``batch``
    rows (unless the embedding is tied, then the whole table is the LM head)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if model_cfg.tie_word_embeddings:
        return total
    return total - params.embed.nbytes + batch * params.embed.nbytes // model_cfg.vocab_size


def kv_bytes_per_token(model_cfg: ModelConfig, dtype) -> int:
    return kv_cache.page_bytes(model_cfg, 1, dtype)


def pool_copies(hlo_text: str, pool_shape: tuple, dtype) -> dict:
    """What the compiled step does with the KV pool (copies are the bad ones) and its host-synchronizing ops.

    Lists the opcodes of the optimized-HLO instructions whose result has the KV pool's shape.
    A fusion is named by the root opcode of its fused computation, e.g. ``fusion[dynamic-update-slice]``
    (an in-place update) vs ``fusion[copy]``.
    """
    type_name = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[jnp.dtype(dtype).name]
    shape = f"{type_name}[{','.join(map(str, pool_shape))}]"
    instruction = re.compile(r"=\s*" + re.escape(shape) + r"(?:\{[^}]*\})?\s+([\w-]+)\(")
    roots, computation = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$", line)
        if header:
            computation = header.group(1)
        root = re.search(r"ROOT\s+%?[\w.-]+\s*=\s*\S+(?:\{[^}]*\})?\s+([\w-]+)\(", line)
        if root and computation:
            roots[computation] = root.group(1)
    ops = {}
    for line in hlo_text.splitlines():
        m = instruction.search(line)
        if not m:
            continue
        op = m.group(1)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.-]+)", line)
            op = f"fusion[{roots.get(called.group(1), '?') if called else '?'}]"
        ops[op] = ops.get(op, 0) + 1
    count = lambda op: len(re.findall(r"\s" + op + r"\(", hlo_text))  # noqa: E731
    return dict(pool_shape=shape, ops_producing_pool_shape=ops,
                pool_copies=sum(n for op, n in ops.items() if "copy" in op),
                all_copy_ops=count("copy") + count("copy-start"),
                # on GPU each conditional (and a while loop without a known trip count) reads its predicate
                # back to the host, so the dispatching thread waits for the device there
                conditionals=count("conditional"), while_loops=count("while"),
                while_loops_with_known_trip_count=len(re.findall(r"known_trip_count", hlo_text)))


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter",
               "collective-broadcast")
_COLLECTIVE = re.compile(r"(?<![%\w.-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> dict:
    """How many of each cross-device collective a compiled program holds (an asynchronous ``-start`` / ``-done``
    pair counts once). Under tensor parallelism a step should hold two all-reduces a layer and nothing else."""
    found = {}
    for op in _COLLECTIVE.findall(hlo_text):
        found[op] = found.get(op, 0) + 1
    return found


class _Recorder:
    """Watches the engine's runner: remembers each step's scheduler output and the last decode dispatch (to
    replay it), and times the compiled calls and the waits for the read-back."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.execute = runner, runner.execute
        self.dispatch, self.run = runner._dispatch, runner.programs.run
        self.scheduled: SchedulerOutput | None = None
        self.inputs = self.program = None
        self.jit_call_s = self.blocked_s = 0.0
        runner.execute, runner._dispatch = self._record_execute, self._record_dispatch
        runner.programs.run = self._record_run

    def _record_execute(self, scheduled):
        self.scheduled = scheduled
        handles = self.execute(scheduled)
        for handle in handles:
            handle.result = self._timed_result(handle.result)
        return handles

    def _timed_result(self, result):
        def timed():
            start = time.perf_counter()
            out = result()
            self.blocked_s += time.perf_counter() - start
            return out
        return timed

    def _record_dispatch(self, inputs, requests, kind, num_tokens, rows):
        if kind == "decode":
            self.inputs = (inputs, requests, kind, num_tokens, rows)
        return self.dispatch(inputs, requests, kind, num_tokens, rows)

    def _record_run(self, program, *args):
        if program.key[0] == "step" and self.inputs is not None:
            self.program = program
        start = time.perf_counter()
        out = self.run(program, *args)
        self.jit_call_s += time.perf_counter() - start  # dispatch; any wait on the device here is not Python work
        return out

    def engine_step(self, engine: LLMEngine) -> tuple[SchedulerOutput, float, float]:
        """One engine step: its scheduler output, the host seconds it took apart from waiting for the read-back,
        and that wait."""
        blocked = self.blocked_s
        start = time.perf_counter()
        engine.step(only_finished=True)
        blocked = self.blocked_s - blocked
        return self.scheduled, time.perf_counter() - start - blocked, blocked

    def step(self):
        return self.dispatch(*self.inputs).tokens

    def replay(self, n: int) -> float:
        """Seconds per step of ``n`` back-to-back dispatches of the last decode step (device-bound time)."""
        jax.block_until_ready(self.step())
        start = time.perf_counter()
        for _ in range(n):
            tokens = self.step()
        jax.block_until_ready(tokens)
        return (time.perf_counter() - start) / n


def drain(engine: LLMEngine):
    """Read back the steps in flight without dispatching more: the running requests sit out one step."""
    running, engine.scheduler.running = engine.scheduler.running, []
    engine.step(only_finished=True)
    engine.scheduler.running = running


def decode_benchmark(model_shape: str, batches: list[int], ctx: int, steps: int, attention_backend: str = "reference",
                     page_size: int = 256, dtype: str = "bfloat16", prefill_tokens: int = 8192,
                     prefill_seqs: int = 8, warmup_steps: int = 3, seed: int = 0, inspect_hlo: bool = True,
                     profile: bool = False, progress=print, on_result=None, tensor_parallel_size: int = 1):
    """Run the decode benchmark; returns (report dict, the engine with its requests).

    With ``tensor_parallel_size`` devices the rooflines are those of all their HBM together (each device reads
    its shards; the replicated embedding and LM head, read by every device, count once), and the compiled
    step's collectives are reported; the profile is the first device's.

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
    model_cfg = MODEL_SHAPES[model_shape]
    max_batch = max(batches)
    max_model_len = ctx + 1 + warmup_steps + steps
    pages_per_seq = -(-max_model_len // page_size)
    num_pages = max_batch * pages_per_seq + 1
    config = EngineConfig(model=f"random:{model_shape}", dtype=dtype, page_size=page_size,
                          max_model_len=max_model_len, max_num_seqs=max_batch,
                          max_num_batched_tokens=prefill_tokens, max_num_prefill_seqs=prefill_seqs,
                          num_gpu_pages_override=num_pages, attention_backend=attention_backend, seed=seed,
                          enable_prefix_caching=False, compilation_cache_dir=None,
                          tensor_parallel_size=tensor_parallel_size)
    t = time.perf_counter()
    params = weights.init_random_params(model_cfg, jax.random.key(seed), jnp.dtype(dtype))
    jax.block_until_ready(params)
    engine = LLMEngine(config, model_cfg, params)
    del params  # the engine holds the serving layout
    progress(f"random params + KV pool ({num_pages} pages of {page_size}): {time.perf_counter() - t:.1f}s")
    recorder = _Recorder(engine.runner)

    rng = np.random.default_rng(seed)
    # more tokens than the benchmark decodes, so no request finishes: each batch size rewinds them
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_model_len)
    requests = [Request(f"bench-{i}", rng.integers(0, model_cfg.vocab_size, size=ctx).tolist(), sampling, i, seed=i)
                for i in range(max_batch)]
    for r in requests:
        engine.add(r)
    t = time.perf_counter()
    prefill_steps = 0
    while engine.scheduler.waiting or engine.scheduler.running:
        engine.step(only_finished=True)
        prefill_steps += 1
        # a prefilled request sits out (parked with its pages) until its batch decodes
        engine.scheduler.running = [r for r in engine.scheduler.running if r.num_computed_tokens < ctx]
    drain(engine)
    prefill_s = time.perf_counter() - t
    progress(f"prefill {max_batch} x {ctx} tokens in {prefill_steps} steps: {prefill_s:.1f}s (incl. compile)")

    per_token_kv = kv_bytes_per_token(model_cfg, dtype)
    hbm_peak = HBM_PEAK_BYTES_PER_S * tensor_parallel_size

    def make_report(results, hlo):
        return dict(
            benchmark="decode", model_shape=model_shape, device=str(jax.devices()[0]),
            device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            config=dict(ctx=ctx, steps=steps, warmup_steps=warmup_steps, page_size=page_size, dtype=dtype,
                        attention_backend=attention_backend, num_pages=num_pages, max_model_len=max_model_len,
                        tensor_parallel_size=tensor_parallel_size,
                        prefill_tokens=prefill_tokens, prefill_seqs=prefill_seqs,
                        num_params=sum(x.size for x in jax.tree.leaves(engine.params))),
            hbm_peak_bytes_per_s=HBM_PEAK_BYTES_PER_S, prefill_s_incl_compile=prefill_s,
            results=list(results), hlo=hlo)

    results, hlo, hlo_program = [], None, None
    for batch in batches:
        members = requests[:batch]
        engine.scheduler.running = list(members)  # the others stay parked with their pages
        for r in members:  # rewind to the prefilled state, so every batch size decodes at the same context
            del r.output_token_ids[1:], r.output_logprobs[1:]
            r.num_computed_tokens = ctx
        recorder.inputs = recorder.program = None
        t = time.perf_counter()
        engine.step(only_finished=True)
        drain(engine)
        compile_s = time.perf_counter() - t
        for _ in range(warmup_steps - 1):
            engine.step(only_finished=True)
        drain(engine)
        host, blocked, kv_tokens = [], [], []
        recorder.jit_call_s = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            scheduled, h, b = recorder.engine_step(engine)
            assert len(scheduled.decodes) == batch and not scheduled.prefills
            host.append(h)
            blocked.append(b)
            kv_tokens.append(sum(r.num_computed_tokens for r in scheduled.decodes))
        drain(engine)
        engine_step_s = (time.perf_counter() - start) / steps
        jit_call_s = recorder.jit_call_s / steps
        device_step_s = recorder.replay(steps)
        hlo_program = hlo_program or recorder.program
        breakdown = kernel_breakdown(recorder.step) if profile else None
        weight_bytes = weight_bytes_per_step(engine.params, model_cfg, batch)
        kv_bytes = float(np.mean(kv_tokens)) * per_token_kv
        step_bytes = weight_bytes + kv_bytes
        row = dict(
            batch=batch, mean_kv_len=float(np.mean(kv_tokens)) / batch, steps=steps,
            engine_step_ms=engine_step_s * 1e3, device_step_ms=device_step_s * 1e3,
            host_ms_per_step=float(np.mean(host)) * 1e3, blocked_ms_per_step=float(np.mean(blocked)) * 1e3,
            jit_call_ms_per_step=jit_call_s * 1e3, python_ms_per_step=(float(np.mean(host)) - jit_call_s) * 1e3,
            idle_gap_ms=max(0.0, engine_step_s - device_step_s) * 1e3,
            tokens_per_s=batch / engine_step_s, device_tokens_per_s=batch / device_step_s,
            weight_bytes=weight_bytes, kv_bytes=kv_bytes,
            kv_bytes_gathered_by_reference=batch * pages_per_seq * page_size * per_token_kv,
            roofline_fraction=step_bytes / engine_step_s / hbm_peak,
            device_roofline_fraction=step_bytes / device_step_s / hbm_peak,
            first_step_s_incl_compile=compile_s, profile=breakdown)
        results.append(row)
        progress(format_row(row))
        if on_result:
            on_result(make_report(results, None))
    engine.scheduler.running = list(requests)
    if inspect_hlo:  # last, so a slow recompile never costs the measurements
        t = time.perf_counter()
        kv_heads = model_cfg.num_kv_heads // tensor_parallel_size  # the compiled step holds one shard's pool
        shape = (model_cfg.num_layers, num_pages, kv_heads, page_size, model_cfg.head_dim)
        text = engine.runner.programs.compiled(hlo_program.key).as_text()
        hlo = dict(batch=batches[0], **pool_copies(text, shape, dtype), collectives=collectives(text))
        hlo["inspect_s"] = time.perf_counter() - t
    return make_report(results, hlo), engine


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
            sizing=engine.sizing.as_dict(), history=engine.metrics_history(),
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


HEADER = (f"{'batch':>5} {'kv_len':>7} {'tok/s':>9} {'engine ms':>9} {'device ms':>9} {'host ms':>8} "
          f"{'in jit':>7} {'python':>7} {'gap ms':>7} {'roofline':>8} {'dev roof':>8} {'1st step s':>10}")


def startup_benchmark(model: str, engine_options: dict, workload: int = 24, seed: int = 0) -> dict:
    """Start-up of the public API, as a user meets it: ``LLM(model, **engine_options)``, then ``warmup()``, then
    a mixed workload (prompt lengths, greedy and sampled rows, seeds, ``n``, ``min_tokens``, logprobs) that must
    compile nothing. Run it twice with the same ``compilation_cache_dir`` for the cold and the warm figure."""
    from zipage_jax import LLM

    start = time.perf_counter()
    llm = LLM(model, **engine_options)
    init_s = time.perf_counter() - start
    warmup = llm.warmup(use_tqdm=False)
    ready_s = time.perf_counter() - start
    compiles = llm.metrics()["num_compiles"]
    rng = np.random.default_rng(seed)
    vocab = llm.engine.model_cfg.vocab_size
    longest = min(3000, llm.engine.max_model_len - 400)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(5, longest, size=workload)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, top_k=40 if i % 2 else 0, min_p=0.05 if i % 4 == 1 else 0.0,
                             max_tokens=int(m), seed=i, min_tokens=2, n=1 + i % 2, logprobs=True, ignore_eos=True)
              for i, m in enumerate(rng.integers(2, 300, size=workload))]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return dict(benchmark="startup", model=model, engine_options=engine_options, device=str(jax.devices()[0]),
                jax_version=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                init_s=init_s, programs=warmup["programs"], compile_s=warmup["compile_s"], ready_s=ready_s,
                compiles_after_warmup=llm.metrics()["num_compiles"] - compiles, workload_requests=workload,
                workload_s=time.perf_counter() - t,
                workload_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs))


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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    decode = sub.add_parser("decode", help="decode throughput of the full-KV engine")
    decode.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    decode.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    decode.add_argument("--ctx", type=int, default=1024, help="prompt tokens prefilled per request")
    decode.add_argument("--steps", type=int, default=64, help="measured decode steps per batch size")
    decode.add_argument("--warmup-steps", type=int, default=3)
    decode.add_argument("--attention-backend", default="reference")
    decode.add_argument("--tensor-parallel-size", type=int, default=1)
    decode.add_argument("--page-size", type=int, default=256)
    decode.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    decode.add_argument("--prefill-tokens", type=int, default=8192, help="token budget of a prefill step")
    decode.add_argument("--prefill-seqs", type=int, default=8, help="requests per prefill step")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--no-hlo", action="store_true", help="skip the compiled-HLO inspection")
    decode.add_argument("--profile", action="store_true",
                        help="trace the device step and record where its time goes (per kernel and category)")
    decode.add_argument("--json", help="write the report here")
    sched = sub.add_parser("scheduling", help="compressed requests under memory pressure: async vs sync "
                                              "compression, reserved vs hybrid vs constrained admission")
    sched.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    sched.add_argument("--requests", type=int, default=256)
    sched.add_argument("--prompt-len", type=int, default=512)
    sched.add_argument("--output-len", type=int, default=4096)
    sched.add_argument("--kv-budget-pages", type=int, default=8)
    sched.add_argument("--page-size", type=int, default=256)
    sched.add_argument("--num-pages", type=int, help="pool size in pages (default: sized from device memory)")
    sched.add_argument("--num-query-rows", type=int, help="C (default: sized from memory)")
    sched.add_argument("--max-num-seqs", type=int, default=256)
    sched.add_argument("--attention-backend", default="reference")
    sched.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sched.add_argument("--prefill-tokens", type=int, default=8192)
    sched.add_argument("--prefill-seqs", type=int, default=8)
    sched.add_argument("--metrics-interval-steps", type=int, default=16)
    sched.add_argument("--variants", nargs="+", default=[f"{m}-{a}" for m, a in SCHEDULING_VARIANTS],
                       help="MODE-ADMISSION, MODE in async/sync, ADMISSION in hybrid/constrained")
    sched.add_argument("--seed", type=int, default=0)
    sched.add_argument("--no-warmup", action="store_true", help="compile on first use (smoke runs)")
    sched.add_argument("--compilation-cache-dir", default=os.path.join("~", ".cache", "zipage_jax", "xla"),
                       help="persistent XLA cache shared by the variants ('' = off)")
    sched.add_argument("--json", help="write the report here")
    sched.add_argument("--png", help="write the metrics plot here")
    startup = sub.add_parser("startup", help="LLM(...) + warmup() time, programs, and compiles after warm-up")
    startup.add_argument("--model", required=True, help="HF checkpoint directory")
    startup.add_argument("--workload", type=int, default=24, help="requests of the mixed workload after warm-up")
    startup.add_argument("--json", help="append the report here (one JSON object a line)")
    startup.set_defaults(engine_fields=add_engine_options(startup))
    from zipage_jax import serving_bench, throughput_bench

    throughput_bench.add_arguments(sub.add_parser("throughput", help="compressed vs full-KV engine throughput on a "
                                                                     "named workload (and an HF peer)"))
    serving_bench.add_arguments(sub.add_parser("serving", help="latency and goodput of a running server at given "
                                                               "request rates; soak with client cancellations"))
    args = parser.parse_args(argv)
    if args.benchmark == "throughput":
        return throughput_bench.main(args), None
    if args.benchmark == "serving":
        return serving_bench.main(args), None
    if args.benchmark == "scheduling":
        return _scheduling_main(args)
    if args.benchmark == "startup":
        report = startup_benchmark(args.model, engine_kwargs(args, args.engine_fields), args.workload)
        print(f"LLM() {report['init_s']:.1f}s + warmup() {report['compile_s']:.1f}s = ready in "
              f"{report['ready_s']:.1f}s; {report['programs']} programs; {report['compiles_after_warmup']} compiles "
              f"during a mixed workload of {report['workload_requests']} requests")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(report) + "\n")
        return report, None
    print(f"decode benchmark: {args.model_shape} on {jax.devices()[0].device_kind}, batches {args.batch}")

    def write(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    report, engine = decode_benchmark(
        args.model_shape, args.batch, args.ctx, args.steps, args.attention_backend, args.page_size, args.dtype,
        args.prefill_tokens, args.prefill_seqs, args.warmup_steps, args.seed, not args.no_hlo, args.profile,
        progress=lambda line: print(line, flush=True), on_result=write, tensor_parallel_size=args.tensor_parallel_size)
    print(HEADER)
    for row in report["results"]:
        print(format_row(row))
    for row in report["results"]:
        if row["profile"]:
            print(format_profile(row))
    if report["hlo"]:
        print("pool-shaped ops in the compiled decode step:", report["hlo"]["ops_producing_pool_shape"],
              "| copies of the pool:", report["hlo"]["pool_copies"], "| collectives:", report["hlo"]["collectives"])
    write(report)
    return report, engine


def _scheduling_main(args):
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


if __name__ == "__main__":
    main()
