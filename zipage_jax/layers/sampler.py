"""Device-side sampling: `SamplingTensors` (a batch's per-row settings as arrays) and the jittable `sample()`.

The pipeline follows vLLM's sampler order so results match what vLLM users expect:
(the structured-output bitmask, ``apply_token_bitmask``, by the step) -> min-tokens bans and logit bias
-> repetition / frequency / presence penalties -> greedy argmax (temperature 0 rows)
-> temperature -> min_p -> top_k -> top_p -> categorical draw (Gumbel-max).
Logprobs are taken from the logits the sampler is given (after the bitmask, as vLLM's), before its own steps.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from zipage_jax.sampling_params import SamplingParams, check_int, check_token_ids

BAN_WIDTH = 8  # banned ids a row holds (EOS and stop ids below min_tokens): one shape for the usual case
BIAS_WIDTH = 8  # logit-bias entries a row holds when some row has one (more: the next power of two)
MIN_HISTORY_WIDTH = 256  # penalized rows' history: one shape for short histories instead of one per doubling

class SamplingRow(NamedTuple):
    """What the host knows about one row of a sampling batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int        # the request's seed (the engine assigns one to unseeded requests)
    step: int        # index, among the request's outputs, of the token being generated


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@struct.dataclass
class SamplingTensors:
    """Per-row sampling state of a batch of B rows, as arrays (a pytree; shapes are jit cache keys).

    temperature [B] f32 (0 = greedy), top_k [B] i32 (0 = off), top_p [B] f32, min_p [B] f32,
    repetition_penalty / presence_penalty / frequency_penalty [B] f32,
    seeds [B,2] u32 (low / high word of the request seed mod 2**64), steps [B] i32,
    history [B,W] i32 (prompt + output tokens of penalized rows, -1 = pad),
    history_is_output [B,W] bool (True where the entry is an output token; an output entry may be -1,
        a token not read back yet, which the caller fills in on the device before `sample`),
    banned_token_ids [B,E] i32 (ids masked to -inf: EOS / stop ids of rows below min_tokens; -1 = pad),
    bias_token_ids [B,L] i32 and bias_values [B,L] f32 (logit_bias entries, added to the logits; -1 = pad;
        L = 1 when no row has one).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seeds: jax.Array
    steps: jax.Array
    history: jax.Array
    history_is_output: jax.Array
    banned_token_ids: jax.Array
    bias_token_ids: jax.Array
    bias_values: jax.Array
    # Which code paths the batch needs, decided on the host: static, so no data-dependent `lax.cond` (on GPU
    # its predicate is read back to the host, which would stall the asynchronous step pipeline).
    penalized: bool = struct.field(pytree_node=False, default=False)
    biased: bool = struct.field(pytree_node=False, default=False)
    sampled: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow | tuple], vocab_size: int,
                  eos_token_ids: int | Iterable[int], history_width: int | None = None,
                  batch_size: int | None = None) -> SamplingTensors:
        """Build the numpy arrays for `rows`, padded to `batch_size` rows (padding rows are greedy).

        W (history width) is the next power of two >= the longest history any penalized row needs
        (prompt + output with a repetition penalty, output only otherwise), at least `MIN_HISTORY_WIDTH`, or 1
        when no row is penalized; `history_width` pins it instead. E is `BAN_WIDTH`, or the next power of two >= the most
        ids a row bans when that is more. Fixed and power-of-two widths keep the distinct shapes (compiled
        programs) few. The per-row work is a few numpy conversions, not Python per field: this runs every step.
        """
        rows = rows if isinstance(rows, list) else list(rows)
        vocab_size = check_int("vocab_size", vocab_size, lo=1)
        b = len(rows) if batch_size is None else check_int("batch_size", batch_size, lo=1)
        if b < len(rows):
            raise ValueError(f"batch_size ({b}) must be >= the number of rows ({len(rows)})")
        eos = check_token_ids("eos_token_ids",
                         (eos_token_ids,) if isinstance(eos_token_ids, numbers.Integral) else eos_token_ids)
        # per distinct SamplingParams object, not per row: a batch's rows mostly share a few (hashing a frozen
        # dataclass of ~20 fields per row would cost more than the rest of the row's work)
        params = [r[0] for r in rows]
        distinct = {id(p): p for p in params}
        for p in distinct.values():
            if not isinstance(p, SamplingParams):
                raise ValueError(f"rows: params must be SamplingParams, got {type(p).__name__}")
        n = len(rows)
        seeds = [r[3] for r in rows]
        if not all(type(x) is int for x in seeds) and not all(  # noqa: E721 (the fast path; bools fail below)
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in seeds):
            raise ValueError("rows: seed must be an int")
        steps = np.fromiter((r[4] for r in rows), np.int64, n)
        if steps.size and steps.min() < 0:
            raise ValueError(f"rows: step must be >= 0, got {int(steps.min())}")

        with np.errstate(over="ignore"):  # a temperature past float32's range becomes inf: uniform, as intended
            by_params = {key: _filter_values(p, vocab_size) for key, p in distinct.items()}
            values = np.array([by_params[id(p)] for p in params], np.float32).reshape(n, 7)
        seed64 = np.array([x % 2**64 for x in seeds], np.uint64)
        bans = {}
        if any(p.min_tokens for p in distinct.values()):
            bans = {i: sorted(set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else set(eos)))
                    for i in np.flatnonzero(steps < np.array([p.min_tokens for p in params], np.int64))}
        penalized = any(p.uses_penalties for p in distinct.values())
        histories = {} if not penalized else {
            i: (list(rows[i][1]) if params[i].repetition_penalty != 1.0 else [], list(rows[i][2]))
            for i in range(n) if params[i].uses_penalties}
        longest = max((len(a) + len(o) for a, o in histories.values()), default=0)
        w = max(MIN_HISTORY_WIDTH, _next_pow2(longest)) if penalized else 1
        if history_width is not None:
            w = check_int("history_width", history_width, lo=1)
            if w < longest:
                raise ValueError(f"history_width ({w}) must be >= the longest history ({longest})")
        e = max(BAN_WIDTH, _next_pow2(max((len(x) for x in bans.values()), default=1)))
        biased = any(p.logit_bias for p in distinct.values())
        biases = {i: params[i].logit_bias for i in range(n) if params[i].logit_bias} if biased else {}
        width = max(BIAS_WIDTH, _next_pow2(max(len(x) for x in biases.values()))) if biased else 1

        def column(j, fill, dtype=np.float32):
            out = np.full(b, fill, dtype)
            out[:n] = values[:, j]
            return out

        t = cls(temperature=column(0, 0.0), top_k=column(1, 0, np.int32), top_p=column(2, 1.0),
                min_p=column(3, 0.0), repetition_penalty=column(4, 1.0), presence_penalty=column(5, 0.0),
                frequency_penalty=column(6, 0.0), seeds=np.zeros((b, 2), np.uint32), steps=np.zeros(b, np.int32),
                history=np.full((b, w), -1, np.int32), history_is_output=np.zeros((b, w), bool),
                banned_token_ids=np.full((b, e), -1, np.int32), bias_token_ids=np.full((b, width), -1, np.int32),
                bias_values=np.zeros((b, width), np.float32))
        t.seeds[:n, 0] = (seed64 & 0xFFFFFFFF).astype(np.uint32)
        t.seeds[:n, 1] = (seed64 >> 32).astype(np.uint32)
        t.steps[:n] = steps
        for i, (prompt, out) in histories.items():  # only penalized rows pay for copying their history
            t.history[i, :len(prompt)] = prompt
            t.history[i, len(prompt):len(prompt) + len(out)] = out
            t.history_is_output[i, len(prompt):len(prompt) + len(out)] = True
        for i, ban in bans.items():
            t.banned_token_ids[i, :len(ban)] = ban
        for i, bias in biases.items():
            t.bias_token_ids[i, :len(bias)] = [token for token, _ in bias]
            t.bias_values[i, :len(bias)] = [value for _, value in bias]
        return t.replace(penalized=penalized, biased=biased, sampled=not all(p.greedy for p in distinct.values()))


@functools.lru_cache(maxsize=4096)
def _filter_values(p: SamplingParams, vocab_size: int) -> tuple:
    """temperature, top_k, top_p, min_p and the three penalties of a row; greedy rows keep the neutral filters
    so they never trigger a filter branch."""
    penalties = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    if p.greedy:
        return (0.0, 0, 1.0, 0.0) + penalties
    return (p.temperature, p.top_k if p.top_k < vocab_size else 0, p.top_p, p.min_p) + penalties


def _rows_index(x: jax.Array, cols: jax.Array) -> jax.Array:
    """Per-row column ids usable by .at[] on x [B,V]: pad / out-of-range ids become V (dropped)."""
    v = x.shape[-1]
    return jnp.where((cols >= 0) & (cols < v), cols, v)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits of the tokens a row's structured-output bitmask (``[B, ceil(V/32)]`` int32, bit ``t % 32`` of word
    ``t // 32``) disallows become -inf; an all-ones row changes nothing."""
    bits = jax.lax.shift_right_logical(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)[None, None]) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]] != 0
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Min-tokens bans (always: a scatter of E ids a row) and, when some row has one (`biased`), the logit bias
    (a scatter-add of L entries a row); then, when some row has one (`penalized`), repetition
    (prompt + output, HF/vLLM: logit > 0 -> /p else *p), frequency (-f * count) and presence (-p if present)
    over output tokens.

    Works by gather/scatter over the [B,W] history so no [B,V] count arrays are built.
    """
    logits = logits.astype(jnp.float32)
    b = logits.shape[0]
    rows = jnp.arange(b)[:, None]
    x = logits.at[rows, _rows_index(logits, t.banned_token_ids)].set(-jnp.inf, mode="drop")
    if t.biased:
        x = x.at[rows, _rows_index(x, t.bias_token_ids)].add(t.bias_values, mode="drop")
    if not t.penalized:
        return x
    cols = _rows_index(x, t.history)
    out_cols = jnp.where(t.history_is_output, cols, x.shape[-1])
    # Repetition: duplicates of a token write the same value, so the scatter is idempotent.
    g = jnp.take_along_axis(x, cols, axis=1, mode="clip")
    p = t.repetition_penalty[:, None]
    x = x.at[rows, cols].set(jnp.where(g > 0, g / p, g * p), mode="drop")
    # Presence once per distinct token (idempotent set), frequency once per occurrence (add).
    g = jnp.take_along_axis(x, out_cols, axis=1, mode="clip")
    x = x.at[rows, out_cols].set(g - t.presence_penalty[:, None], mode="drop")
    freq = jnp.broadcast_to(t.frequency_penalty[:, None], out_cols.shape)
    return x.at[rows, out_cols].add(-freq, mode="drop")


def apply_filters(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Temperature, then min_p, top_k, top_p (vLLM order); filtered-out tokens become -inf.

    Greedy rows (temperature 0) are left at temperature 1 and unfiltered; neutral values (min_p 0, top_k 0,
    top_p 1) keep every token, so one code path serves every sampled batch.
    """
    x = logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]

    def min_p(x):
        cutoff = jnp.max(x, axis=-1, keepdims=True) + jnp.log(t.min_p)[:, None]
        return jnp.where(x >= cutoff, x, -jnp.inf)

    def top_k_top_p(x):
        v = x.shape[-1]
        desc = -jnp.sort(-x, axis=-1)
        k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, v), v)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        probs = jax.nn.softmax(jnp.where(desc >= kth, desc, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        n_keep = jnp.maximum(jnp.sum(before < t.top_p[:, None], axis=-1), 1)
        pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
        cutoff = jnp.maximum(kth, jnp.where(t.top_p[:, None] < 1.0, pth, -jnp.inf))
        return jnp.where(x >= cutoff, x, -jnp.inf)

    return top_k_top_p(min_p(x))


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """key_r = fold_in(fold_in(key(0), seed_r), step_r): a row's randomness depends only on its
    request seed and token index, never on its batch or row position."""
    def one(seed, step):
        k = jax.random.fold_in(jax.random.key(0), seed[0])
        k = jax.random.fold_in(k, seed[1])
        return jax.random.fold_in(k, step)
    return jax.vmap(one)(seeds, steps)


def sample(logits: jax.Array, t: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """logits [B,V] -> (tokens [B] int32, logprobs [B] float32 of the raw logits at the token)."""
    if logits.ndim != 2 or logits.shape[0] != t.temperature.shape[0]:
        raise ValueError(f"logits must be [B={t.temperature.shape[0]}, V], got {logits.shape}")
    logits = logits.astype(jnp.float32)
    raw_lse = jax.nn.logsumexp(logits, axis=-1)
    x = apply_penalties(logits, t)
    greedy_tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    is_greedy = t.temperature <= 0

    def draw(x):
        x = apply_filters(x, t)
        v = x.shape[-1]
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(row_keys(t.seeds, t.steps))
        drawn = jnp.argmax(x + noise, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_tokens, drawn)

    tokens = draw(x) if t.sampled else greedy_tokens
    token_logits = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logits - raw_lse
