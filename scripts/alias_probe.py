"""Which compiled programs keep a copy of the KV pool (temp or unaliased output as large as one pool array)?

    PYTHONPATH=. python3 scripts/alias_probe.py CHECKPOINT [--pages N]

Warms up both modes (compilation cache off) on a small pool and prints XLA's memory analysis of every program
beside the bytes of one pool array, and the optimized HLO's copies of a pool-shaped buffer (a program that
copies the pool needs a second pool's worth of memory)."""
import argparse
import re


from zipage_jax import LLM

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--pages", type=int, default=301)
args = parser.parse_args()
for compression in (False, True):
    llm = LLM(args.model, compression=compression, num_gpu_pages_override=args.pages, compilation_cache_dir=None)
    runner = llm.engine.runner
    pool = runner.state.k_pool
    dims = ",".join(map(str, pool.shape))
    print(f"== compression={compression} backend={llm.engine.config.attention_backend} k_pool {pool.shape} "
          f"{pool.nbytes / 2**20:.1f} MiB", flush=True)
    runner.warmup()
    names = {program.key: program.name for program in runner.warmup_programs()}
    for key, compiled in runner.programs.compiled.items():
        m = compiled.memory_analysis()
        text = compiled.as_text()
        copies = [line.strip() for line in text.splitlines()
                  if re.search(rf"\[{dims}\]\{{[^}}]*\}} (copy|copy-start)\(", line)]
        copy = bool(copies) or m.output_size_in_bytes - m.alias_size_in_bytes >= pool.nbytes
        print(f"{names.get(key, str(key)[:40]):42s} temp {m.temp_size_in_bytes / 2**20:9.1f} MiB  unaliased out "
              f"{(m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20:9.1f} MiB  alias "
              f"{m.alias_size_in_bytes / 2**20:9.1f} MiB{'  <-- POOL COPY' if copy else ''}", flush=True)
        for line in copies[:6]:
            print("   ", line[:600])
    del llm, runner, pool
