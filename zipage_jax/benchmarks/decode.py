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

import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.hlo import collectives, pool_copies
from zipage_jax.benchmarks.model_shapes import (
    HBM_PEAK_BYTES_PER_S,
    MODEL_SHAPES,
    kv_bytes_per_token,
    weight_bytes_per_step,
)
from zipage_jax.benchmarks.profiling import kernel_breakdown
from zipage_jax.config import EngineConfig
from zipage_jax.core.request import Request
from zipage_jax.core.scheduler import SchedulerOutput
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.worker.model_runner import ModelRunner


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
        return self.dispatch(*self.inputs)[0].ids

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
    config = EngineConfig(model=f"random:{model_shape}", dtype=dtype, page_size=page_size,
                          max_model_len=max_model_len, max_num_seqs=max_batch,
                          max_num_batched_tokens=prefill_tokens, max_num_prefill_seqs=prefill_seqs,
                          attention_backend=attention_backend, seed=seed,
                          enable_prefix_caching=False, compilation_cache_dir=None,
                          tensor_parallel_size=tensor_parallel_size)
    t = time.perf_counter()
    # the pool is sized from the card (at most what every request's pages need): the weights go in already in
    # the serving layout, so no stacked copy is held while the plan reads what is in use
    engine = LLMEngine(config, model_cfg, weights.to_serving(
        weights.init_random_params(model_cfg, jax.random.key(seed), jnp.dtype(dtype)), tensor_parallel_size))
    num_pages = engine.num_pages
    if num_pages < max_batch * pages_per_seq + 1:
        raise ValueError(f"batch: {max_batch} requests of {max_model_len} tokens need {max_batch * pages_per_seq} "
                         f"pages; the KV pool the card leaves holds {num_pages - 1} (lower --batch or --ctx)")
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
        text = engine.runner.programs.compiled[hlo_program.key].as_text()
        hlo = dict(batch=batches[0], **pool_copies(text, shape, dtype), collectives=collectives(text))
        hlo["inspect_s"] = time.perf_counter() - t
    return make_report(results, hlo), engine


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
