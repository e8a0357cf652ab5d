"""Parameter pytrees in two layouts.

`Params` stacks the layer weights on axis 0, so training and the dense forward `lax.scan` over layers (fast to
compile, one gradient buffer per field). `ServingParams` is what the engine's steps read: one buffer per layer
(a scan would slice each layer out of the stack, and XLA copies such a slice before every matmul, reading the
weights three times) with q/k/v and gate/up fused into one matmul each. `to_serving` builds it at load time.

Matrices are stored `[in, out]` (x @ W). Optional fields are None when the architecture lacks them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zipage_jax.parallel import AXIS


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


@struct.dataclass
class ServingLayer:
    """One decoder layer as the engine reads it. Fused columns are grouped per tensor-parallel shard:
    `qkv_proj` is `[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]` for shards 0, 1, ..., so splitting the column
    axis evenly over the shards gives each its own heads (likewise `[gate_s | up_s]` in `gate_up_proj`)."""

    input_norm: jax.Array  # [Hd]
    qkv_proj: jax.Array  # [Hd, (Hq + 2 Hkv) * D]
    o_proj: jax.Array  # [Hq*D, Hd]
    post_norm: jax.Array  # [Hd]
    gate_up_proj: jax.Array  # [Hd, 2 I]
    down_proj: jax.Array  # [I, Hd]
    qkv_bias: jax.Array | None = None  # [(Hq + 2 Hkv) * D] (qwen2)
    q_norm: jax.Array | None = None  # [D] (qwen3)
    k_norm: jax.Array | None = None  # [D]


@struct.dataclass
class ServingParams:
    embed: jax.Array  # [V, Hd]
    layers: tuple[ServingLayer, ...]
    final_norm: jax.Array  # [Hd]
    lm_head: jax.Array | None = None  # [Hd, V]; None = tied to embed
    shards: int = struct.field(pytree_node=False, default=1)  # tensor-parallel groups of the fused columns


def fuse_columns(parts: list[jax.Array], shards: int) -> jax.Array:
    """Concatenate `parts` along the last axis, grouped per shard: [p0_s0 | p1_s0 | ... | p0_s1 | p1_s1 | ...]."""
    split = [jnp.split(p, shards, axis=-1) for p in parts]
    return jnp.concatenate([piece for s in range(shards) for piece in (pieces[s] for pieces in split)], axis=-1)


def unfuse_columns(fused: jax.Array, sizes: tuple[int, ...], shards: int) -> list[jax.Array]:
    """Inverse of `fuse_columns` for parts of total widths `sizes` (each divisible by `shards`)."""
    lead = fused.shape[:-1]
    grouped = fused.reshape(*lead, shards, sum(sizes) // shards)
    parts, start = [], 0
    for size in sizes:
        width = size // shards
        parts.append(grouped[..., start:start + width].reshape(*lead, size))
        start += width
    return parts


def to_serving(params: Params, shards: int = 1) -> ServingParams:
    """The engine's layout of `params`: per-layer buffers, fused q/k/v and gate/up (columns grouped by shard)."""
    num_layers = params.layers.input_norm.shape[0]
    return ServingParams(embed=params.embed, layers=tuple(_serving_layer(params.layers, i, shards)
                                                          for i in range(num_layers)),
                         final_norm=params.final_norm, lm_head=params.lm_head, shards=shards)


# ServingLayer field -> the LayerParams fields it holds, in order (several: fused by ``fuse_columns``)
SERVING_LAYER_PARTS = {
    "input_norm": ("input_norm",), "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "post_norm": ("post_norm",), "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
    "qkv_bias": ("q_bias", "k_bias", "v_bias"), "q_norm": ("q_norm",), "k_norm": ("k_norm",),
}


@functools.partial(jax.jit, static_argnums=2)
def _serving_layer(stacked: LayerParams, i, shards: int) -> ServingLayer:
    layer = jax.tree.map(lambda x: x[i], stacked)
    fields = {}
    for field, parts in SERVING_LAYER_PARTS.items():
        values = [getattr(layer, part) for part in parts]
        if values[0] is None or len(values) == 1:
            fields[field] = values[0]
        else:
            fields[field] = fuse_columns(values, shards)
    return ServingLayer(**fields)


def param_shardings(params: ServingParams, mesh: Mesh) -> ServingParams:
    """Column-parallel fused q/k/v and gate/up (and the bias), row-parallel o/down, everything else replicated.
    The fused columns are grouped per shard (see ``ServingLayer``), so an even split gives each shard its heads."""
    def spec(*axes):
        return NamedSharding(mesh, P(*axes))

    rep = spec()
    column, row = spec(None, AXIS), spec(AXIS, None)

    def maybe(value, sharding):
        return None if value is None else sharding

    return params.replace(
        embed=rep, final_norm=rep, lm_head=maybe(params.lm_head, rep),
        layers=tuple(ServingLayer(
            input_norm=rep, post_norm=rep, qkv_proj=column, o_proj=row, gate_up_proj=column, down_proj=row,
            qkv_bias=maybe(layer.qkv_bias, spec(AXIS)), q_norm=maybe(layer.q_norm, rep),
            k_norm=maybe(layer.k_norm, rep)) for layer in params.layers))
