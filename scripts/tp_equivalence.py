"""Greedy tokens of a tensor-parallel engine against one device's, with compression off and on: how many requests
match exactly, and where the others first diverge.

    PYTHONPATH=. python scripts/tp_equivalence.py /tmp/qwen3-0.6b-4l --tensor-parallel-size 2 \
        --attention-backend mosaic --dtype bfloat16

In float32 (the reference backend) the tokens must match: the all-reduce sums f32 partials. In bfloat16 each
shard's partial sum of ``o_proj`` / ``down_proj`` is rounded before the all-reduce adds them, so greedy runs of
random weights may drift apart after a while (the first divergence shows how soon).
"""

import argparse
import gc
import json
import pathlib

import numpy as np

from zipage_jax import LLM, SamplingParams
from zipage_jax.layers.attention import resolve_backend


def first_divergence(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint directory")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-budget-pages", type=int, default=4)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 10**9, help="per device")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = json.loads((pathlib.Path(args.model) / "config.json").read_text())["vocab_size"]
    report = dict(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
                  attention_backend=args.attention_backend, results=[])
    for compression in (False, True):
        tokens = {}
        for size in (1, args.tensor_parallel_size):
            llm = LLM(args.model, tensor_parallel_size=size, dtype=args.dtype, attention_backend=args.attention_backend,
                      compression=compression, kv_budget_pages=args.kv_budget_pages, page_size=args.page_size,
                      max_num_seqs=args.requests, max_model_len=args.prompt_len + args.max_tokens + 1,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, compilation_cache_dir=None)
            backend = resolve_backend(args.attention_backend).name  # what "auto" chose, now that jax runs
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.requests)]
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            tokens[size] = [o.outputs[0].token_ids for o in outputs]
            compressions = llm.metrics()["num_compressions"]
            del llm, outputs
            gc.collect()
        divergence = [first_divergence(a, b) for a, b in zip(tokens[1], tokens[args.tensor_parallel_size])]
        same = sum(d is None for d in divergence)
        row = dict(compression=compression, backend=backend, identical_requests=same, requests=args.requests,
                   first_divergence=divergence, compressions=compressions)
        report["results"].append(row)
        diverged = sorted(d for d in divergence if d is not None)
        print(f"compression {'on ' if compression else 'off'} ({backend}, {compressions} compressions): "
              f"TP={args.tensor_parallel_size} equals TP=1 on {same}/{args.requests} requests"
              + (f"; the others first differ at tokens {diverged}" if diverged else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
