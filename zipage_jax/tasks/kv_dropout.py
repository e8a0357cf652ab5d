"""KV dropout: training masks that evict like the engine, independently of any scoring rule.

Why: the engine evicts per (layer, KV head), so each head of a compressed request sees its own scattered subset
of the old tokens; a model trained only on whole contexts (or one mask for all heads) breaks on that (the accuracy
lab's eviction trace). Here every (layer, KV head) of an eviction row draws its own random subset of the old
tokens, at one budget per row from ``BUDGET_RANGE`` (the share of old tokens kept), besides the first ``SINKS``
tokens and a recent window of ``WINDOW_RANGE`` tokens that every head keeps, as the engine's sinks and protected
window do. Nothing depends on the task or on what a score would keep, so the model learns to tolerate eviction
in general rather than ours.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SINKS = 4  # the first tokens of the chat template, which every head keeps
BUDGET_RANGE = (0.05, 0.5)  # share of the old tokens (outside sinks and window) a head keeps, one draw per row
WINDOW_RANGE = (24, 48)  # recent tokens every head keeps (inclusive): the engine's window and open page hold 16..31


def sample_kv_dropout(batch: int, seq_len: int, num_layers: int, num_kv_heads: int, rng: np.random.Generator,
                      evict_fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(window [B] int32, keep [B, L, Hkv, T] bool, budget [B] f32)``: a row is an eviction row with probability
    ``evict_fraction``; its heads keep the sinks and each old token with probability ``budget``, independently per
    (layer, KV head, token). Other rows keep everything (window ``seq_len``, budget 1)."""
    if not 0.0 <= evict_fraction <= 1.0:
        raise ValueError(f"evict_fraction must be in [0, 1], got {evict_fraction}")
    window = np.full(batch, seq_len, np.int32)
    budget = np.ones(batch, np.float32)
    keep = np.ones((batch, num_layers, num_kv_heads, seq_len), bool)
    for i in range(batch):
        if rng.random() >= evict_fraction:
            continue
        window[i] = rng.integers(WINDOW_RANGE[0], WINDOW_RANGE[1] + 1)
        budget[i] = rng.uniform(*BUDGET_RANGE)
        keep[i] = rng.random((num_layers, num_kv_heads, seq_len)) < budget[i]
        keep[i, ..., :SINKS] = True
    return window, keep, budget


def kv_dropout_mask(window, keep):
    """``[L, B, Hkv, T, T]`` bool (query, key), ``models.forward_dense``'s per-(layer, KV head) mask: causal, and
    key s visible to query t iff t - s < window or keep[s]. Built on the device inside the jitted step, so only
    ``[B]`` and ``[B, L, Hkv, T]`` travel per batch."""
    t = keep.shape[-1]
    q = jnp.arange(t)[:, None]
    k = jnp.arange(t)[None, :]
    recent = (q - k)[None] < window[:, None, None]  # [B, T, T]
    visible = recent[:, None, None] | keep[:, :, :, None, :]  # [B, L, Hkv, T, T]
    return ((k <= q) & visible).transpose(1, 0, 2, 3, 4)
