"""On the GPU machine: the memory plan of a default engine (Qwen3-8B shapes, random weights) against what the
device then uses. Prints the plan line, then after the warm-up and after decoding a full batch at the longest
context the pool allows per request: bytes in use and peak against the allocator's limit, so the headroom and the
scratch estimates can be judged. Then the explicit-pool checks: 40 GB starts, 60 GB is refused at once.

    PYTHONPATH=. python scripts/gpu_memory_plan.py [--model-shape qwen3-8b] [--ctx 4096]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import EngineConfig
from zipage_jax.core.request import Request
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams


def gib(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory(label: str):
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return print(f"{label}: the device reports no memory")
    print(f"{label}: in use {gib(stats['bytes_in_use'])}, peak {gib(stats['peak_bytes_in_use'])}, limit "
          f"{gib(stats['bytes_limit'])} (peak leaves {gib(stats['bytes_limit'] - stats['peak_bytes_in_use'])})",
          flush=True)


def engine_for(shape: str, **kwargs) -> LLMEngine:
    model_cfg = MODEL_SHAPES[shape]
    config = EngineConfig.from_kwargs(f"random:{shape}", compilation_cache_dir="/tmp/xla-cache", **kwargs)
    params = weights.to_serving(weights.init_random_params(model_cfg, jax.random.key(0), jnp.bfloat16))
    return LLMEngine(config, model_cfg, params)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-shape", default="qwen3-8b")
    parser.add_argument("--ctx", type=int, default=4096, help="prompt tokens of each request of the full batch")
    args = parser.parse_args()
    engine = engine_for(args.model_shape)  # the default configuration, as LLM() builds it
    print("plan:", engine.memory_plan.describe(), flush=True)
    memory("after start")
    t = time.perf_counter()
    print("warm-up:", engine.warmup(), f"{time.perf_counter() - t:.0f}s", flush=True)
    memory("after warm-up")
    rng = np.random.default_rng(0)
    batch = min(engine.config.max_num_seqs, (engine.num_pages - 1) // -(-(args.ctx + 64) // engine.config.page_size))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    for i in range(batch):
        engine.add(Request(f"r{i}", rng.integers(0, 1000, size=args.ctx).tolist(), params, i, seed=i))
    t, steps, peak = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)
        steps, peak = steps + 1, max(peak, engine.page_manager.num_used_pages)
    print(f"{batch} requests of {args.ctx} + 64 tokens: {steps} steps, {time.perf_counter() - t:.0f}s, "
          f"peak pages {peak} of {engine.num_pages - 1}", flush=True)
    memory("after the full batch")
    del engine
    for pool in (40 * 10**9, 60 * 10**9):
        t = time.perf_counter()
        try:
            explicit = engine_for(args.model_shape, kv_cache_memory_bytes=pool)
            print(f"kv_cache_memory_bytes={pool}: started ({explicit.memory_plan.describe()})", flush=True)
            del explicit
        except ValueError as error:
            print(f"kv_cache_memory_bytes={pool}: refused in {time.perf_counter() - t:.1f}s: {error}", flush=True)


if __name__ == "__main__":
    main()
