"""Where the full-KV engine's first step after warm-up found no memory on an 80 GB card: device memory, the pool
buffers and the live arrays after each stage of start-up, with and without the executable store.

    PYTHONPATH=. python3 scripts/startup_memory_probe.py CHECKPOINT [store|no-store ...]
"""
import gc
import sys
import tempfile

import jax

from zipage_jax import LLM, SamplingParams


def stats(tag):
    s = jax.devices()[0].memory_stats() or {}
    live = jax.live_arrays()
    print(f"  {tag}: in_use {s.get('bytes_in_use', 0) / 2**30:.2f} GiB peak {s.get('peak_bytes_in_use', 0) / 2**30:.2f}"
          f" GiB limit {s.get('bytes_limit', 0) / 2**30:.2f} GiB; {len(live)} live arrays "
          f"{sum(a.nbytes for a in live) / 2**30:.2f} GiB", flush=True)


def run(tag, warm_up, **kw):
    print(f"== {tag} {kw}", flush=True)
    llm = None
    try:
        llm = LLM(sys.argv[1], **kw)
        print("  plan:", llm.engine.memory_plan.describe(), flush=True)
        stats("after LLM()")
        if warm_up:
            llm.warmup(use_tqdm=False)
            st = llm.engine.runner.state
            print("  pools", hex(st.k_pool.unsafe_buffer_pointer()), hex(st.v_pool.unsafe_buffer_pointer()), flush=True)
            stats("after warmup()")
        llm.generate([[5, 6, 7, 8, 9] * 20], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        st = llm.engine.runner.state
        print("  pools", hex(st.k_pool.unsafe_buffer_pointer()), hex(st.v_pool.unsafe_buffer_pointer()), flush=True)
        stats("after generate")
    except Exception as e:
        print("  FAILED:", str(e)[:300], flush=True)
        stats("at failure")
    finally:
        llm = None
        gc.collect()


variants = sys.argv[2:] or ["store", "no-store"]
if "store" in variants:
    run("full, store, warm-up", True, compression=False, compilation_cache_dir=tempfile.mkdtemp())
if "no-store" in variants:
    run("full, no store, warm-up", True, compression=False, compilation_cache_dir=None)
