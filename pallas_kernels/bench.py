"""GPU benchmark of the paged attention kernels against jax's own and XLA's implementations, in one process.

``python -m pallas_kernels.bench --json out.json`` checks every implementation against the jnp reference
(relative error <= 1e-2, bf16) and times it over a grid of decode shapes (effective KV bandwidth = KV bytes
read / time, and TFLOP/s), then causal prefill of whole prompts (TFLOP/s, causal FLOPs counted exactly).
Timings chain ``reps`` calls inside one jitted loop (each call's output is the next call's query), so launch
gaps count but host dispatch does not. Implementations: the Mosaic GPU kernels, the Triton kernels (``triton``,
and ``triton_sm80`` compiled for Ampere; they need jax-triton), jax's Pallas-Triton ``paged_attention``
(decode), the XLA reference and cuDNN over dense copies of the KV.

The compression kernels are benchmarked inside the engine's compression step, against its jnp path, by the
engine's own compression benchmark (this package knows nothing of the engine).
"""

import argparse
import json
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_decode import paged_decode
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.reference import gather_request_kv, paged_decode_ref, ragged_prefill_ref

MAX_REL_ERR = 1e-2


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def time_chain(fn, q, state, reps, trials=3):
    """Median seconds per call of ``fn(q, state)`` (output shaped like q) over ``trials`` chains of ``reps`` calls.

    Arrays travel as jit arguments (never captured constants), and each call's output is the next query.
    """
    chain = jax.jit(lambda q0, st: jax.lax.fori_loop(0, reps, lambda _, x: fn(x, st).astype(x.dtype), q0))
    chain(q, state).block_until_ready()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        chain(q, state).block_until_ready()
        times.append((time.perf_counter() - start) / reps)
    return float(np.median(times))


def make_case(key, batch, ctx, page_size, num_q_heads, num_kv_heads, head_dim, num_layers=2):
    """A pool holding ``batch`` requests of ``ctx`` slots on shuffled pages, in layer 1 of ``num_layers``."""
    pages_per_row = ctx // page_size
    num_pages = batch * pages_per_row + 1
    k_key, v_key, q_key, perm_key = jax.random.split(key, 4)
    shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
    k_pool = jax.random.normal(k_key, shape, jnp.bfloat16)
    v_pool = jax.random.normal(v_key, shape, jnp.bfloat16)
    tables = (jax.random.permutation(perm_key, batch * pages_per_row) + 1).reshape(batch, pages_per_row)
    q = jax.random.normal(q_key, (batch, num_q_heads, head_dim), jnp.bfloat16)
    return q, k_pool, v_pool, tables.astype(jnp.int32)


# Triton rows: compiled for the present GPU, and for sm_80 (the Ampere code: mma.sync and cp.async, no wgmma or
# TMA) run on it, the nearest this bench gets to an A100 on an H200.
TRITON_TARGETS = {"triton": None, "triton_sm80": 80}


def triton_kernel(module, name):
    """A Triton kernel imported at first use, so a missing jax-triton is one row's error, not the run's."""
    import importlib
    return getattr(importlib.import_module(f"pallas_kernels.{module}"), name)


