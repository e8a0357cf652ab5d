"""GPU benchmark of one compression of a batch of requests (docs/ARCHITECTURE.md, Compression) at a model's shapes,
with random weights and KV, in one process:

    python -m zipage_jax.bench compression --comp-batch 64,256 --comp-reps 5 --json out.json

The scoring kernels (window attention, lightning redundancy) against their jnp references (one layer), the
selection with the sorted and the kernel threshold (one layer), compaction variants (one layer), the whole jitted
compression step (kernels and jnp) against one decode forward of the same requests over the same pool, and the
scratch memory of each. Every row records its error instead of stopping the run. ``--interpret`` runs the
kernels in Mosaic GPU interpret mode (a CPU smoke test at tiny shapes). The attention kernels alone:
``python -m pallas_kernels.bench``.
"""

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.bench import MAX_REL_ERR, record, rel_err, write_rows
from pallas_kernels.compaction import compact_slots
from pallas_kernels.redundancy import lightning_row_sums
from pallas_kernels.redundancy import smem_bytes as redundancy_smem_bytes
from pallas_kernels.reference import gather_request_kv
from pallas_kernels.scoring import default_block_kv, scratch_bytes, smem_bytes, window_scores
from pallas_kernels.selection import selection_threshold
from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.compression.compaction import compact_slots as xla_compact_slots
from zipage_jax.compression.scoring import paged_window_attention, redundancy_row_sums
from zipage_jax.compression.selection import select_slots, sorted_threshold
from zipage_jax.compression.step import CompressionBatch, compress, layer_group
from zipage_jax.config import ScoringConfig
from zipage_jax.layers.attention import REFERENCE, AttentionBackend, resolve_backend
from zipage_jax.models import PagedBatch, forward_paged, to_serving, weights
from zipage_jax.worker import kv_cache

__all__ = ["MAX_REL_ERR", "main"]


def compression_shapes():
    """Model shapes of the compression rows: the engine bench's, plus a CPU-sized one the kernel accepts (D=64)."""
    return {"qwen3-8b": MODEL_SHAPES["qwen3-8b"],
            "tiny": dataclasses.replace(MODEL_SHAPES["tiny"], head_dim=64, dtype="bfloat16")}


def interpreted_kernels() -> AttentionBackend:
    """The Mosaic compression kernels in interpret mode: the kernel path of ``compress`` on CPU."""
    interpret = plgpu.InterpretGPUParams()
    return AttentionBackend(
        name="interpreted", window_scores=functools.partial(window_scores, interpret=interpret),
        lightning_row_sums=functools.partial(lightning_row_sums, interpret=interpret),
        selection_threshold=functools.partial(selection_threshold, interpret=interpret),
        compact_slots=functools.partial(compact_slots, interpret=interpret), fused_compression=True)


@functools.partial(jax.jit, donate_argnums=(2,))
def _fill_layer(key, layer, pool):
    noise = jax.random.normal(jax.random.fold_in(key, layer), pool.shape[1:], jnp.float32)
    return pool.at[layer].set(noise.astype(pool.dtype))


def random_pool(key, shape, dtype):
    """A random pool filled layer by layer (no full-size f32 temporary)."""
    pool = jnp.zeros(shape, dtype)
    for layer in range(shape[0]):
        pool = _fill_layer(key, jnp.int32(layer), pool)
    return pool


def decode_step(model_cfg, plan, batch: int, budget: int, page_size: int, backend):
    """A decode step of a compression case's ``batch`` requests over its pool (one token each, its K/V written
    in the page after their ``M + 1``): the batch and the jitted step ``(k, v, previous tokens, params, batch) ->
    (k, v, greedy tokens)``, the pools donated, the lm_head part of it."""
    last = (budget + 1) * page_size
    decode = PagedBatch(
        tokens=jnp.arange(batch, dtype=jnp.int32) % model_cfg.vocab_size,
        positions=jnp.full((batch,), last + 3 * page_size - 1, jnp.int32),
        slot_mapping=plan.src_tables[:, budget] * page_size + page_size - 1,
        kv_lens=jnp.full((batch,), last, jnp.int32), page_tables=plan.src_tables,
        logits_indices=jnp.arange(batch, dtype=jnp.int32))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k, v, _previous_tokens, params, decode):
        logits, k, v = forward_paged(params, model_cfg, k, v, decode, backend)
        return k, v, jnp.argmax(logits, axis=-1)

    return decode, step


