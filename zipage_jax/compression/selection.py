"""Top-k slot selection per (layer, KV head): every head keeps the same count, in original order."""

import jax
import jax.numpy as jnp


def descending_key(scores):
    """int32 keys whose ascending order is the f32 scores' descending order (-0.0 equal to 0.0): an integer
    key lets a one-key stable sort (or a bisection over its bits) stand in for a two-key comparison."""
    bits = jax.lax.bitcast_convert_type(jnp.where(scores == 0, 0.0, scores), jnp.int32)
    return ~(bits ^ ((bits >> 31) & 0x7FFFFFFF))


def sorted_threshold(key, keep: int):
    """``(last_key, last_slot)`` ``[R]``: the ``keep``-th smallest (key, slot) pair of each row of ``key [R, N]``,
    by one stable sort. The jnp path and oracle of the backends' ``selection_threshold`` kernel."""
    slots = jax.lax.broadcasted_iota(jnp.int32, key.shape, 1)
    sorted_key, sorted_slot = jax.lax.sort((key, slots), dimension=1, num_keys=1, is_stable=True)
    return sorted_key[:, keep - 1], sorted_slot[:, keep - 1]


def select_slots(scores, keep: int, threshold=sorted_threshold):
    """Indices ``[..., keep]`` int32 of the ``keep`` best slots along the last axis, ascending.

    Ascending order makes the compaction stable (kept tokens stay in chronological order). Among equal
    scores (pooling makes plateaus) the earlier slot wins on every backend (``lax.top_k`` does not break ties
    by index on CPU). ``threshold(key, keep)`` (``sorted_threshold``, or a backend's
    ``selection_threshold`` kernel) finds each row's ``keep``-th best (key, slot); the kept slots are those
    ranked no worse, packed in slot order by a prefix sum and a scatter: cheaper than sorting the keys and then
    the kept indices (docs/lab-notes/compression.md, one-sort selection).
    """
    num_slots = scores.shape[-1]
    if not 0 < keep <= num_slots:
        raise ValueError(f"keep: must be in [1, {num_slots}] (got {keep})")
    key = descending_key(scores).reshape(-1, num_slots)
    last_key, last_slot = threshold(key, keep)
    slots = jax.lax.broadcasted_iota(jnp.int32, key.shape, 1)
    kept = (key < last_key[:, None]) | ((key == last_key[:, None]) & (slots <= last_slot[:, None]))
    out_pos = jnp.where(kept, jnp.cumsum(kept, axis=1, dtype=jnp.int32) - 1, keep)  # keep: dropped
    rows = jnp.arange(kept.shape[0])[:, None]
    packed = jnp.zeros((kept.shape[0], keep), jnp.int32).at[rows, out_pos].set(slots, mode="drop")
    return packed.reshape(scores.shape[:-1] + (keep,))
