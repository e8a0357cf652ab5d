"""What bounds a compressed engine's concurrency on a card, from the engine's own memory plan (no GPU needed):
`python -m zipage_jax.bench concurrency`.

    python -m zipage_jax.bench concurrency [--model-shape qwen3-8b] [--page-size 256] [--kv-budget-pages 8] \\
        [--max-num-seqs 256 384 512] [--mean-context 13400]

For each card (an 80 GB H100 and a 141 GB H200, as each reports its memory) and each ``max_num_seqs``: the KV pool
and query rows the plan gives at the default ``gpu_memory_utilization`` of 0.9, the compressed requests that fit
(each holds at most ``M + 1`` pages), whether the pool or ``max_num_seqs`` binds them, and how many full-KV requests
fit at a mean context of ``--mean-context`` tokens (the long-reasoning workload's, by default).
"""

import argparse
import math
import os

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import EngineConfig
from zipage_jax.layers.attention import resolve_backend
from zipage_jax.models import weights
from zipage_jax.worker import device_memory, kv_cache

CARDS = {"H100 80 GB": 85_520_809_984, "H200 141 GB": 150_110_011_392}  # what each reports in all
UTILIZATION = 0.9


class Card:
    """A device that reports a card's memory with the weights in use."""

    def __init__(self, total: int, in_use: int):
        self.stats = {"bytes_limit": int(UTILIZATION * total), "bytes_in_use": in_use}

    def memory_stats(self):
        return dict(self.stats)


def ceilings(model_shape: str = "qwen3-8b", page_size: int = 256, kv_budget_pages: int = 8,
             max_num_seqs=(256, 384, 512), mean_context: int = 13_400, kv_cache_dtype: str = "auto") -> list[dict]:
    """One row per card and ``max_num_seqs``."""
    import jax.numpy as jnp

    cfg = MODEL_SHAPES[model_shape]
    weight_bytes = sum(math.prod(shape) for shape in weights.param_shapes(cfg).values() if shape is not None) * 2
    allocator = device_memory.Allocator(UTILIZATION, f"set to gpu_memory_utilization={UTILIZATION}")
    rows = []
    for card, total in CARDS.items():
        for seqs in max_num_seqs:
            config = EngineConfig.from_kwargs("unused", compression=True, page_size=page_size,
                                              kv_budget_pages=kv_budget_pages, max_num_seqs=seqs,
                                              kv_cache_dtype=kv_cache_dtype)
            plan = kv_cache.plan_memory(config, cfg, jnp.bfloat16, cfg.max_position_embeddings,
                                        resolve_backend("mosaic"), device=Card(total, weight_bytes),
                                        allocator=allocator, weights_bytes=weight_bytes)
            compressed = plan.max_compressed_concurrency
            rows.append(dict(card=card, max_num_seqs=seqs, pool_pages=plan.num_pages, query_rows=plan.num_query_rows,
                             compressed=min(compressed, seqs),
                             bound="max_num_seqs" if compressed >= seqs else "pool / (M+1)",
                             full_kv_at_mean=(plan.num_pages - 1) // -(-mean_context // page_size)))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench concurrency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--kv-budget-pages", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256, 384, 512])
    parser.add_argument("--mean-context", type=int, default=13_400, help="tokens a full-KV request holds on average")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the pool's pages: auto (bf16) or fp8 (one byte a value)")
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plan needs no device: keep jax off the GPU
    rows = ceilings(args.model_shape, args.page_size, args.kv_budget_pages, args.max_num_seqs, args.mean_context,
                    args.kv_cache_dtype)
    print(f"{'card':12s} {'max_num_seqs':>12s} {'pool pages':>10s} {'query rows':>10s} {'compressed':>10s} "
          f"{'bound':>14s} {'full KV @ mean':>14s}")
    for r in rows:
        print(f"{r['card']:12s} {r['max_num_seqs']:12d} {r['pool_pages']:10d} {r['query_rows']:10d} "
              f"{r['compressed']:10d} {r['bound']:>14s} {r['full_kv_at_mean']:14d}")
    return rows