def compression_case(key, model_cfg, batch, budget, page_size, table_pages, dtype):
    """``batch`` requests holding ``M+1`` full pages each (steady state: compressed before, in-place targets)."""
    live_pages = budget + 1
    num_pages = batch * live_pages + 1
    shape = (model_cfg.num_layers, num_pages, model_cfg.num_kv_heads, page_size, model_cfg.head_dim)
    keys = jax.random.split(key, 5)
    k_pool, v_pool = random_pool(keys[0], shape, dtype), random_pool(keys[1], shape, dtype)
    score_cache = jax.random.uniform(keys[2], shape[:4], jnp.float32, 0.0, 0.05)
    window = 16
    query_cache = jax.random.normal(keys[3], (model_cfg.num_layers, batch + 1, window, model_cfg.num_heads,
                                              model_cfg.head_dim), dtype)
    live = (jax.random.permutation(keys[4], batch * live_pages) + 1).reshape(batch, live_pages).astype(jnp.int32)
    tables = jnp.zeros((batch, table_pages), jnp.int32).at[:, :live_pages].set(live)
    plan = CompressionBatch(src_tables=tables, num_src_pages=jnp.full((batch,), live_pages, jnp.int32),
                            dst_tables=live[:, :budget], query_rows=jnp.arange(batch, dtype=jnp.int32),
                            logical_lens=jnp.full((batch,), live_pages * page_size + 3 * page_size, jnp.int32),
                            compressed_before=jnp.ones((batch,), bool), valid=jnp.ones((batch,), bool))
    return dict(k_pool=k_pool, v_pool=v_pool, score_cache=score_cache, query_cache=query_cache, plan=plan)


def time_donated(step, state, reps, *extra):
    """Seconds per call of ``state = step(*state, *extra)`` (its donated state flows back in), after a warm-up call."""
    state = step(*state, *extra)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(reps):
        state = step(*state, *extra)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / reps, state


def seconds_per_layer_call(fn, reps, num_layers, *arrays):
    """Seconds per call of ``fn(layer, *arrays)`` chained ``reps`` times (cycling layers) in one jitted loop."""
    chain = jax.jit(lambda *a: jax.lax.fori_loop(0, reps, lambda i, acc: acc + fn(i % num_layers, *a).sum(), 0.0))
    chain(*arrays).block_until_ready()
    start = time.perf_counter()
    chain(*arrays).block_until_ready()
    return (time.perf_counter() - start) / reps


