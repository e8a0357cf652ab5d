"""Where a step's device time goes: a ``jax.profiler`` trace of a few calls, summed per kernel and per category.

On a GPU the trace holds one event per kernel launch (inside CUDA graphs too) on the device's stream lines (the
first GPU's, under tensor parallelism: every device runs the same step, and its collectives show as NCCL kernels);
on the CPU backend it holds one event per XLA thunk on the host's XLA threads, so the same summary runs in tests.
"""

import glob
import re
import tempfile

import jax

# (category, pattern over the kernel / op name), first match wins
CATEGORIES = (
    ("collective", re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|reduce-scatter|"
                              r"collective-permute|all-to-all", re.I)),
    ("matmul", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|sm90_|dot|matmul", re.I)),
    ("attention kernel", re.compile(r"paged|prefill|attend|mosaic|window_scores|redundancy|compact|selection", re.I)),
    ("kv write (scatter)", re.compile(r"scatter|dynamic_update_slice|dynamic-update-slice", re.I)),
    ("sort", re.compile(r"sort", re.I)),
    ("reduction fusion", re.compile(r"reduce|reduction", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
    ("elementwise fusion", re.compile(r"fusion|loop_|concatenate|broadcast|convert|add|multiply", re.I)),
)


def category(kernel: str) -> str:
    return next((name for name, pattern in CATEGORIES if pattern.search(kernel)), "other")


def _kernel_events(trace_dir: str):
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(paths[0])
    device = [p for p in data.planes if p.name.startswith("/device:GPU")]
    device = [p for p in device if re.match(r"/device:GPU:0\b", p.name)] or device  # tensor parallel: one GPU
    if device:
        lines = [line for plane in device for line in plane.lines if "stream" in line.name.lower()]
    else:  # CPU backend: XLA's thunks run on its host threads
        lines = [line for plane in data.planes if plane.name == "/host:CPU" for line in plane.lines
                 if line.name.startswith("tf_XLA")]
    for line in lines:
        for event in line.events:
            if event.duration_ns > 0 and not event.name.startswith("ThreadpoolListener"):
                yield event.name, event.start_ns, event.duration_ns


def kernel_breakdown(run, steps: int = 5, top: int = 30) -> dict:
    """Trace ``steps`` calls of ``run`` (which returns something to block on) after one untraced call.

    Returns per-step microseconds: ``busy`` (sum of kernel times), ``span`` (first kernel start to last end),
    ``launches`` (kernels per step), ``categories`` and the ``top`` kernels by time (names with their numeric
    suffix dropped, so the same fusion of every layer adds up)."""
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        out = None
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        events = list(_kernel_events(trace_dir))
    kernels, categories = {}, {}
    for name, _, duration in events:
        key = re.sub(r"[._]\d+$", "", name)[:120]
        total, calls = kernels.get(key, (0, 0))
        kernels[key] = (total + duration, calls + 1)
        kind = category(name)
        categories[kind] = categories.get(kind, 0) + duration
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) if events else 0
    per_step = lambda ns: ns / steps / 1e3  # noqa: E731
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        busy_us=per_step(sum(d for _, _, d in events)), span_us=per_step(span), launches=len(events) / steps,
        categories_us={k: per_step(v) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        top_kernels=[dict(kernel=k, us=per_step(ns), calls=n / steps, category=category(k)) for k, (ns, n) in ranked])
