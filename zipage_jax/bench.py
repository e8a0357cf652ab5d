"""Engine benchmarks with random weights of real model shapes (no checkpoint, no tokenizer needed).

    python -m zipage_jax.bench decode --model-shape qwen3-8b --batch 1 64 256 --ctx 1024 --steps 64 \
        --json out.json

``decode`` prefills every request with ``ctx`` random prompt tokens, then, for each batch size (starting from
that same prefilled state), runs the engine's step loop (schedule → dispatch → read back the previous step)
and reports:

- engine tokens/s: ``batch * steps / wall`` of ``steps`` pipelined engine steps;
- device step time: the same decode step dispatched back to back with no host work in between;
- host time per step: wall time of one engine step call, excluding the time it blocks reading back the
  previous result; split into the time inside the jitted call (dispatch, plus any wait the runtime imposes
  there) and the Python work around it (scheduling, packing, read-back bookkeeping);
- idle gap: engine step time minus device step time (time the GPU waits for the host per step);
- roofline fraction: bytes one decode step must read (weights + live KV) / step time / HBM peak.
"""

import argparse
import dataclasses
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax import kv_cache, sharding, weights
from zipage_jax.attention import resolve_backend
from zipage_jax.block_manager import BlockManager
from zipage_jax.config import EngineConfig
from zipage_jax.models.config import ModelConfig
from zipage_jax.request import PENDING, Request
from zipage_jax.runner import ModelRunner
from zipage_jax.sampling import SamplingParams
from zipage_jax.scheduler import Scheduler

HBM_PEAK_BYTES_PER_S = 4.8e12  # H200

MODEL_SHAPES = {
    "qwen3-8b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
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


class BenchEngine:
    """Block manager + scheduler + runner built from a ModelConfig and params, stepped like ``LLMEngine.step``.

    Differences from the engine, all host-side and small: no tokenizer / detokenizer and no stop checks (a
    request's lifetime is its ``max_tokens``, which the scheduler honours), and prefill steps always use the
    largest bucket so a benchmark compiles one prefill shape.
    """

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, params, num_pages: int):
        self.config = config
        self.model_cfg = model_cfg
        mesh = sharding.make_mesh(config.tensor_parallel_size, model_cfg)
        self.params = sharding.shard_params(params, mesh)
        self.runner = ModelRunner(config, model_cfg, self.params, num_pages, config.max_model_len,
                                  jnp.dtype(config.dtype), resolve_backend(config.attention_backend), mesh)
        self.block_manager = BlockManager(num_pages, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_num_prefill_seqs)
        self.in_flight = []

    def step(self):
        """One engine step; returns (scheduler output, host seconds, seconds blocked on the previous step)."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        handles = []
        if scheduled.decodes:
            handles.append(self.runner.decode(scheduled.decodes))
        if scheduled.prefills:
            handles.append(self.runner.prefill(scheduled.prefills, self.config.max_num_batched_tokens,
                                               self.config.max_num_prefill_seqs))
        for handle in handles:
            for request in handle.requests:
                if request is not None:
                    request.output_token_ids.append(PENDING)
        blocked = self._read_back()
        self.in_flight = handles
        return scheduled, time.perf_counter() - start - blocked, blocked

    def drain(self):
        """Wait for the steps in flight and accept their tokens."""
        self._read_back()
        self.in_flight = []

    def _read_back(self) -> float:
        blocked = 0.0
        for handle in self.in_flight:
            t = time.perf_counter()
            tokens, _ = handle.result()
            blocked += time.perf_counter() - t
            for row, request in enumerate(handle.requests):
                if request is not None:
                    request.output_token_ids[request.output_token_ids.index(PENDING)] = int(tokens[row])
                    self.block_manager.register_full_pages(request)
        return blocked


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


class _Recorder:
    """Remembers the last decode dispatch of the runner: its inputs (to replay) and argument shapes (to lower)."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.dispatch, self.jitted = runner, runner._dispatch, runner._jitted
        self.inputs = self.shapes = None
        self.jit_call_s = 0.0
        runner._dispatch, runner._jitted = self._record_dispatch, self._record_jitted

    def _record_dispatch(self, inputs, requests, kind, num_tokens):
        if kind == "decode":
            self.inputs = (inputs, requests, kind, num_tokens)
        return self.dispatch(inputs, requests, kind, num_tokens)

    def _record_jitted(self, *args, **kwargs):
        if self.shapes is None and self.inputs is not None:
            shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
            self.shapes = (jax.tree.map(shape, args), kwargs)
        start = time.perf_counter()
        out = self.jitted(*args, **kwargs)
        self.jit_call_s += time.perf_counter() - start  # dispatch; any wait on the device here is not Python work
        return out

    def replay(self, n: int) -> float:
        """Seconds per step of ``n`` back-to-back dispatches of the last decode step (device-bound time)."""
        handle = self.dispatch(*self.inputs)
        jax.block_until_ready(handle.tokens)
        start = time.perf_counter()
        for _ in range(n):
            handle = self.dispatch(*self.inputs)
        jax.block_until_ready(handle.tokens)
        return (time.perf_counter() - start) / n

    def compiled_text(self) -> str:
        args, kwargs = self.shapes
        return self.jitted.lower(*args, **kwargs).compile().as_text()