def temp_bytes(compiled):
    """XLA's temporary buffer size of a compiled call (None where the backend does not report it)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def bench_compression(args):
    model_cfg = compression_shapes()[args.comp_model_shape]
    dtype, page_size, budget, window = jnp.dtype(args.comp_dtype), args.comp_page, args.comp_budget, 16
    num_layers, hkv, hq, head_dim = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.num_heads, \
        model_cfg.head_dim
    scale = head_dim ** -0.5
    decode_backend = resolve_backend(args.comp_decode_backend)
    kernel_backend = interpreted_kernels() if args.interpret else resolve_backend("mosaic")
    interpret = plgpu.InterpretGPUParams() if args.interpret else False
    cfg = ScoringConfig(window=window)
    # the kernels' tuning variants are GPU timings: interpreted, each costs CI seconds and checks nothing the kernel
    # tests do not (they run every option against the oracle)
    tuning = not args.interpret
    # the engine groups layers within the source pages its memory plan reserves (by default COMPRESSION_ROWS rows
    # at the steady width: ``kv_cache.plan_memory``); "*_layer_by_layer" is the A/B of that grouping
    grouped = kv_cache.COMPRESSION_ROWS * (budget + 1)
    variants = {"kernel": (kernel_backend, cfg, grouped), "jnp": (REFERENCE, cfg, grouped)}
    if tuning:
        variants["kernel_layer_by_layer"] = (kernel_backend, cfg, None)
        variants["kernel_no_redundancy"] = (kernel_backend, dataclasses.replace(cfg, redundancy="off"), grouped)
        # the compaction of every call through XLA (gather/scatter, all slots at once) or through the in-place
        # kernel; "kernel" takes XLA up to XLA_COMPACTION_MAX_ROWS rows (``attention.compaction_by_rows``)
        variants["kernel_xla_compaction"] = (dataclasses.replace(kernel_backend, compact_slots=xla_compact_slots), cfg,
                                             grouped)
        variants["kernel_mosaic_compaction"] = (dataclasses.replace(kernel_backend, compact_slots=compact_slots), cfg,
                                                grouped)
    rows, params = [], None
    base = dict(kernel="compression", model_shape=args.comp_model_shape, budget=budget, page=page_size,
                window=window, q_heads=hq, kv_heads=hkv, head_dim=head_dim, layers=num_layers)
    deadline = time.monotonic() + args.time_budget
    for batch in args.comp_batch:
        if rows:  # a device call killed mid-batch still leaves the batches before it
            write_rows(args.json, rows)
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping compression batch={batch}", flush=True)
            continue
        table_pages = args.comp_table_pages or budget + 1
        case = compression_case(jax.random.key(batch), model_cfg, batch, budget, page_size, table_pages, dtype)
        plan = case["plan"]
        num_live = plan.num_src_pages * page_size
        num_slots = table_pages * page_size
        ring = (plan.logical_lens[:, None] - window + jnp.arange(window)) % window
        layer_queries = lambda layer, qc: qc[layer, plan.query_rows[:, None], ring]  # noqa: E731
        k_bytes = batch * hkv * (budget + 1) * page_size * head_dim * dtype.itemsize
        shape_row = dict(base, batch=batch, live_slots=(budget + 1) * page_size, table_slots=num_slots)

        def kernel_scorer(**tile):
            return lambda layer, k, qc, lens=num_live: window_scores(
                k, layer, plan.src_tables, lens, layer_queries(layer, qc), scale, interpret=interpret, **tile)

        scorers = {
            "kernel": kernel_scorer(),
            "jnp": lambda layer, k, qc, lens=num_live: paged_window_attention(
                k, layer, plan.src_tables, lens, layer_queries(layer, qc), scale),
        }
        if tuning:
            scorers["kernel_b64"] = kernel_scorer(block_kv=64)
            scorers["kernel_s3"] = kernel_scorer(num_stages=3)
        one_layer = {name: jax.jit(functools.partial(fn, 1)) for name, fn in scorers.items()}
        ref = one_layer["jnp"](case["k_pool"], case["query_cache"])
        # ragged live lengths (partial pages, a row shorter than the window, empty rows) for the kernel's check
        ragged = jax.random.randint(jax.random.key(batch + 1), (batch,), 0, num_slots + 1)
        ragged = jnp.minimum(ragged, num_live).at[::7].set(0).at[1::7].set(window // 2).astype(jnp.int32)
        ref_ragged = jax.jit(lambda k, qc: scorers["jnp"](1, k, qc, ragged))(case["k_pool"], case["query_cache"])
        for name, fn in scorers.items():
            def measure(row, name=name, fn=fn):
                row["rel_err"] = rel_err(one_layer[name](case["k_pool"], case["query_cache"]), ref)
                if name.startswith("kernel"):
                    out = jax.jit(lambda k, qc: fn(1, k, qc, ragged))(case["k_pool"], case["query_cache"])
                    row["rel_err_ragged"] = rel_err(out, ref_ragged)
                sec = seconds_per_layer_call(fn, args.comp_reps, num_layers, case["k_pool"], case["query_cache"])
                row.update(ms=sec * 1e3, tb_s=k_bytes * (2 if name.startswith("kernel") else 1) / sec / 1e12,
                           temp_bytes=temp_bytes(one_layer[name].lower(case["k_pool"], case["query_cache"]).compile()),
                           ok=max(row["rel_err"], row.get("rel_err_ragged", 0.0)) <= MAX_REL_ERR)
                if name.startswith("kernel"):
                    row["scratch_bytes"] = scratch_bytes(batch, hkv, num_slots, hq, window, head_dim, dtype.itemsize)
                    block = 64 if name == "kernel_b64" else default_block_kv(page_size)
                    row["smem_bytes_per_cta"] = smem_bytes(hq // hkv, window, head_dim, block,
                                                           3 if name == "kernel_s3" else 2, dtype.itemsize)
                else:
                    row["scratch_bytes"] = batch * (hkv * num_slots * head_dim * dtype.itemsize + hq * num_slots * 4)

            rows.append(record(dict(shape_row, part="scoring_one_layer", impl=name), measure, args.verbose))

        threshold = cfg.similarity_threshold
        redundancy_impls = {
            "kernel": lambda layer, k: lightning_row_sums(k, layer, plan.src_tables, plan.num_src_pages, threshold,
                                                          interpret=interpret),
            "jnp": lambda layer, k: redundancy_row_sums(gather_request_kv(k, layer, plan.src_tables), num_live,
                                                        page_size, cfg),
        }
        ref = jax.jit(functools.partial(redundancy_impls["jnp"], 1))(case["k_pool"])
        for name, fn in redundancy_impls.items():
            def measure(row, name=name, fn=fn):
                one = jax.jit(functools.partial(fn, 1))
                row["rel_err"] = rel_err(one(case["k_pool"]), ref)
                sec = seconds_per_layer_call(fn, args.comp_reps, num_layers, case["k_pool"])
                row.update(ms=sec * 1e3, tb_s=k_bytes / sec / 1e12, ok=row["rel_err"] <= MAX_REL_ERR,
                           temp_bytes=temp_bytes(one.lower(case["k_pool"]).compile()))
                if name != "jnp":
                    row["smem_bytes_per_cta"] = redundancy_smem_bytes(page_size, head_dim, dtype.itemsize)

            rows.append(record(dict(shape_row, part="redundancy_one_layer", impl=name), measure, args.verbose))

        scores = jax.random.uniform(jax.random.key(7), (batch, hkv, (budget + 1) * page_size))
        kept = select_slots(scores, budget * page_size)
        kernel_threshold = functools.partial(selection_threshold, interpret=interpret)
        for name, threshold in (("sorted_threshold", sorted_threshold), ("kernel_threshold", kernel_threshold)):
            def measure(row, threshold=threshold):
                # the layer shifts the scores (order unchanged) so the chained calls are not loop-invariant
                fn = lambda layer, s: select_slots(s + layer, budget * page_size, threshold)  # noqa: E731
                row["exact"] = bool((jax.jit(functools.partial(fn, 0))(scores) == kept).all())
                row["ms"] = seconds_per_layer_call(fn, args.comp_reps, num_layers, scores) * 1e3
                row["ok"] = row["exact"]

            rows.append(record(dict(shape_row, part="selection_one_layer", impl=name), measure, args.verbose))
        live_tables = plan.src_tables[:, :budget + 1]

        def slot_compaction(k, v, layer):
            return xla_compact_slots(k, v, layer, kept, live_tables, plan.dst_tables, plan.valid)

        def page_compaction(k, v, layer):
            def one(pool):
                rows_kv = jnp.take_along_axis(gather_request_kv(pool, layer, live_tables), kept[..., None], axis=2)
                pages = rows_kv.reshape(batch, hkv, budget, page_size, head_dim).transpose(0, 2, 1, 3, 4)
                return pool.at[layer, plan.dst_tables].set(pages)
            return one(k), one(v)

        def kernel_compaction(row_group=8, **blocks):
            return lambda k, v, layer: compact_slots(k, v, layer, kept, live_tables, plan.dst_tables, plan.valid,
                                                     row_group=row_group, interpret=interpret, **blocks)

        compactions = {"mosaic_in_place": kernel_compaction(), "xla_slot_gather_scatter": slot_compaction,
                       "xla_page_scatter": page_compaction}
        if tuning:
            compactions.update(mosaic_in_place_g16=kernel_compaction(16),
                               mosaic_in_place_joint=kernel_compaction(split_pools=False),
                               mosaic_in_place_row_by_row=kernel_compaction(max_run=1))
        for name, compact in compactions.items():
            def measure(row, compact=compact):
                reps = args.comp_reps
                chain = jax.jit(lambda k, v: jax.lax.fori_loop(0, reps, lambda i, kv: compact(*kv, i % num_layers),
                                                               (k, v)), donate_argnums=(0, 1))
                sec, (case["k_pool"], case["v_pool"]) = time_donated(chain, (case["k_pool"], case["v_pool"]), 1)
                sec /= reps
                moved = 2 * 2 * batch * hkv * budget * page_size * head_dim * dtype.itemsize  # K+V, read+write
                row.update(ms=sec * 1e3, tb_s=moved / sec / 1e12)

            rows.append(record(dict(shape_row, part="compaction_one_layer", impl=name), measure, args.verbose))

        step_ms = {}
        for name, (backend, scoring_cfg, max_pages) in variants.items():
            def measure(row, backend=backend, scoring_cfg=scoring_cfg, max_pages=max_pages, name=name):
                step = jax.jit(functools.partial(compress, cfg=scoring_cfg, sm_scale=scale, backend=backend,
                                                 max_pages=max_pages), donate_argnums=(0, 1, 2))
                state = (case["k_pool"], case["v_pool"], case["score_cache"])
                compiled = step.lower(*state, case["query_cache"], plan).compile()
                row["temp_bytes"] = temp_bytes(compiled)
                sec, state = time_donated(compiled, state, args.comp_reps, case["query_cache"], plan)
                case["k_pool"], case["v_pool"], case["score_cache"] = state
                step_ms[name] = sec * 1e3
                row.update(ms=sec * 1e3, redundancy=scoring_cfg.redundancy,
                           layer_group=layer_group(num_layers, batch, plan.src_tables.shape[1], max_pages))

            rows.append(record(dict(shape_row, part="compress_step", impl=name), measure, args.verbose))

        def measure_decode(row):
            nonlocal params
            if params is None:
                params = to_serving(weights.init_random_params(model_cfg, jax.random.key(0), dtype))
            decode, step = decode_step(model_cfg, plan, batch, budget, page_size, decode_backend)
            state = (case["k_pool"], case["v_pool"], decode.tokens)
            sec, (case["k_pool"], case["v_pool"], _) = time_donated(step, state, args.comp_reps, params, decode)
            step_ms["decode"] = sec * 1e3
            row.update(ms=sec * 1e3, backend=decode_backend.name)
            for name, ms in step_ms.items():
                if name != "decode":
                    row[f"ratio_{name}"] = ms / row["ms"]

        rows.append(record(dict(shape_row, part="decode_step", impl="forward_paged"), measure_decode, args.verbose))
        case = plan = None  # this batch's pools go before the next batch's
    return rows




def print_compression_table(rows):
    print(f"{'part':21} {'impl':24} {'B':>4} {'ms':>9} {'TB/s':>6} {'rel_err':>8} {'temp MB':>9} {'ratio':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:21} {r['impl']:24} {r['batch']:4}  ERROR {r['error'][:80]}")
            continue
        ratio = " ".join(f"{k[6:]}={v:.2f}" for k, v in r.items() if k.startswith("ratio_"))
        temp = "" if r.get("temp_bytes") is None else f"{r['temp_bytes'] / 1e6:9.1f}"
        err = f"{max(r['rel_err'], r.get('rel_err_ragged', 0)):8.1e}" if "rel_err" in r else ""
        print(f"{r['part']:21} {r['impl']:24} {r['batch']:4} {r['ms']:9.3f} {r.get('tb_s', 0):6.2f} {err:>8} "
              f"{temp:>9} {ratio}")


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench compression", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_compression.json", help="where to write all rows")
    parser.add_argument("--time-budget", type=float, default=float("inf"),
                        help="seconds after which no new batch is started (the rows so far are still written)")
    parser.add_argument("--comp-model-shape", default="qwen3-8b", choices=sorted(compression_shapes()))
    parser.add_argument("--comp-batch", type=ints, default=[64, 256])
    parser.add_argument("--comp-budget", type=int, default=8, help="M: pages kept per request")
    parser.add_argument("--comp-page", type=int, default=256)
    parser.add_argument("--comp-table-pages", type=int, default=0,
                        help="width of the source page tables (0: the M+1 live pages; the engine uses max_model_len)")
    parser.add_argument("--comp-dtype", default="bfloat16")
    parser.add_argument("--comp-reps", type=int, default=5)
    parser.add_argument("--comp-decode-backend", default="auto", help="attention backend of the decode step")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels in Mosaic GPU interpret mode (CPU smoke test)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    print(f"devices: {jax.devices()}", flush=True)
    rows = bench_compression(args)
    write_rows(args.json, rows)
    print_compression_table(rows)
    return rows


if __name__ == "__main__":
    main()
