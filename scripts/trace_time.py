"""Seconds to trace and lower every warm-up program of a compressed engine, per program: what a cold start spends
under the GIL before any compile, measurable on the CPU.

``--platform cuda`` lowers for the GPU instead (jax lowers for a platform it does not run on), with the Mosaic GPU
kernels: the lowering of a Qwen3-8B engine's programs (36 layers, 32 query / 8 KV heads of 128; thin hidden and
vocabulary sizes, which tracing does not depend on), at the default configuration.

    PYTHONPATH=. python3 scripts/trace_time.py --layers 36
    PYTHONPATH=. python3 scripts/trace_time.py --platform cuda
"""
import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.worker.programs import _abstract

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=36)
parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
if args.platform == "cuda":
    cfg = dataclasses.replace(MODEL_SHAPES["qwen3-8b"], num_layers=args.layers, vocab_size=1024, hidden_size=256,
                              intermediate_size=256)
    options = dict(attention_backend="mosaic", kv_cache_memory_bytes=7 << 30)  # 184 pages: a 40960-token request
else:
    cfg = dataclasses.replace(MODEL_SHAPES["tiny"], num_layers=args.layers)
    options = dict(page_size=16, max_num_seqs=64, max_model_len=512, max_num_batched_tokens=256, kv_budget_pages=4)
config = EngineConfig.from_kwargs("random:shapes", compression=True, compilation_cache_dir=None, **options)
dtype = jnp.dtype(cfg.dtype)
engine = LLMEngine(config, cfg, weights.init_random_params(cfg, jax.random.key(0), dtype))
programs = engine.runner.warmup_programs()
start, seconds = time.perf_counter(), {}
for program in programs:
    t = time.perf_counter()
    traced = program.jitted.trace(*jax.tree.map(_abstract, program.args), **program.static)
    t1 = time.perf_counter()
    traced.lower(lowering_platforms=(args.platform,))
    seconds[program.name] = (t1 - t, time.perf_counter() - t1)
print(f"{len(programs)} programs of a {args.layers}-layer model traced and lowered for {args.platform} in "
      f"{time.perf_counter() - start:.1f}s (trace {sum(a for a, _ in seconds.values()):.1f}s, lower "
      f"{sum(b for _, b in seconds.values()):.1f}s)")
for name, (a, b) in seconds.items():
    print(f"  trace {a:5.2f}s  lower {b:5.2f}s  {name}")
