"""FP8 KV pages with static per-(layer, KV head) scales (docs/lab-notes/fp8-kv.md says why this scheme).

A pool slot holds ``x / scale`` in an 8-bit float; ``scale [2, L, Hkv]`` f32 (K's, then V's) is fixed at
start-up. One scale per (layer, head) means nothing moves with a slot: compaction and swaps stay byte copies, and
every kernel reads the raw 8-bit values upcast (exactly) to 16 bits, the scales folded outside it:
``q . (s_k k8) = (s_k q) . k8`` (the queries are scaled per head before the kernel) and ``p @ (s_v v8) = s_v (p @
v8)`` (the output after it). Cosine similarity (key redundancy) does not see a per-head scale at all. A decode's
queries are rounded to e4m3 too (``round_queries``), as vLLM's FP8 attention does: it lets the decode kernel
multiply them with the 8-bit keys as they land in shared memory.
"""

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
SCALE_MARGIN = 4.0  # calibrated amax x this maps to the largest value: real traces reach 2.6x a random prompt's


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in FP8_DTYPES)


def scales_from_amax(amax, dtype):
    """Scales ``[2, L, Hkv]`` from calibrated absolute maxima: ``SCALE_MARGIN * amax`` lands on the largest
    finite value (an all-zero head gets scale 1)."""
    top = float(jnp.finfo(dtype).max)
    return jnp.where(amax > 0, amax * SCALE_MARGIN / top, 1.0).astype(jnp.float32)


def quantize(x, scale, dtype):
    """``x [..., Hkv, D]`` / ``scale [Hkv]`` in ``dtype``, saturated: e4m3fn has no infinity, so an
    out-of-range cast would be NaN."""
    top = float(jnp.finfo(dtype).max)
    y = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(y, -top, top).astype(dtype)


def upcast(x, dtype=jnp.bfloat16):
    """An FP8 tile in a 16-bit float, exactly (every e4m3 / e5m2 value is an f16 and a bf16 value); via f16, the
    conversion Hopper has an instruction for. Other dtypes pass through."""
    if not is_fp8(x.dtype):
        return x
    return x.astype(jnp.float16).astype(dtype)


def scale_queries(q, k_scale):
    """``q [..., Hq, D]`` times its KV head's K scale (``k_scale [..., Hkv]``, broadcast against q's leading axes),
    in q's dtype."""
    group = q.shape[-2] // k_scale.shape[-1]
    return (q.astype(jnp.float32) * jnp.repeat(k_scale, group, axis=-1)[..., None]).astype(q.dtype)


def scale_outputs(out, v_scale):
    """Attention outputs ``[..., Hq, D]`` over dequantized values: times their KV head's V scale."""
    group = out.shape[-2] // v_scale.shape[0]
    return (out.astype(jnp.float32) * jnp.repeat(v_scale, group)[:, None]).astype(out.dtype)


def quantize_queries(q_tiles, dtype=jnp.float8_e4m3fn):
    """Decode queries over FP8 pages: ``q_tiles [B, Hkv, G, D]`` in ``dtype`` over one scale per (row, KV head), its
    largest magnitude on the format's largest value; returns ``(q8, scale [B, Hkv] f32)``, ``q ~ scale * q8``."""
    amax = jnp.max(jnp.abs(q_tiles.astype(jnp.float32)), axis=(2, 3))
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (q_tiles.astype(jnp.float32) / scale[..., None, None]).astype(dtype), scale


def round_queries(q, num_kv_heads):
    """``q [B, Hq, D]`` as a decode over FP8 pages reads it: in e4m3 over one scale per (row, KV head)
    (``quantize_queries``), back in q's dtype. The Mosaic kernel multiplies the e4m3 queries with the 8-bit keys
    directly (an FP8 wgmma, no upcast of K); every other decode path rounds its queries the same way, so that all
    backends agree. Rounding again is a no-op (the scale and every value come back the same). The e4m3 values pass
    an optimization barrier: XLA's GPU compiler may drop a ``f32 -> e4m3 -> f32`` round trip as excess precision
    (``xla_allow_excess_precision``), and then nothing would be rounded (a kernel's 8-bit operand is always real)."""
    batch, num_q_heads, head_dim = q.shape
    q8, scale = quantize_queries(q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim))
    q8 = jax.lax.optimization_barrier(q8)
    return (q8.astype(jnp.float32) * scale[..., None, None]).astype(q.dtype).reshape(q.shape)