def implementations(layer, scale, page_size, pages_per_row, variants):
    """name -> (q, state) -> out; ``state`` holds the pools, lengths, tables and per-baseline layout copies."""
    impls = {}
    for name, kwargs in variants.items():
        impls[name] = (lambda kw: lambda q, st: paged_decode(
            q, st["k"], st["v"], layer, st["lens"], st["tables"], scale, **kw))(kwargs)
    for name, capability in TRITON_TARGETS.items():
        impls[name] = (lambda cc: lambda q, st: triton_kernel("triton_decode", "paged_decode")(
            q, st["k"], st["v"], layer, st["lens"], st["tables"], scale, compute_capability=cc))(capability)
    impls["xla_ref"] = lambda q, st: paged_decode_ref(q, st["k"], st["v"], layer, st["lens"], st["tables"], scale)

    from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged
    k_splits = math.gcd(pages_per_row, 16)
    per_block = math.gcd(pages_per_row // k_splits, max(1, 128 // page_size))
    impls["pallas_triton"] = lambda q, st: triton_paged.paged_attention(
        (q.astype(jnp.float32) * scale).astype(q.dtype), st["k_heads_first"], st["v_heads_first"], st["tables"],
        st["lens"], k_splits=k_splits, pages_per_compute_block=per_block)
    impls["cudnn_dense"] = lambda q, st: jax.nn.dot_product_attention(
        q[:, None], st["k_dense"], st["v_dense"], scale=scale, implementation="cudnn")[:, 0]
    return impls


def baseline_layouts(k_pool, v_pool, layer, tables):
    """Copies in the baselines' layouts, made once outside timing: [Hkv, pages, S, D] and dense [B, T, Hkv, D]."""
    return dict(
        k_heads_first=jnp.swapaxes(k_pool[layer], 0, 1), v_heads_first=jnp.swapaxes(v_pool[layer], 0, 1),
        k_dense=jnp.swapaxes(gather_request_kv(k_pool, layer, tables), 1, 2),
        v_dense=jnp.swapaxes(gather_request_kv(v_pool, layer, tables), 1, 2))


def bench_decode(args):
    num_q_heads, num_kv_heads, head_dim, layer = args.q_heads, args.kv_heads, args.head_dim, 1
    scale = head_dim ** -0.5
    variants = {"mosaic": {}}
    for spec in args.variants:
        block_kv, stages, splits = (int(x) for x in spec.split(":"))
        variants[f"mosaic_b{block_kv}_s{stages}_k{splits}"] = dict(
            block_kv=block_kv, num_stages=stages, num_splits=splits or None)
    rows = []
    key = jax.random.key(0)
    deadline = time.monotonic() + args.time_budget
    cases = [(p, c, b) for p in args.page for c in args.ctx for b in args.batch]
    for page_size, ctx, batch in cases:
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping page={page_size} ctx={ctx} batch={batch}", flush=True)
            continue
        key, case_key, len_key = jax.random.split(key, 3)
        q, k_pool, v_pool, tables = make_case(case_key, batch, ctx, page_size, num_q_heads, num_kv_heads,
                                              head_dim)
        state = dict(k=k_pool, v=v_pool, tables=tables, lens=jnp.full((batch,), ctx, jnp.int32),
                     **baseline_layouts(k_pool, v_pool, layer, tables))
        # Ragged physical lengths (not page multiples, some padding rows) for the kernel's own check.
        ragged = jax.random.randint(len_key, (batch,), 1, ctx + 1).at[::7].set(0).astype(jnp.int32)
        ragged_state = dict(state, lens=ragged)
        kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * 2
        flops = 4 * batch * num_q_heads * ctx * head_dim
        impls = implementations(layer, scale, page_size, tables.shape[1], variants)
        ref_fn = jax.jit(impls["xla_ref"])
        ref, ref_ragged = ref_fn(q, state), ref_fn(q, ragged_state)
        for name, fn in impls.items():
            row = dict(kernel="decode", impl=name, batch=batch, ctx=ctx, page=page_size,
                       q_heads=num_q_heads, kv_heads=num_kv_heads, head_dim=head_dim)

            def measure(row, name=name, fn=fn):
                jitted = jax.jit(fn)
                row["rel_err"] = rel_err(jitted(q, state), ref)
                if name.startswith(("mosaic", "triton")):
                    out = jitted(q, ragged_state)
                    row["rel_err_ragged"] = rel_err(out, ref_ragged)
                    row["ragged_empty_rows_zero"] = bool(
                        (np.asarray(out, np.float32)[np.asarray(ragged) == 0] == 0).all())
                reps = args.reps if name != "xla_ref" else max(2, args.reps // 5)
                sec = time_chain(fn, q, state, reps)
                row.update(ms=sec * 1e3, tb_s=kv_bytes / sec / 1e12, tflop_s=flops / sec / 1e12)
                row["ok"] = row["rel_err"] <= MAX_REL_ERR and row.get("rel_err_ragged", 0) <= MAX_REL_ERR \
                    and row.get("ragged_empty_rows_zero", True)

            rows.append(record(row, measure, args.verbose))
        del impls, q, k_pool, v_pool, tables, state, ragged_state
    return rows


def record(row: dict, measure, verbose: bool) -> dict:
    """Fill ``row`` by ``measure(row)``; a failing implementation is a result (its error), not a crash."""
    try:
        measure(row)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        if verbose:
            traceback.print_exc()
    print(json.dumps(row), flush=True)
    return row


def bench_prefill(args):
    """Causal prefill of ``--prefill-requests`` whole prompts of each ``--prefill-ctx`` length (no cached prefix)."""
    num_q_heads, num_kv_heads, head_dim, layer = args.q_heads, args.kv_heads, args.head_dim, 1
    scale, page_size, num_requests = head_dim ** -0.5, args.prefill_page, args.prefill_requests
    rows = []
    for ctx in args.prefill_ctx:
        key = jax.random.key(ctx)
        _, k_pool, v_pool, tables = make_case(key, num_requests, ctx, page_size, num_q_heads, num_kv_heads, head_dim)
        q = jax.random.normal(jax.random.fold_in(key, 1), (num_requests * ctx, num_q_heads, head_dim), jnp.bfloat16)
        lens = jnp.full((num_requests,), ctx, jnp.int32)
        cu = jnp.arange(num_requests + 1, dtype=jnp.int32) * ctx
        state = dict(k=k_pool, v=v_pool, tables=tables, lens=lens, cu=cu,
                     k_dense=jnp.swapaxes(gather_request_kv(k_pool, layer, tables), 1, 2),
                     v_dense=jnp.swapaxes(gather_request_kv(v_pool, layer, tables), 1, 2))
        flops = 4 * num_q_heads * head_dim * num_requests * ctx * (ctx + 1) // 2
        impls = {
            "mosaic": lambda q, st: ragged_prefill(q, st["k"], st["v"], layer, st["cu"], st["lens"], st["tables"],
                                                   scale),
            **{name: (lambda cc: lambda q, st: triton_kernel("triton_prefill", "ragged_prefill")(
                q, st["k"], st["v"], layer, st["cu"], st["lens"], st["tables"], scale, compute_capability=cc))(cc)
               for name, cc in TRITON_TARGETS.items()},
            "xla_ref": lambda q, st: ragged_prefill_ref(q, st["k"], st["v"], layer, st["cu"], st["lens"],
                                                        st["tables"], scale),
            "cudnn_dense": lambda q, st: jax.nn.dot_product_attention(
                q.reshape(num_requests, ctx, num_q_heads, head_dim), st["k_dense"], st["v_dense"], scale=scale,
                is_causal=True, implementation="cudnn").reshape(q.shape),
        }
        ref = jax.jit(impls["xla_ref"])(q, state)
        for name, fn in impls.items():
            row = dict(kernel="prefill", impl=name, batch=num_requests, ctx=ctx, page=page_size,
                       q_heads=num_q_heads, kv_heads=num_kv_heads, head_dim=head_dim)

            def measure(row, name=name, fn=fn):
                row["rel_err"] = rel_err(jax.jit(fn)(q, state), ref)
                sec = time_chain(fn, q, state, 2 if name == "xla_ref" else args.reps // 4 or 1)
                row.update(ms=sec * 1e3, tb_s=0.0, tflop_s=flops / sec / 1e12, ok=row["rel_err"] <= MAX_REL_ERR)

            rows.append(record(row, measure, args.verbose))
        del q, k_pool, v_pool, tables, state, ref
    return rows


def print_table(rows):
    header = (f"{'kernel':7} {'impl':26} {'B':>4} {'ctx':>5} {'S':>4} {'ms':>8} {'TB/s':>6} {'TFLOP/s':>8} "
              f"{'rel_err':>8} ok")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:7} {r['impl']:26} {r['batch']:4} {r['ctx']:5} {r['page']:4}  ERROR {r['error'][:80]}")
            continue
        print(f"{r['kernel']:7} {r['impl']:26} {r['batch']:4} {r['ctx']:5} {r['page']:4} {r['ms']:8.3f} "
              f"{r['tb_s']:6.2f} {r['tflop_s']:8.1f} {r['rel_err']:8.1e} {'yes' if r['ok'] else 'NO'}")


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="bench_kernels.json", help="where to write all rows")
    parser.add_argument("--ctx", type=ints, default=[2048, 4096, 8192])
    parser.add_argument("--batch", type=ints, default=[64, 128, 256])
    parser.add_argument("--page", type=ints, default=[64, 128, 256])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--variants", type=lambda s: s.split(",") if s else [], default=[],
                        help="extra decode configs block_kv:stages:splits (splits 0 = automatic), comma separated")
    parser.add_argument("--prefill-ctx", type=lambda s: ints(s) if s else [], default=[8192],
                        help="prompt lengths of the causal prefill rows (empty: no prefill rows)")
    parser.add_argument("--prefill-requests", type=int, default=1)
    parser.add_argument("--prefill-page", type=int, default=128)
    parser.add_argument("--time-budget", type=float, default=float("inf"),
                        help="seconds after which no new shape is started (the rows so far are still written)")
    parser.add_argument("--sections", type=lambda s: s.split(","), default=["decode", "prefill"],
                        help="comma-separated subset of decode,prefill (the compression kernels: the engine's "
                             "compression benchmark)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.sections) - {"decode", "prefill"}
    if unknown:
        raise ValueError(f"sections: unknown {sorted(unknown)}")
    print(f"devices: {jax.devices()}", flush=True)
    runs = dict(decode=bench_decode, prefill=bench_prefill)
    rows = []
    for section in args.sections:
        rows += runs[section](args)
    write_rows(args.json, rows)
    print_table(rows)
    return rows


def write_rows(path, rows):
    with open(path, "w") as f:
        json.dump(dict(devices=[str(d) for d in jax.devices()], jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
