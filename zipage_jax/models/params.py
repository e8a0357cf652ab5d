"""Parameter pytrees. Layer weights are stacked on axis 0 so the forward pass can `lax.scan` over layers.

Matrices are stored `[in, out]` (x @ W). Optional fields are None when the architecture lacks them.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class LayerParams:
    input_norm: jax.Array  # [L, Hd]
    q_proj: jax.Array  # [L, Hd, Hq*D]
    k_proj: jax.Array  # [L, Hd, Hkv*D]
    v_proj: jax.Array  # [L, Hd, Hkv*D]
    o_proj: jax.Array  # [L, Hq*D, Hd]
    post_norm: jax.Array  # [L, Hd]
    gate_proj: jax.Array  # [L, Hd, I]
    up_proj: jax.Array  # [L, Hd, I]
    down_proj: jax.Array  # [L, I, Hd]
    q_bias: jax.Array | None = None  # [L, Hq*D] (qwen2)
    k_bias: jax.Array | None = None  # [L, Hkv*D]
    v_bias: jax.Array | None = None  # [L, Hkv*D]
    q_norm: jax.Array | None = None  # [L, D] (qwen3)
    k_norm: jax.Array | None = None  # [L, D]


@struct.dataclass
class Params:
    embed: jax.Array  # [V, Hd]
    layers: LayerParams
    final_norm: jax.Array  # [Hd]
    lm_head: jax.Array | None = None  # [Hd, V]; None = tied to embed


def param_shapes(cfg) -> dict[str, tuple[int, ...] | None]:
    """Shape of every field (layer fields prefixed `layers.`) for `cfg`; None where the model lacks it."""
    L, Hd, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv, D = cfg.q_size, cfg.kv_size, cfg.head_dim
    bias = cfg.attention_bias
    return {
        "embed": (cfg.vocab_size, Hd),
        "layers.input_norm": (L, Hd),
        "layers.q_proj": (L, Hd, q),
        "layers.k_proj": (L, Hd, kv),
        "layers.v_proj": (L, Hd, kv),
        "layers.o_proj": (L, q, Hd),
        "layers.post_norm": (L, Hd),
        "layers.gate_proj": (L, Hd, I),
        "layers.up_proj": (L, Hd, I),
        "layers.down_proj": (L, I, Hd),
        "layers.q_bias": (L, q) if bias else None,
        "layers.k_bias": (L, kv) if bias else None,
        "layers.v_bias": (L, kv) if bias else None,
        "layers.q_norm": (L, D) if cfg.qk_norm else None,
        "layers.k_norm": (L, D) if cfg.qk_norm else None,
        "final_norm": (Hd,),
        "lm_head": None if cfg.tie_word_embeddings else (Hd, cfg.vocab_size),
    }


def params_from_flat(flat: dict) -> Params:
    """Build Params from a `param_shapes`-style dict of arrays (missing/None entries stay None)."""
    layers = {k.removeprefix("layers."): v for k, v in flat.items() if k.startswith("layers.")}
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**layers),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )
