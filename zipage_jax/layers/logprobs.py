"""Log-probabilities on the device: a token's logprob and rank, and the k most likely tokens, of rows of logits.

One layout serves the sampled tokens of a step and the prompt tokens of a prefill: ``ids [N, 2 + k]`` int32
(the token, its rank, the top-k ids) and ``values [N, 1 + k]`` float32 (the token's logprob, the top-k
logprobs), so each comes back to the host in two copies. The top-k never sorts the vocabulary: XLA's GPU top-k
kernel takes k <= 16 and falls back to a full sort beyond, which would cost more than a decode step's sampling.
The k largest entries of a row lie in the k blocks of ``BLOCK`` entries with the largest maxima, so a top-k of
the block maxima and one of those blocks' entries (two arrays of ``V / BLOCK`` and ``k * BLOCK`` per row) give
the exact top-k after a single extra read of the logits.
"""

import jax
import jax.numpy as jnp

BLOCK = 128


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row of ``x [N, V]`` and their ids, largest first (k <= V)."""
    n, v = x.shape
    blocks = -(-v // BLOCK)
    if blocks <= k:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, blocks * BLOCK - v)), constant_values=-jnp.inf).reshape(n, blocks, BLOCK)
    _, best = jax.lax.top_k(padded.max(axis=-1), k)  # [N, k] the blocks holding the top-k
    candidates = jnp.take_along_axis(padded, best[:, :, None], axis=1).reshape(n, k * BLOCK)
    values, at = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best, at // BLOCK, axis=1) * BLOCK + at % BLOCK
    return values, ids


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``logits [N, V]``, ``tokens [N]`` -> ``ids [N, 2 + k]`` (token, rank, top-k ids) and ``values [N, 1 + k]``
    (token logprob, top-k logprobs) of the log-softmax; k is clipped to V. The rank counts the tokens strictly
    more likely, plus one. A token that is the most likely has exactly the top-1 logprob (same arithmetic)."""
    logits = logits.astype(jnp.float32)
    k = min(k, logits.shape[-1])
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
    rank = 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)
    top_values, top_ids = top_k(logits, k)
    ids = jnp.concatenate([tokens[:, None].astype(jnp.int32), rank[:, None], top_ids.astype(jnp.int32)], axis=1)
    return ids, jnp.concatenate([chosen - lse, top_values - lse], axis=1)
