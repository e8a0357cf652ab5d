"""GPU benchmark of the paged attention kernels against jax's own and XLA's implementations, in one process.

``python -m pallas_kernels.bench --json out.json`` checks every implementation against the jnp reference
(relative error <= 1e-2, bf16) and times it over a grid of decode shapes (effective KV bandwidth = KV bytes
read / time, and TFLOP/s), then causal prefill of whole prompts packed into one call (by default the two
targets: one 8k prompt, and 64 prompts of 128-2048 tokens; TFLOP/s counting the causal work only), ending with
a summary of each prefill implementation's TFLOP/s per case, as a share of the first case's and of cuDNN's.
Timings chain ``reps`` calls inside one jitted loop (each call's output is the next call's query), so launch
gaps count but host dispatch does not. Implementations: the Mosaic GPU kernels (the prefill one also with its
levers off in turn, ``PREFILL_FORMS``: ``mosaic_round_robin``, ``mosaic_wide_diagonal``, both ``mosaic_before``),
the Triton kernels (``triton``, and ``triton_sm80`` compiled for Ampere; they need jax-triton), jax's
Pallas-Triton ``paged_attention`` (decode), the XLA reference and cuDNN over dense copies of the KV.

The compression kernels are benchmarked inside the engine's compression step, against its jnp path, by the
engine's own compression benchmark (this package knows nothing of the engine).
"""

import argparse
import functools
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import is_fp8, round_queries, upcast
from pallas_kernels.paged_decode import paged_decode
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.reference import gather_request_kv, masked_attention, paged_decode_ref, ragged_prefill_ref

MAX_REL_ERR = 1e-2
# The prefill targets: one 8k prompt, and 64 prompts of 128-2048 tokens packed into one call.
PREFILL_CASES = ["1x8192", "64x128-2048"]
# The prefill kernel's levers switched off, each a row `mosaic_<name>` timed beside the default `mosaic`.
PREFILL_FORMS = {"round_robin": dict(item_order="round_robin"), "wide_diagonal": dict(half_diagonal=False),
                 "before": dict(item_order="round_robin", half_diagonal=False)}


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


def decode_variants(specs) -> dict:
    """Specs -> row name -> keyword arguments of ``paged_decode``: ``mosaic`` (its defaults), then per spec
    ``block_kv:stages:splits`` (splits 0: automatic), then FP8's flag ``:upcast`` (``fp8_qk=False``: exact queries,
    K upcast to 16 bits for the q @ k^T wgmma)."""
    flags = {"upcast": ("fp8_qk", False)}
    variants = {"mosaic": {}}
    for spec in specs:
        block_kv, stages, splits, *extra = spec.split(":")
        if not set(extra) <= set(flags):
            raise ValueError(f"variants: {spec!r} is not block_kv:stages:splits[:upcast]")
        variants[f"mosaic_b{block_kv}_s{stages}_k{splits}" + "".join(f"_{x}" for x in extra)] = dict(
            block_kv=int(block_kv), num_stages=int(stages), num_splits=int(splits) or None,
            **dict(flags[x] for x in extra))
    return variants


