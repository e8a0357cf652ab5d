"""Ablation of the decode step's structure on one GPU, all variants in one process (random Qwen3-8B weights).

    PYTHONPATH=. python scripts/decode_variants.py --batch 1 64 256 --ctx 1024 --json out.json

Times the jitted forward + greedy argmax over a random-filled paged pool (Mosaic decode kernel) for:
``scan`` (layer-stacked weights under ``lax.scan``: the layout before the serving params), ``scan+dsf`` (the same
with XLA's dynamic-slice fusion), ``unrolled`` (``forward_paged`` over per-layer fused weights, XLA defaults),
``no-remat`` (rematerialization pass off) and ``no-remat+cublas`` (also no Triton GEMMs: the engine's decode of 64
rows and more). Programs compile in parallel (a variant XLA cannot compile is an error row); each row gets the
kernel breakdown of ``zipage_jax.benchmarks.profiling``. The rows in two interleaved half-batches, with and without
their attention on a second stream, were measured here once and removed (BENCHMARKS.md: slower, and the stream
variant does not compile).
"""

import argparse
import concurrent.futures
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES, hbm_peak_bytes_per_s
from zipage_jax.benchmarks.profiling import kernel_breakdown
from zipage_jax.layers.attention import resolve_backend
from zipage_jax.models import PagedBatch, forward_paged, to_serving, weights
from zipage_jax.models.rope import rope_cos_sin
from zipage_jax.models.transformer import _mlp, _qkv, final_logits, rms_norm

NO_REMAT = {"xla_disable_hlo_passes": "rematerialization"}
ENGINE = {**NO_REMAT, "xla_gpu_enable_triton_gemm": False}  # what the engine compiles decode of >= 64 rows with
VARIANTS = {  # name: (layout, compiler options)
    "scan": ("stacked", None),
    "scan+dsf": ("stacked", {"xla_gpu_enable_dynamic_slice_fusion": True}),
    "unrolled": ("serving", None),
    "no-remat": ("serving", NO_REMAT),
    "no-remat+cublas": ("serving", ENGINE),
}


def forward_scan(params, cfg, k_pool, v_pool, batch, backend):
    """The paged forward as a ``lax.scan`` over layer-stacked weights (each layer's slice is copied)."""
    cos, sin = rope_cos_sin(batch.positions, cfg)
    sm_scale = cfg.head_dim ** -0.5

    def layer_step(carry, xs):
        x, k_pool, v_pool = carry
        layer, index = xs
        q, k, v = _qkv(layer, cfg, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin)
        k_pool, v_pool = backend.write_kv(k_pool, v_pool, index, batch.slot_mapping, k, v)
        attn = backend.decode(q, k_pool, v_pool, index, batch.kv_lens, batch.page_tables, sm_scale)
        x = x + attn.reshape(x.shape[0], cfg.q_size) @ layer.o_proj
        return (x + _mlp(layer, cfg, x), k_pool, v_pool), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, k_pool, v_pool), _ = jax.lax.scan(layer_step, (params.embed[batch.tokens], k_pool, v_pool),
                                          (params.layers, layer_ids))
    return final_logits(params, cfg, x), k_pool, v_pool


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--attention-backend", default="mosaic_decode")
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = MODEL_SHAPES[args.model_shape]
    dtype = jnp.dtype(cfg.dtype)
    backend = resolve_backend(args.attention_backend)
    page, ctx = args.page_size, args.ctx
    per_request = ctx // page + 1
    num_pages = max(args.batch) * per_request + 1
    stacked = weights.init_random_params(cfg, jax.random.key(0), dtype)
    serving = to_serving(stacked)
    params = {"stacked": stacked, "serving": serving}
    if not any(VARIANTS[v][0] == "stacked" for v in args.variants):
        del params["stacked"], stacked
    pool_shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page, cfg.head_dim)
    fill = jax.jit(lambda key: jax.random.normal(key, pool_shape, dtype))
    pools = [fill(jax.random.key(1)), fill(jax.random.key(2))]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params["serving"])) - params["serving"].embed.nbytes
    peak = hbm_peak_bytes_per_s(jax.devices()[0].device_kind)
    token_kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def batch_for(b):
        tables = 1 + np.arange(b * per_request, dtype=np.int32).reshape(b, per_request)
        return PagedBatch(tokens=jnp.arange(b, dtype=jnp.int32), positions=jnp.full((b,), ctx, jnp.int32),
                          slot_mapping=jnp.asarray(tables[:, ctx // page] * page + ctx % page),
                          kv_lens=jnp.full((b,), ctx + 1, jnp.int32), page_tables=jnp.asarray(tables),
                          logits_indices=jnp.arange(b, dtype=jnp.int32))

    def step_fn(layout):
        forward = {"stacked": forward_scan, "serving": forward_paged}[layout]

        def step(params, k_pool, v_pool, batch):
            logits, k_pool, v_pool = forward(params, cfg, k_pool, v_pool, batch, backend)
            return k_pool, v_pool, jnp.argmax(logits, axis=-1)
        return jax.jit(step, donate_argnums=(1, 2))

    jobs = [(name, b) for name in args.variants for b in args.batch]
    lowered = {(name, b): step_fn(VARIANTS[name][0]).lower(params[VARIANTS[name][0]], *pools, batch_for(b))
               for name, b in jobs}

    def compile_one(job):
        """``(job, executable or the compiler's error, seconds)``: a variant XLA cannot compile is a row, not a stop."""
        t = time.perf_counter()
        try:
            exe = lowered[job].compile(compiler_options=VARIANTS[job[0]][1])
        except jax.errors.JaxRuntimeError as error:
            exe = error
        return job, exe, time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        compiled = {job: (exe, s) for job, exe, s in executor.map(compile_one, jobs)}
    rows = []
    for (name, b), (exe, compile_s) in compiled.items():
        if isinstance(exe, Exception):
            rows.append(dict(variant=name, batch=b, error=f"{type(exe).__name__}: {exe}"[:500]))
            print(f"{name:>16} batch {b:>4}: ERROR {rows[-1]['error'][:200]}", flush=True)
            continue
        p, batch = params[VARIANTS[name][0]], batch_for(b)

        def run():
            pools[0], pools[1], tokens = exe(p, *pools, batch)
            return tokens

        jax.block_until_ready(run())
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(10):
                tokens = run()
            jax.block_until_ready(tokens)
            times.append((time.perf_counter() - start) / 10)
        ms = float(np.median(times)) * 1e3
        roofline = (weight_bytes + b * (ctx + 1) * token_kv_bytes) / (ms / 1e3) / peak
        rows.append(dict(variant=name, batch=b, ms=ms, roofline=roofline, compile_s=compile_s,
                         profile=kernel_breakdown(run)))
        print(f"{name:>16} batch {b:>4}: {ms:7.2f} ms, {roofline:6.1%} of the HBM roofline, "
              f"{rows[-1]['profile']['launches']:.0f} kernels, compiled in {compile_s:.1f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model_shape=args.model_shape, ctx=ctx, device=jax.devices()[0].device_kind, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
