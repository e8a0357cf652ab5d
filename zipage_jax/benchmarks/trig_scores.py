"""What the query-free "triattention" scores cost against the other policies' scoring and a decode step, at the
shipped model's shapes (or qwen3-8b's), jnp path (reference backend), any device:

    JAX_PLATFORMS=cpu python -m zipage_jax.bench trig-scores --batch 64 --budget 6
    python -m zipage_jax.bench trig-scores --shape qwen3-8b --batch 64,256 --budget 16 --page 16

Rows (ms): one layer's scores (triattention's ``paged_trig_scores``; zipage's jnp window attention and lightning
redundancy), the whole jitted compression step per policy, and one decode step (``forward_paged``) of the same
requests over the same pool. A request compresses once per page, so a policy's compression costs
``compress / page_size`` of a decode step of the same batch: printed as ``per decode step``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from zipage_jax.benchmarks.compression import compression_case, decode_step, seconds_per_layer_call, time_donated
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.compression.query_centres import QueryCentres
from zipage_jax.compression.scoring import paged_lightning_row_sums, paged_window_attention
from zipage_jax.compression.step import compress
from zipage_jax.compression.trig_scores import paged_trig_scores
from zipage_jax.config import DEFAULT_MODEL, ScoringConfig
from zipage_jax.layers.attention import resolve_backend
from zipage_jax.models import ModelConfig, to_serving, weights
from zipage_jax.models.rope import inverse_frequencies

POLICIES = {"zipage": ScoringConfig(), "window": ScoringConfig(eviction_policy="window"),
            "triattention": ScoringConfig(eviction_policy="triattention")}


def random_centres(model_cfg, key) -> QueryCentres:
    shape = (model_cfg.num_layers, model_cfg.num_heads, model_cfg.head_dim)
    mean = jax.random.normal(key, shape, jnp.float32)
    return QueryCentres(mean, jnp.abs(mean[..., : shape[2] // 2]) + 1.0,
                        jnp.asarray(inverse_frequencies(shape[2], model_cfg.rope_theta, model_cfg.rope_scaling)))


def bench(model_cfg, batch, budget, page, reps, dtype) -> dict:
    backend = resolve_backend("reference")
    case = compression_case(jax.random.key(0), model_cfg, batch, budget, page, budget + 1, dtype)
    plan, scale, layers = case["plan"], model_cfg.head_dim ** -0.5, model_cfg.num_layers
    centres = random_centres(model_cfg, jax.random.key(1))
    num_live = plan.num_src_pages * page
    row = {"batch": batch, "budget": budget, "page": page, "live_slots": (budget + 1) * page}
    queries = case["query_cache"][0, :batch]  # [B, W, Hq, D]
    row["score_layer_ms_triattention"] = 1e3 * seconds_per_layer_call(
        lambda layer, k: paged_trig_scores(k, layer, plan.src_tables, centres, plan.logical_lens - 1), reps, layers,
        case["k_pool"])
    row["score_layer_ms_zipage_window_attention"] = 1e3 * seconds_per_layer_call(
        lambda layer, k: paged_window_attention(k, layer, plan.src_tables, num_live, queries, scale), reps, layers,
        case["k_pool"])
    row["score_layer_ms_zipage_lightning_redundancy"] = 1e3 * seconds_per_layer_call(
        lambda layer, k: paged_lightning_row_sums(k, layer, plan.src_tables, plan.num_src_pages, 0.5), reps, layers,
        case["k_pool"])
    for name, cfg in POLICIES.items():
        step = jax.jit(lambda k, v, s, q, plan, c, cfg=cfg: compress(k, v, s, q, plan, cfg, scale, backend, c),
                       donate_argnums=(0, 1, 2))
        state = (case["k_pool"], case["v_pool"], case["score_cache"])
        sec, state = time_donated(step, state, reps, case["query_cache"], plan, centres)
        case["k_pool"], case["v_pool"], case["score_cache"] = state
        row[f"compress_ms_{name}"] = sec * 1e3
    params = to_serving(weights.init_random_params(model_cfg, jax.random.key(2), dtype))
    decode, step = decode_step(model_cfg, plan, batch, budget, page, backend)
    sec, _ = time_donated(step, (case["k_pool"], case["v_pool"], decode.tokens), reps, params, decode)
    row["decode_step_ms"] = sec * 1e3
    for name in POLICIES:
        row[f"per_decode_step_{name}"] = row[f"compress_ms_{name}"] / page / row["decode_step_ms"]
    trig_all_layers = row["score_layer_ms_triattention"] * layers
    row["per_decode_step_trig_scores_alone"] = trig_all_layers / page / row["decode_step_ms"]
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zipage_jax.bench trig-scores", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="shipped", choices=["shipped", *MODEL_SHAPES])
    p.add_argument("--batch", default="64", help="comma-separated request counts")
    p.add_argument("--budget", type=int, default=6, help="M: pages kept per request")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    model_cfg = ModelConfig.from_pretrained(DEFAULT_MODEL) if args.shape == "shipped" else MODEL_SHAPES[args.shape]
    model_cfg = dataclasses.replace(model_cfg, max_position_embeddings=max(model_cfg.max_position_embeddings, 4096))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        row = {"shape": args.shape, "device": jax.devices()[0].device_kind,
               **bench(model_cfg, batch, args.budget, args.page, args.reps, jnp.dtype(args.dtype))}
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows
