"""What structured outputs cost a step: on the device, the bitmask every step applies before sampling (a gather of
the sampled rows' masks from the table and a select over the logits), with every row free (all ones) and with half
the rows constrained, against the same sampling without it; the write of half a batch's masks into the table (host
to device copy and scatter); and on the host, llguidance's masks of half a batch of JSON-schema requests over a
vocabulary of the size asked for: `python -m zipage_jax.bench bitmask`.

    python -m zipage_jax.bench bitmask [--vocab 151936] [--rows 64 256] [--json out.json]

Device times are the best of ``--reps`` timed loops of back-to-back calls; compare them with a decode step of the
same batch (``python -m zipage_jax.bench decode``). The vocabulary is synthetic (its 256 bytes, then random
printable strings of 2 to 8 bytes): the host figure depends on the vocabulary's size and the grammar, not on what the
tokens mean.
"""

import argparse
import json
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.benchmarks.logprobs_cost import device_ms
from zipage_jax.layers.logprobs import token_logprobs
from zipage_jax.layers.sampler import SamplingRow, SamplingTensors, apply_token_bitmask, sample
from zipage_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from zipage_jax.structured_output.manager import StructuredOutputManager, bitmask_words
from zipage_jax.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"}, "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "score", "kind"]}


def sampling_tail(logits, tensors):
    """What a step does with its logits: sample, then the logprobs of the sampled tokens."""
    tokens, _ = sample(logits, tensors)
    return token_logprobs(logits, tokens, MAX_LOGPROBS)


def masked_tail(logits, tensors, table, rows):
    return sampling_tail(apply_token_bitmask(logits, table[rows]), tensors)


def synthetic_tokenizer(vocab: int, seed: int = 0):
    """A byte vocabulary of ``vocab`` tokens for llguidance (``TokenizerWrapper``'s interface) and the engine's
    tokenizer interface."""
    import llguidance

    rng = np.random.default_rng(seed)
    printable = np.frombuffer(bytes(range(32, 127)), np.uint8)
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    while len(tokens) < vocab:
        token = rng.choice(printable, int(rng.integers(2, 9))).tobytes()
        if token not in seen:
            seen.add(token)
            tokens.append(token)

    class Tokens:
        eos_token_id, bos_token_id, special_token_ids = 0, None, []

        def __call__(self, text):
            return list(text.encode() if isinstance(text, str) else text)

    Tokens.tokens = tokens
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab, eos_token=[0])
    return types.SimpleNamespace(encode=lambda text, add_special_tokens=False: list(text.encode())), ll


def host_masks_ms(vocab: int, count: int, reps: int) -> dict:
    """llguidance's masks of ``count`` JSON-schema requests (``StructuredOutputManager.bitmask``), after each has
    written a few tokens of its object."""
    tokenizer, ll = synthetic_tokenizer(vocab)
    manager = StructuredOutputManager(tokenizer, vocab, (0,))
    manager._ll_tokenizer = ll
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    requests = []
    for i in range(count):
        request = types.SimpleNamespace(request_id=str(i), token_row=i, prompt_token_ids=[1], output_token_ids=[],
                                        output_logprobs=[], num_pending=0, sampling_params=params)
        manager.add(request)
        for byte in b'{"name": "':
            manager.grammars[request.request_id].matcher.consume_token(byte)
        requests.append(request)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        manager.bitmask(requests)
        best = min(best, time.perf_counter() - start)
    return dict(requests=count, host_masks_ms=best * 1e3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zipage_jax.bench bitmask", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary (default)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    rng = np.random.default_rng(0)
    words = bitmask_words(args.vocab)
    report = dict(device=str(jax.devices()[0]), vocab=args.vocab, rows=[])
    plain, masked = jax.jit(sampling_tail), jax.jit(masked_tail)
    write = jax.jit(lambda table, rows, masks: table.at[rows].set(masks), donate_argnums=0)
    for rows in args.rows:
        logits = jnp.asarray(rng.standard_normal((rows, args.vocab), np.float32) * 4)
        row_ids = jnp.arange(rows, dtype=jnp.int32)
        free = SamplingTensors.from_rows([SamplingRow(SamplingParams(temperature=0.0), [1], [], 0, 0)] * rows,
                                         args.vocab, [0])
        sampled = SamplingTensors.from_rows(
            [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95), [1], [], i, 0) for i in range(rows)],
            args.vocab, [0])
        ones = jnp.full((rows + 1, words), -1, jnp.int32)
        half = np.full((rows + 1, words), -1, np.int32)
        half[:rows // 2] = rng.integers(-2**31, 2**31, (rows // 2, words), dtype=np.int64).astype(np.int32)
        half = jnp.asarray(half)
        host_half = np.asarray(half[:rows // 2])
        table = jnp.full((rows + 1, words), -1, jnp.int32)

        def write_half():
            nonlocal table
            index, masks = jax.device_put((np.arange(rows // 2, dtype=np.int32), host_half))
            table = write(table, index, masks)
            return table

        row = dict(rows=rows)
        for name, tensors in (("greedy", free), ("sampled", sampled)):
            row[f"{name}_ms"] = device_ms(plain, logits, tensors, reps=args.reps)
            row[f"{name}_all_free_ms"] = device_ms(masked, logits, tensors, ones, row_ids, reps=args.reps)
            row[f"{name}_half_constrained_ms"] = device_ms(masked, logits, tensors, half, row_ids, reps=args.reps)
        row["write_half_ms"] = device_ms(write_half, reps=args.reps)
        row.update(host_masks_ms(args.vocab, rows // 2, args.reps))
        report["rows"].append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report