def decode_benchmark(model_shape: str, batches: list[int], ctx: int, steps: int, attention_backend: str = "reference",
                     block_size: int = 256, dtype: str = "bfloat16", prefill_tokens: int = 8192,
                     prefill_seqs: int = 8, warmup_steps: int = 3, seed: int = 0, inspect_hlo: bool = True,
                     progress=print, on_result=None):
    """Run the decode benchmark; returns (report dict, the BenchEngine with its requests).

    ``on_result(partial_report)`` is called after each batch size, so a run cut short keeps what it measured.
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
    pages_per_seq = -(-max_model_len // block_size)
    num_pages = max_batch * pages_per_seq + 1
    config = EngineConfig(model=f"random:{model_shape}", dtype=dtype, block_size=block_size,
                          max_model_len=max_model_len, max_num_seqs=max_batch,
                          max_num_batched_tokens=prefill_tokens, max_num_prefill_seqs=prefill_seqs,
                          num_gpu_blocks_override=num_pages, attention_backend=attention_backend, seed=seed,
                          enable_prefix_caching=False, compilation_cache_dir=None)
    t = time.perf_counter()
    params = weights.init_random_params(model_cfg, jax.random.key(seed), jnp.dtype(dtype))
    jax.block_until_ready(params)
    engine = BenchEngine(config, model_cfg, params, num_pages)
    progress(f"random params + KV pool ({num_pages} pages of {block_size}): {time.perf_counter() - t:.1f}s")

    rng = np.random.default_rng(seed)
    first = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    requests = [Request(f"bench-{i}", rng.integers(0, model_cfg.vocab_size, size=ctx).tolist(), first, i, seed=i)
                for i in range(max_batch)]
    for r in requests:
        engine.scheduler.add(r)
    t = time.perf_counter()
    prefill_steps = 0
    while not engine.step()[0].empty:
        prefill_steps += 1
    engine.drain()
    prefill_s = time.perf_counter() - t
    progress(f"prefill {max_batch} x {ctx} tokens in {prefill_steps} steps: {prefill_s:.1f}s (incl. compile)")

    per_token_kv = kv_bytes_per_token(model_cfg, dtype)

    def make_report(results, hlo):
        return dict(
            benchmark="decode", model_shape=model_shape, device=str(jax.devices()[0]),
            device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            config=dict(ctx=ctx, steps=steps, warmup_steps=warmup_steps, block_size=block_size, dtype=dtype,
                        attention_backend=attention_backend, num_pages=num_pages, max_model_len=max_model_len,
                        prefill_tokens=prefill_tokens, prefill_seqs=prefill_seqs,
                        num_params=sum(x.size for x in jax.tree.leaves(engine.params))),
            hbm_peak_bytes_per_s=HBM_PEAK_BYTES_PER_S, prefill_s_incl_compile=prefill_s,
            results=list(results), hlo=hlo)

    results, hlo, first_recorder = [], None, None
    all_running = list(engine.scheduler.running)
    for batch in batches:
        members = requests[:batch]
        engine.scheduler.running = list(members)  # the others stay parked with their pages
        for r in members:  # rewind to the prefilled state, so every batch size decodes at the same context
            r.output_token_ids, r.num_computed_tokens = r.output_token_ids[:1], ctx
            r.sampling_params = dataclasses.replace(r.sampling_params,
                                                    max_tokens=len(r.output_token_ids) + warmup_steps + steps)
        recorder = _Recorder(engine.runner)
        t = time.perf_counter()
        engine.step()
        engine.drain()
        compile_s = time.perf_counter() - t
        for _ in range(warmup_steps - 1):
            engine.step()
        engine.drain()
        host, blocked, kv_tokens = [], [], []
        recorder.jit_call_s = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            scheduled, h, b = engine.step()
            assert len(scheduled.decodes) == batch and not scheduled.prefills
            host.append(h)
            blocked.append(b)
            kv_tokens.append(sum(r.num_computed_tokens for r in scheduled.decodes))
        engine.drain()
        engine_step_s = (time.perf_counter() - start) / steps
        jit_call_s = recorder.jit_call_s / steps
        device_step_s = recorder.replay(steps)
        first_recorder = first_recorder or recorder
        engine.runner._dispatch, engine.runner._jitted = recorder.dispatch, recorder.jitted
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
            kv_bytes_gathered_by_reference=batch * pages_per_seq * block_size * per_token_kv,
            roofline_fraction=step_bytes / engine_step_s / HBM_PEAK_BYTES_PER_S,
            device_roofline_fraction=step_bytes / device_step_s / HBM_PEAK_BYTES_PER_S,
            first_step_s_incl_compile=compile_s)
        results.append(row)
        progress(format_row(row))
        if on_result:
            on_result(make_report(results, None))
    engine.scheduler.running = all_running
    if inspect_hlo:  # last, so a slow recompile never costs the measurements
        t = time.perf_counter()
        shape = (model_cfg.num_layers, num_pages, model_cfg.num_kv_heads, block_size, model_cfg.head_dim)
        hlo = dict(batch=batches[0], **pool_copies(first_recorder.compiled_text(), shape, dtype))
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
    decode.add_argument("--block-size", type=int, default=256)
    decode.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    decode.add_argument("--prefill-tokens", type=int, default=8192, help="token budget of a prefill step")
    decode.add_argument("--prefill-seqs", type=int, default=8, help="requests per prefill step")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--no-hlo", action="store_true", help="skip the compiled-HLO inspection")
    decode.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    print(f"decode benchmark: {args.model_shape} on {jax.devices()[0].device_kind}, batches {args.batch}")

    def write(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    report, engine = decode_benchmark(
        args.model_shape, args.batch, args.ctx, args.steps, args.attention_backend, args.block_size, args.dtype,
        args.prefill_tokens, args.prefill_seqs, args.warmup_steps, args.seed, not args.no_hlo,
        progress=lambda line: print(line, flush=True), on_result=write)
    print(HEADER)
    for row in report["results"]:
        print(format_row(row))
    if report["hlo"]:
        print("pool-shaped ops in the compiled decode step:", report["hlo"]["ops_producing_pool_shape"],
              "| copies of the pool:", report["hlo"]["pool_copies"])
    write(report)
    return report, engine


if __name__ == "__main__":
    main()
