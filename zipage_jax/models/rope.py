"""Rotary position embeddings (HF layout: rotate_half over two contiguous halves), incl. llama3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.models.config import Llama3RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, computed on the host like HF does."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [head_dim], float32."""
    inv_freq = jnp.asarray(inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., heads, D] by cos/sin [..., D] (broadcast over heads); math in f32, result in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return (xf * cos + rotated * sin).astype(x.dtype)
