"""Time to first token of one long prompt through the whole engine, per attention backend, in one process:
`python -m zipage_jax.bench ttft`.

    python -m zipage_jax.bench ttft --model-shape qwen3-8b --prompt-len 16384 \\
        --backends mosaic mosaic_decode --prefill-tokens 2048 16384 --trials 3 --json ttft.json

Random weights of a real model shape. For each backend and each prefill token budget (`max_num_batched_tokens`:
2048, the engine's default, prefills a 16k prompt in 8 chunks, each after the cached prefix of the ones before;
16384 in one step) an engine is built, one untimed request compiles its prefill program, then `--trials`
requests of fresh random prompts (prefix caching off) are each timed from `add` to their first token read back
(greedy, `max_tokens=1`). Prints a table and, per budget, each backend's TTFT against the first backend's
(`mosaic_decode` is `mosaic` with XLA's prefill attention instead of the prefill kernel).
"""

import argparse
import functools
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.model_shapes import MODEL_SHAPES
from zipage_jax.config import EngineConfig
from zipage_jax.core.request import Request
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.models import weights
from zipage_jax.sampling_params import SamplingParams

def time_to_first_token(engine: LLMEngine, prompt: list[int], request_id: str) -> tuple[float, int, int]:
    """Seconds from ``add`` to the greedy first token read back, the token, and the engine steps it took."""
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = Request(request_id, prompt, sampling, 0)
    start = time.perf_counter()
    engine.add(request)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)
        steps += 1
    seconds = time.perf_counter() - start
    return seconds, request.output_token_ids[0], steps


def ttft_benchmark(model_shape: str, prompt_len: int, backends: list[str], prefill_budgets: list[int],
                   trials: int = 3, page_size: int = 256, dtype: str = "bfloat16", seed: int = 0,
                   progress=print) -> dict:
    """Run the benchmark; returns the report (one row per backend and prefill budget)."""
    if model_shape not in MODEL_SHAPES:
        raise ValueError(f"model_shape: unknown {model_shape!r}; have {sorted(MODEL_SHAPES)}")
    for name, value in (("prompt_len", prompt_len), ("trials", trials)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int (got {value!r})")
    if not backends or not prefill_budgets:
        raise ValueError("backends, prefill_tokens: give at least one each")
    model_cfg = MODEL_SHAPES[model_shape]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model_cfg.vocab_size, size=prompt_len).tolist() for _ in range(trials + 1)]
    max_model_len = prompt_len + 1
    report = dict(benchmark="ttft", model_shape=model_shape, device=str(jax.devices()[0]),
                  device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  config=dict(prompt_len=prompt_len, trials=trials, page_size=page_size, dtype=dtype), results=[])
    for backend in backends:
        for budget in prefill_budgets:
            config = EngineConfig(model=f"random:{model_shape}", dtype=dtype, page_size=page_size,
                                  max_model_len=max_model_len, max_num_seqs=1, max_num_batched_tokens=budget,
                                  num_gpu_pages_override=-(-max_model_len // page_size) + 1,
                                  attention_backend=backend, seed=seed, enable_prefix_caching=False,
                                  compilation_cache_dir=None)
            # made by the engine once its pool is placed, so its plan does not see them as memory held by others
            params = functools.partial(weights.init_random_params, model_cfg, jax.random.key(seed), jnp.dtype(dtype))
            engine = LLMEngine(config, model_cfg, params)
            first_s, first_token, steps = time_to_first_token(engine, prompts[0], "compile")
            runs = [time_to_first_token(engine, prompt, f"trial-{i}") for i, prompt in enumerate(prompts[1:])]
            seconds = [r[0] for r in runs]
            row = dict(backend=backend, prefill_tokens=budget, steps=steps, first_s_incl_compile=first_s,
                       ttft_ms=statistics.median(seconds) * 1e3, ttft_ms_min=min(seconds) * 1e3,
                       prompt_tokens_per_s=prompt_len / statistics.median(seconds),
                       first_tokens=[first_token] + [r[1] for r in runs])
            report["results"].append(row)
            progress(format_row(row))
            del engine
            gc.collect()  # this engine's weights and pool go before the next one allocates its own
    return report


HEADER = f"{'backend':18} {'budget':>6} {'steps':>5} {'TTFT ms':>9} {'min ms':>9} {'prompt tok/s':>12} {'1st s':>7}"


def format_row(r: dict) -> str:
    return (f"{r['backend']:18} {r['prefill_tokens']:>6} {r['steps']:>5} {r['ttft_ms']:>9.1f} {r['ttft_ms_min']:>9.1f} "
            f"{r['prompt_tokens_per_s']:>12.0f} {r['first_s_incl_compile']:>7.1f}")


def comparisons(results: list[dict]) -> list[str]:
    """Per prefill budget, every backend's median TTFT as a multiple of the first backend's, and whether they
    sampled the same first tokens."""
    lines = []
    for budget in dict.fromkeys(r["prefill_tokens"] for r in results):
        rows = [r for r in results if r["prefill_tokens"] == budget]
        base = rows[0]
        for r in rows[1:]:
            same = r["first_tokens"] == base["first_tokens"]
            ratio = r["ttft_ms"] / base["ttft_ms"]
            lines.append(f"budget {budget}: {r['backend']} {r['ttft_ms']:.1f} ms = {ratio:.2f}x {base['backend']} "
                         f"{base['ttft_ms']:.1f} ms (same first tokens: {same})")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--backends", nargs="+", default=["mosaic", "mosaic_decode"],
                        help="attention backends, the first the baseline of the comparison (mosaic_decode: XLA's "
                             "prefill attention)")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 16384],
                        help="max_num_batched_tokens budgets (a prompt longer than one is prefilled in chunks)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    print(f"ttft benchmark: {args.model_shape}, {args.prompt_len}-token prompt on {jax.devices()[0].device_kind}",
          flush=True)
    print(HEADER, flush=True)
    report = ttft_benchmark(args.model_shape, args.prompt_len, args.backends, args.prefill_tokens, args.trials,
                            args.page_size, args.dtype, args.seed, progress=lambda line: print(line, flush=True))
    report["comparisons"] = comparisons(report["results"])
    for line in report["comparisons"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report