def bench_decode(args):
    num_q_heads, num_kv_heads, head_dim, layer = args.q_heads, args.kv_heads, args.head_dim, 1
    scale = head_dim ** -0.5
    variants = decode_variants(args.variants)
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
        k_pool, v_pool = k_pool.astype(args.kv_dtype), v_pool.astype(args.kv_dtype)  # N(0, 1): in FP8's range
        fp8 = is_fp8(args.kv_dtype)
        state = dict(k=k_pool, v=v_pool, tables=tables, lens=jnp.full((batch,), ctx, jnp.int32),
                     **({} if fp8 else baseline_layouts(k_pool, v_pool, layer, tables)))
        # Ragged physical lengths (not page multiples, some padding rows) for the kernel's own check.
        ragged = jax.random.randint(len_key, (batch,), 1, ctx + 1).at[::7].set(0).astype(jnp.int32)
        ragged_state = dict(state, lens=ragged)
        kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * k_pool.dtype.itemsize  # bytes the kernel reads
        flops = 4 * batch * num_q_heads * ctx * head_dim
        impls = implementations(layer, scale, page_size, tables.shape[1], variants)
        if fp8:  # only the Mosaic kernel and the reference read FP8 pages
            impls = {name: fn for name, fn in impls.items() if name.startswith("mosaic") or name == "xla_ref"}
        exact_fn = jax.jit(impls["xla_ref"])
        if fp8:  # what the engine computes over FP8 pools: e4m3 queries (kv_quant.round_queries)
            impls["xla_ref"] = lambda q, st: paged_decode_ref(round_queries(q, num_kv_heads), st["k"], st["v"], layer,
                                                              st["lens"], st["tables"], scale)
        ref_fn = jax.jit(impls["xla_ref"])
        refs = {False: (ref_fn(q, state), ref_fn(q, ragged_state))}
        refs[True] = (exact_fn(q, state), exact_fn(q, ragged_state)) if fp8 else refs[False]
        for name, fn in impls.items():
            row = dict(kernel="decode", impl=name, batch=batch, ctx=ctx, page=page_size,
                       q_heads=num_q_heads, kv_heads=num_kv_heads, head_dim=head_dim,
                       kv_dtype=jnp.dtype(args.kv_dtype).name)

            def measure(row, name=name, fn=fn):
                ref, ref_ragged = refs[variants.get(name, {}).get("fp8_qk") is False]
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
        impls = q = k_pool = v_pool = tables = state = ragged_state = None  # this case's arrays go before the next
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


def parse_prefill_case(spec: str) -> tuple[int, int, int]:
    """``NxL``: N prompts of L tokens; ``NxA-B``: N prompts of lengths drawn uniformly from [A, B] (seeded)."""
    try:
        count, _, span = spec.partition("x")
        low, _, high = span.partition("-")
        case = int(count), int(low), int(high or low)
    except ValueError:
        case = None
    if case is None or case[0] < 1 or not 1 <= case[1] <= case[2]:
        raise ValueError(f"prefill case {spec!r}: expected NxL or NxA-B with 1 <= A <= B")
    return case


def prefill_lengths(spec: str) -> np.ndarray:
    count, low, high = parse_prefill_case(spec)
    return np.random.default_rng(0).integers(low, high + 1, size=count).astype(np.int32)


