"""The static scales of an FP8 KV pool, calibrated once at start-up (docs/lab-notes/fp8-kv.md).

A dense forward of a fixed random-token prompt through the serving weights gives each (layer, KV head)'s largest
|K| and |V|; ``pallas_kernels.kv_quant.scales_from_amax`` leaves a margin of 4 above it (real traces of the shipped
model reach 2.6x the random prompt's |V|). Random tokens, not a text: the engine has no tokenizer at this point.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import scales_from_amax
from zipage_jax import parallel
from zipage_jax.models.transformer import serving_kv

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0


def calibration_tokens(vocab_size: int, length: int = CALIBRATION_TOKENS) -> np.ndarray:
    return np.random.default_rng(CALIBRATION_SEED).integers(0, vocab_size, length).astype(np.int32)


def calibrate(params, model_cfg, kv_dtype, mesh) -> jax.Array:
    """Scales ``[2, L, Hkv]`` f32 (K's, V's), sharded over KV heads like the pool (its head axis is the third too)."""
    tokens = calibration_tokens(model_cfg.vocab_size, min(CALIBRATION_TOKENS, model_cfg.max_position_embeddings))

    @jax.jit
    def run(params, tokens):
        k, v = serving_kv(params, model_cfg, tokens)
        amax = jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 3)) for x in (k, v)])
        return jax.lax.with_sharding_constraint(scales_from_amax(amax, kv_dtype), parallel.kv_head_sharding(mesh))

    return run(params, jnp.asarray(tokens))


def unit_scales(model_cfg, mesh) -> jax.Array:
    """The scales of a pool in the model's dtype: never read, kept so the state has one shape of tree."""
    return jax.device_put(np.ones((2, model_cfg.num_layers, model_cfg.num_kv_heads), np.float32),
                          parallel.kv_head_sharding(mesh))
