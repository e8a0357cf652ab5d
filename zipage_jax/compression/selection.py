"""Top-k slot selection per (layer, KV head): every head keeps the same count, in original order."""

import jax
import jax.numpy as jnp


def select_slots(scores, keep: int):
    """Indices ``[..., keep]`` int32 of the ``keep`` best slots along the last axis, ascending.

    Ascending order makes the compaction stable (kept tokens stay in chronological order). Among equal
    scores (pooling makes plateaus) the earlier slot wins on every backend: a two-key sort (score
    descending, slot ascending), because ``lax.top_k`` does not break ties by index on CPU.
    """
    if not 0 < keep <= scores.shape[-1]:
        raise ValueError(f"keep: must be in [1, {scores.shape[-1]}] (got {keep})")
    slots = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    _, order = jax.lax.sort((-scores, slots), dimension=scores.ndim - 1, num_keys=2)
    return jnp.sort(order[..., :keep], axis=-1)
