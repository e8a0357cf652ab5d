"""What logprobs add to a step on the device: the per-row logprob, rank and top-20 every decode and prefill step
computes (``layers.logprobs.token_logprobs``), against what a greedy step's sampling already does (logsumexp and
argmax) and against ``jax.lax.top_k(logits, 20)`` (which XLA's GPU top-k kernel, limited to k <= 16, would sort);
and one dispatch of the prompt-logprobs program (final norm, LM head and the same logprobs over 128 rows):
`python -m zipage_jax.bench logprobs`.

    python -m zipage_jax.bench logprobs [--vocab 151936] [--hidden 4096] [--rows 1 64 256] [--json out.json]

Device times are the best of ``--reps`` timed loops of back-to-back calls; compare them with a decode step of the
same batch (``python -m zipage_jax.bench decode``). Meant for the GPU (``STAGE=decode bash scripts/gpu_engine.sh``).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.layers.logprobs import token_logprobs
from zipage_jax.sampling_params import MAX_LOGPROBS


def device_ms(fn, *args, reps: int = 5, calls: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def greedy_sampling(logits):
    """What a greedy step's sampling computes without logprobs: the argmax and the log-normalizer."""
    return jnp.argmax(logits, axis=-1), jax.nn.logsumexp(logits, axis=-1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench logprobs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary (default)")
    parser.add_argument("--hidden", type=int, default=4096, help="Qwen3-8B's hidden size (default)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-rows", type=int, default=128, help="rows of one prompt-logprobs dispatch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    rng = np.random.default_rng(0)
    report = dict(device=str(jax.devices()[0]), vocab=args.vocab, k=MAX_LOGPROBS, rows=[])
    logprobs = jax.jit(lambda x, t: token_logprobs(x, t, MAX_LOGPROBS))
    sort_top_k = jax.jit(lambda x: jax.lax.top_k(x, MAX_LOGPROBS))
    greedy = jax.jit(greedy_sampling)
    for rows in args.rows:
        logits = jnp.asarray(rng.standard_normal((rows, args.vocab), np.float32) * 4)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        row = dict(rows=rows, greedy_sampling_ms=device_ms(greedy, logits, reps=args.reps),
                   token_logprobs_ms=device_ms(logprobs, logits, tokens, reps=args.reps),
                   lax_top_k_ms=device_ms(sort_top_k, logits, reps=args.reps))
        report["rows"].append(row)
        print(json.dumps(row))
    hidden = jnp.asarray(rng.standard_normal((args.prompt_rows, args.hidden)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((args.hidden, args.vocab)) / args.hidden ** 0.5, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, args.vocab, args.prompt_rows), jnp.int32)

    @jax.jit
    def prompt_dispatch(hidden, head, targets):
        logits = jnp.einsum("td,dv->tv", hidden, head, preferred_element_type=jnp.float32)
        return token_logprobs(logits, targets, MAX_LOGPROBS)

    report["prompt_dispatch_ms"] = device_ms(prompt_dispatch, hidden, head, targets, reps=args.reps)
    print(json.dumps({"prompt_rows": args.prompt_rows, "prompt_dispatch_ms": report["prompt_dispatch_ms"]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report
