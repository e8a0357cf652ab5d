"""What bounds concurrency in the long-reasoning regime (budget 2048 = 8 pages of 256), computed from the engine's
own memory plan for Qwen3-8B shapes on an 80 GB H100 and a 141 GB H200 (no GPU needed): the pool, the query rows,
``max_num_seqs``, and what full KV fits at the workload's mean context.

    PYTHONPATH=. python3 scripts/concurrency_ceiling.py [--mean-context 13400]
"""
import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES  # noqa: E402
from zipage_jax.config import EngineConfig  # noqa: E402
from zipage_jax.layers.attention import resolve_backend  # noqa: E402
from zipage_jax.worker import device_memory, kv_cache  # noqa: E402

CARDS = {"H100 80 GB": 85_520_809_984, "H200 141 GB": 150_110_011_392}  # what each reports in all


class Card:
    def __init__(self, total: int, in_use: int):
        self.stats = {"bytes_limit": int(0.9 * total), "bytes_in_use": in_use}

    def memory_stats(self):
        return dict(self.stats)


parser = argparse.ArgumentParser()
parser.add_argument("--mean-context", type=int, default=13_400, help="tokens a full-KV request holds on average")
args = parser.parse_args()
qwen = MODEL_SHAPES["qwen3-8b"]
weight_bytes = 16_381_517_208  # Qwen3-8B in bf16, from its shapes
allocator = device_memory.Allocator(0.9, "set to gpu_memory_utilization=0.9")
print(f"{'card':12s} {'max_num_seqs':>12s} {'pool pages':>10s} {'query rows':>10s} {'compressed':>10s} "
      f"{'bound':>14s} {'full KV @ mean':>14s}")
for card, total in CARDS.items():
    for max_num_seqs in (256, 384, 512):
        c = EngineConfig.from_kwargs("unused", compression=True, page_size=256, kv_budget_pages=8,
                                     max_num_seqs=max_num_seqs)
        plan = kv_cache.plan_memory(c, qwen, jnp.bfloat16, qwen.max_position_embeddings, resolve_backend("mosaic"),
                                    device=Card(total, weight_bytes), allocator=allocator, weights_bytes=weight_bytes)
        compressed = plan.max_compressed_concurrency
        bound = "max_num_seqs" if compressed >= max_num_seqs else "pool / (M+1)"
        full = (plan.num_pages - 1) // -(-args.mean_context // 256)
        print(f"{card:12s} {max_num_seqs:12d} {plan.num_pages:10d} {plan.num_query_rows:10d} "
              f"{min(compressed, max_num_seqs):10d} {bound:>14s} {full:14d}")