def causal_flops(lengths, num_q_heads, head_dim) -> int:
    """The causal work only: query i of a prompt attends to i + 1 keys (two matmuls of 2 FLOPs a multiply-add)."""
    return sum(4 * num_q_heads * head_dim * int(n) * (int(n) + 1) // 2 for n in lengths)


def dense_causal_ref(q_pad, k_dense, v_dense, lengths, scale):
    """The reference's masked softmax, one prompt at a time over the padded layout ``[R, L, H, D]`` (the oracle of
    cases too big for ``ragged_prefill_ref``'s ``O(T x K)`` scratch)."""
    num_kv_heads, head_dim = k_dense.shape[2], k_dense.shape[3]
    slots = jnp.arange(q_pad.shape[1])

    def one(args):
        q, k, v, n = args
        qg = q.reshape(q.shape[0], num_kv_heads, -1, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, L, D]
        mask = (slots[None, :] <= slots[:, None]) & (slots[None, :] < n)
        out = masked_attention(qg, k.swapaxes(0, 1), v.swapaxes(0, 1), mask, scale)
        return out.transpose(2, 0, 1, 3).reshape(q.shape).astype(q.dtype)

    return jax.lax.map(one, (q_pad, k_dense, v_dense, lengths))


def prefill_variants(specs) -> dict:
    """Specs -> row name -> keyword arguments of ``ragged_prefill``: ``mosaic`` (its defaults), then per spec a
    form of ``PREFILL_FORMS`` (row ``mosaic_<form>``) or ``block_kv:stages`` (row ``mosaic_b<block_kv>_s<stages>``)."""
    variants = {"mosaic": {}}
    for spec in specs:
        if spec in PREFILL_FORMS:
            variants[f"mosaic_{spec}"] = PREFILL_FORMS[spec]
            continue
        block_kv, stages = (int(x) for x in spec.split(":"))
        variants[f"mosaic_b{block_kv}_s{stages}"] = dict(block_kv=block_kv, num_stages=stages)
    return variants


def bench_prefill(args):
    """Causal prefill of whole prompts packed into one call, for each ``--prefill-cases`` spec (no cached prefix):
    the FlashAttention-3-structured kernel (and its variants), Triton, cuDNN
    over dense padded copies (told each prompt's length) and, for one prompt, the XLA reference. FP8 pools
    (``--kv-dtype``): the Mosaic kernel over them, cuDNN over dense bf16 copies of their values."""
    num_q_heads, num_kv_heads, head_dim, layer = args.q_heads, args.kv_heads, args.head_dim, 1
    scale, page_size = head_dim ** -0.5, args.prefill_page
    fp8 = is_fp8(args.kv_dtype)
    rows = []
    for spec in args.prefill_cases:
        lengths = prefill_lengths(spec)
        num_requests, num_tokens = len(lengths), int(lengths.sum())
        pages = -(-lengths // page_size)
        width = int(pages.max())
        key = jax.random.key(num_tokens)
        k_key, v_key, q_key, perm_key = jax.random.split(key, 4)
        shape = (2, int(pages.sum()) + 1, num_kv_heads, page_size, head_dim)
        k_pool = jax.random.normal(k_key, shape, jnp.bfloat16).astype(args.kv_dtype)  # N(0, 1): in FP8's range
        v_pool = jax.random.normal(v_key, shape, jnp.bfloat16).astype(args.kv_dtype)
        ids = np.asarray(jax.random.permutation(perm_key, int(pages.sum())) + 1)
        tables = np.zeros((num_requests, width), np.int32)
        tables[np.arange(width) < pages[:, None]] = ids  # each prompt's pages, shuffled; the rest: page 0
        tables = jnp.asarray(tables)
        q = jax.random.normal(q_key, (num_tokens, num_q_heads, head_dim), jnp.bfloat16)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        lens = jnp.asarray(lengths)
        # The padded layout cuDNN and the oracle read: [R, width * S, H, D], prompt r in rows [0, lengths[r]).
        owner = np.repeat(np.arange(num_requests), lengths)
        local = np.arange(num_tokens) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        q_pad = jnp.zeros((num_requests, width * page_size, num_q_heads, head_dim), q.dtype).at[owner, local].set(q)
        state = dict(k=k_pool, v=v_pool, tables=tables, lens=lens, cu=cu,
                     k_dense=jnp.swapaxes(upcast(gather_request_kv(k_pool, layer, tables)), 1, 2),
                     v_dense=jnp.swapaxes(upcast(gather_request_kv(v_pool, layer, tables)), 1, 2))
        flops = causal_flops(lengths, num_q_heads, head_dim)

        def packed(fn):
            return lambda q, st: fn(q, st["k"], st["v"], layer, st["cu"], st["lens"], st["tables"], scale)

        impls = {name: (packed(functools.partial(ragged_prefill, **kw)), q)
                 for name, kw in prefill_variants(args.prefill_variants).items()}
        for name, cc in {} if fp8 else TRITON_TARGETS.items():  # Triton's kernel has no FP8 path
            impls[name] = (packed(lambda *a, cc=cc: triton_kernel("triton_prefill", "ragged_prefill")(
                *a, compute_capability=cc)), q)
        if num_requests == 1 and not fp8:
            impls["xla_ref"] = (packed(ragged_prefill_ref), q)
        impls["cudnn_dense"] = (lambda q, st: jax.nn.dot_product_attention(
            q, st["k_dense"], st["v_dense"], scale=scale, is_causal=True, query_seq_lengths=st["lens"],
            key_value_seq_lengths=st["lens"], implementation="cudnn"), q_pad)
        ref = jax.jit(dense_causal_ref)(q_pad, state["k_dense"], state["v_dense"], lens, scale)[owner, local]
        for name, (fn, x) in impls.items():
            row = dict(kernel="prefill", impl=name, case=spec, batch=num_requests, ctx=int(lengths.max()),
                       tokens=num_tokens, page=page_size, q_heads=num_q_heads, kv_heads=num_kv_heads,
                       head_dim=head_dim, kv_dtype=jnp.dtype(args.kv_dtype).name)

            def measure(row, name=name, fn=fn, x=x):
                out = jax.jit(fn)(x, state)
                row["rel_err"] = rel_err(out[owner, local] if x is q_pad else out, ref)
                sec = time_chain(fn, x, state, 2 if name == "xla_ref" else args.reps // 4 or 1)
                row.update(ms=sec * 1e3, tb_s=0.0, tflop_s=flops / sec / 1e12, ok=row["rel_err"] <= MAX_REL_ERR)

            rows.append(record(row, measure, args.verbose))
        if args.prefill_profile:  # one more call of the default kernel, its Mosaic GPU profiler trace on disk
            path = os.path.join(args.prefill_profile, spec)
            os.makedirs(path, exist_ok=True)
            profiled = packed(functools.partial(ragged_prefill, profile_dir=path))
            record(dict(kernel="prefill", impl="mosaic_profile", case=spec, trace_dir=path),
                   lambda row: jax.block_until_ready(profiled(q, state)), args.verbose)
        q = q_pad = k_pool = v_pool = tables = state = ref = None  # this case's arrays go before the next
    return rows


def prefill_summary(rows) -> list[str]:
    """Per implementation, each case's TFLOP/s and its share of the first case's (the ragged-vs-one-prompt target),
    and its share of cuDNN's in the same case."""
    by_case = {}
    for r in rows:
        if r["kernel"] == "prefill" and "tflop_s" in r:
            by_case.setdefault(r["case"], {})[r["impl"]] = r["tflop_s"]
    if not by_case:
        return []
    first = next(iter(by_case))
    lines = []
    for impl in dict.fromkeys(i for case in by_case.values() for i in case):
        parts = []
        for case, tflops in by_case.items():
            if impl not in tflops:
                continue
            part = f"{case} {tflops[impl]:.1f}"
            if case != first and impl in by_case[first]:
                part += f" ({tflops[impl] / by_case[first][impl]:.0%} of {first})"
            if "cudnn_dense" in tflops and impl != "cudnn_dense":
                part += f" [{tflops[impl] / tflops['cudnn_dense']:.0%} of cudnn]"
            parts.append(part)
        lines.append(f"prefill TFLOP/s {impl:24} " + "; ".join(parts))
    return lines


def print_table(rows):
    header = (f"{'kernel':7} {'impl':26} {'B':>4} {'ctx':>5} {'S':>4} {'ms':>8} {'TB/s':>6} {'TFLOP/s':>8} "
              f"{'rel_err':>8} ok")  # prefill: B prompts of up to ctx tokens
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
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn", "float8_e5m2"],
                        help="the pool's dtype (FP8: the Mosaic kernels, the decode reference and cuDNN's prefill "
                             "over dense bf16 copies; GB/s count the bytes read)")
    parser.add_argument("--variants", type=lambda s: s.split(",") if s else [], default=[],
                        help="extra decode configs block_kv:stages:splits[:upcast] (splits 0 = automatic; FP8: "
                             "upcast, exact queries and K upcast for q @ k^T, checked against exact queries' "
                             "reference; the others against the reference over e4m3 queries), comma separated")
    parser.add_argument("--prefill-cases", type=lambda s: s.split(",") if s else [], default=PREFILL_CASES,
                        help="prompts packed into one prefill call, comma separated: NxL (N prompts of L tokens) or "
                             "NxA-B (lengths uniform in [A, B], seeded)")
    parser.add_argument("--prefill-variants", type=lambda s: s.split(",") if s else [], default=list(PREFILL_FORMS),
                        help="rows of the prefill kernel beside its default, comma separated: a lever switched off ("
                             + ", ".join(PREFILL_FORMS) + ") or block_kv:stages; default: every lever off in turn")
    parser.add_argument("--prefill-profile", metavar="DIR",
                        help="also write a Mosaic GPU profiler trace of the prefill kernel per case to DIR/CASE "
                             "(every CTA's warpgroups: use small cases, e.g. --prefill-cases 1x2048)")
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
    for spec in args.prefill_cases:
        parse_prefill_case(spec)
    prefill_variants(args.prefill_variants)  # a bad spec fails here, not after the decode section
    print(f"devices: {jax.devices()}", flush=True)
    runs = dict(decode=bench_decode, prefill=bench_prefill)
    rows = []
    for section in args.sections:
        rows += runs[section](args)
    write_rows(args.json, rows)
    print_table(rows)
    for line in prefill_summary(rows):
        print(line)
    return rows


def write_rows(path, rows):
    with open(path, "w") as f:
        json.dump(dict(devices=[str(d) for d in jax.devices()], jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
