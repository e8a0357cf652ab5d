"""Seconds to trace and lower every warm-up program of a compressed engine, per program, on random weights of the
``tiny`` shapes with ``--layers`` layers: what a cold start spends under the GIL before any compile, measurable on
the CPU.

    PYTHONPATH=. python3 scripts/trace_time.py --layers 36
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
args = parser.parse_args()
cfg = dataclasses.replace(MODEL_SHAPES["tiny"], num_layers=args.layers)
config = EngineConfig.from_kwargs("random:tiny", compression=True, page_size=16, max_num_seqs=64, max_model_len=512,
                                  max_num_batched_tokens=256, compilation_cache_dir=None, kv_budget_pages=4)
engine = LLMEngine(config, cfg, weights.init_random_params(cfg, jax.random.key(0), jnp.float32))
programs = engine.runner.warmup_programs()
start, seconds = time.perf_counter(), {}
for program in programs:
    t = time.perf_counter()
    program.jitted.lower(*jax.tree.map(_abstract, program.args), **program.static)
    seconds[program.name] = time.perf_counter() - t
print(f"{len(programs)} programs of a {args.layers}-layer model traced and lowered in {time.perf_counter() - start:.1f}s")
for name, s in seconds.items():
    print(f"  {s:5.2f}s  {name}")
