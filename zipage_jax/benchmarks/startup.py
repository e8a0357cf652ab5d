"""Start-up of the public API (``python -m zipage_jax.bench startup``): ``LLM(...)``, ``warmup()``, and the
compiles a mixed workload meets afterwards, with where the seconds go (weights against the raw read speed of the
same files, loading stored programs, tracing, compiling)."""

import concurrent.futures
import os
import pathlib
import time

import jax
import numpy as np

from zipage_jax.sampling_params import SamplingParams

READ_CHUNK = 64 * 2**20


def raw_read_bytes_per_s(model: str, threads: int = 16) -> tuple[int, float]:
    """Bytes of the checkpoint's safetensors and how fast plain parallel reads of them go on this machine (into
    one reused buffer per thread): the ceiling of loading the weights."""
    files = sorted(pathlib.Path(model).glob("*.safetensors"))

    def read(path):
        buffer = bytearray(READ_CHUNK)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        return path.stat().st_size

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(threads, max(1, len(files)))) as pool:
        total = sum(pool.map(read, files))
    return total, total / max(time.perf_counter() - start, 1e-9)


def startup_benchmark(model: str, engine_options: dict, workload: int = 24, seed: int = 0,
                      ready_early: bool = False) -> dict:
    """Start-up of the public API, as a user meets it: ``LLM(model, **engine_options)``, then ``warmup()``, then
    a mixed workload (prompt lengths, greedy and sampled rows, seeds, ``n``, ``min_tokens``, logprobs) that must
    compile nothing. Run it twice with the same ``compilation_cache_dir`` for the cold and the warm figure.

    ``ready_early``: ready once a light load's programs are (``warmup(ready_early=True)``, as the server starts);
    the workload runs while the rest compile in the background and must wait on no compile, and
    ``all_compiled_s`` says when the background was done."""
    from zipage_jax.engine.llm import LLM
    from zipage_jax.worker.compile_counter import CompileCounter

    checkpoint_bytes, raw_bps = raw_read_bytes_per_s(model, os.cpu_count() or 1)
    counter = CompileCounter()  # LLM()'s own compiles (the pool's fill, the weights' conversions): every start pays
    start = time.perf_counter()
    llm = LLM(model, **engine_options)
    init_s = time.perf_counter() - start
    init_phases_s = dict(llm.engine.startup_s)
    init_compiles, init_compile_s = counter.count, counter.seconds
    counter.close()
    warmup = llm.warmup(use_tqdm=False, ready_early=ready_early)
    ready_s = time.perf_counter() - start
    # ready early, the background compiles count too: what matters is that no step waits on one
    compiles_key = "num_compiles_waited_on" if ready_early else "num_compiles"
    compiles = llm.metrics()[compiles_key]
    rng = np.random.default_rng(seed)
    vocab = llm.engine.model_cfg.vocab_size
    longest = min(3000, llm.engine.max_model_len - 400)
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(5, longest, size=workload)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, top_k=40 if i % 2 else 0, min_p=0.05 if i % 4 == 1 else 0.0,
                             max_tokens=int(m), seed=i, min_tokens=2, n=1 + i % 2, logprobs=True, ignore_eos=True)
              for i, m in enumerate(rng.integers(2, 300, size=workload))]
    t = time.perf_counter()
    first = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first_token_s = time.perf_counter() - start
    del first
    outs = llm.generate(prompts, params, use_tqdm=False)
    workload_s = time.perf_counter() - t
    compiles_after = llm.metrics()[compiles_key] - compiles
    llm.engine.join_background_compiles()
    weights_s = llm.engine.startup_s["weights"]
    return dict(benchmark="startup", model=model, engine_options=engine_options, device=str(jax.devices()[0]),
                jax_version=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                memory_plan=llm.engine.memory_plan.describe(), init_s=init_s, init_phases_s=init_phases_s,
                init_compiles=init_compiles, init_compile_s=init_compile_s,
                tokenizer=type(llm.engine.tokenizer).__name__, tokenizer_wait_s=llm.engine.tokenizer_wait_s,
                weights_s=weights_s, checkpoint_bytes=checkpoint_bytes,
                weights_bytes_per_s=checkpoint_bytes / max(weights_s, 1e-9), raw_read_bytes_per_s=raw_bps,
                ready_early=ready_early, background_programs=warmup.get("background", 0),
                all_compiled_s=time.perf_counter() - start, programs=warmup["programs"], compile_s=warmup["compile_s"],
                loaded=warmup["loaded"],
                load_s=warmup["load_s"], lower_s=warmup["lower_s"], compile_sum_s=warmup["compile_sum_s"],
                ready_s=ready_s, first_token_s=first_token_s,
                compiles_after_warmup=compiles_after, workload_requests=workload, workload_s=workload_s,
                workload_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs))
