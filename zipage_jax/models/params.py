"""Parameter pytrees in two layouts, and the one declaration of every weight they hold.

`Params` stacks the layer weights on axis 0, so training and the dense forward `lax.scan` over layers (fast to
compile, one gradient buffer per field). `ServingParams` is what the engine's steps read: one buffer per layer
(a scan would slice each layer out of the stack, and XLA copies such a slice before every matmul, reading the
weights three times) with q/k/v and gate/up fused into one matmul each. `to_serving` builds it at load time.

`WEIGHTS` declares each weight once (as jax-llm-examples' ``ArrayInfo`` does): its logical axes (whence its
shape from the ModelConfig and its tensor-parallel split), the serving buffer it is fused into, its HF tensor
name and layout, its initializer and when the model has it. Shapes (`param_shapes`), the serving layout
(`SERVING_LAYER_PARTS`, `to_serving`), shardings (`param_shardings`), HF loading and export, random init and the
orbax restore are all read off it.

Matrices are stored `[in, out]` (x @ W). Optional fields are None when the architecture lacks them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zipage_jax.parallel import AXIS

# Logical axes: their sizes from the ModelConfig; those split over the tensor-parallel mesh axis give each shard
# its own heads (q, kv: Hq*D and Hkv*D columns, grouped by head) or its share of the MLP's hidden units.
AXIS_SIZES: dict[str, Callable] = {
    "vocab": lambda c: c.vocab_size,
    "hidden": lambda c: c.hidden_size,
    "q": lambda c: c.q_size,
    "kv": lambda c: c.kv_size,
    "mlp": lambda c: c.intermediate_size,
    "head_dim": lambda c: c.head_dim,
}
TENSOR_PARALLEL_AXES = frozenset({"q", "kv", "mlp"})


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight, declared once. A layer weight (named ``layers.X``) has one such array per layer, stacked on a
    leading ``L`` axis in `Params`; ``axes`` and ``hf_name`` describe one layer's."""

    axes: tuple[str, ...]  # logical axes (AXIS_SIZES): the shape, and which axis tensor parallelism splits
    hf_name: str  # the HF tensor, ``{layer}`` standing for the layer index
    transpose: bool = False  # HF stores the matrix [out, in]
    fused: str | None = None  # the ServingLayer buffer it joins (columns, in WEIGHTS order); None: its own
    init: str = "normal"  # random init: "normal" N(0, std), or "ones" 1 + N(0, std) (norm scales)
    present: Callable | None = None  # config -> whether the model has it; None: always

    def __post_init__(self):
        if self.init not in ("normal", "ones") or not set(self.axes) <= set(AXIS_SIZES):
            raise ValueError(f"Weight {self.hf_name}: init must be normal or ones and axes among {list(AXIS_SIZES)}")

    def shape(self, cfg) -> tuple[int, ...]:
        """One layer's shape (the whole shape of a top-level weight)."""
        return tuple(AXIS_SIZES[axis](cfg) for axis in self.axes)

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_name

    def hf_names(self, num_layers: int) -> list[str]:
        """Its HF tensors: one per layer for a layer weight."""
        return [self.hf_name.format(layer=i) for i in range(num_layers)] if self.per_layer else [self.hf_name]

    def spec(self) -> P:
        """Its tensor-parallel partition: the split axes over the mesh axis, or replicated."""
        if not TENSOR_PARALLEL_AXES.intersection(self.axes):
            return P()
        return P(*(AXIS if axis in TENSOR_PARALLEL_AXES else None for axis in self.axes))


def _attention_bias(cfg) -> bool:
    return cfg.attention_bias


def _qk_norm(cfg) -> bool:
    return cfg.qk_norm


def _untied(cfg) -> bool:
    return not cfg.tie_word_embeddings


_LAYER = "model.layers.{layer}."
_ATTN = _LAYER + "self_attn."
_MLP = _LAYER + "mlp."

# Every weight of the llama / qwen2 / qwen3 family. Its order is the order of a fused buffer's parts and seeds
# init_random_params (each weight draws from the key folded with its index): keep it.
WEIGHTS: dict[str, Weight] = {
    "embed": Weight(("vocab", "hidden"), "model.embed_tokens.weight"),
    "layers.input_norm": Weight(("hidden",), _LAYER + "input_layernorm.weight", init="ones"),
    "layers.q_proj": Weight(("hidden", "q"), _ATTN + "q_proj.weight", transpose=True, fused="qkv_proj"),
    "layers.k_proj": Weight(("hidden", "kv"), _ATTN + "k_proj.weight", transpose=True, fused="qkv_proj"),
    "layers.v_proj": Weight(("hidden", "kv"), _ATTN + "v_proj.weight", transpose=True, fused="qkv_proj"),
    "layers.o_proj": Weight(("q", "hidden"), _ATTN + "o_proj.weight", transpose=True),
    "layers.post_norm": Weight(("hidden",), _LAYER + "post_attention_layernorm.weight", init="ones"),
    "layers.gate_proj": Weight(("hidden", "mlp"), _MLP + "gate_proj.weight", transpose=True, fused="gate_up_proj"),
    "layers.up_proj": Weight(("hidden", "mlp"), _MLP + "up_proj.weight", transpose=True, fused="gate_up_proj"),
    "layers.down_proj": Weight(("mlp", "hidden"), _MLP + "down_proj.weight", transpose=True),
    # qwen2
    "layers.q_bias": Weight(("q",), _ATTN + "q_proj.bias", fused="qkv_bias", present=_attention_bias),
    "layers.k_bias": Weight(("kv",), _ATTN + "k_proj.bias", fused="qkv_bias", present=_attention_bias),
    "layers.v_bias": Weight(("kv",), _ATTN + "v_proj.bias", fused="qkv_bias", present=_attention_bias),
    # qwen3
    "layers.q_norm": Weight(("head_dim",), _ATTN + "q_norm.weight", init="ones", present=_qk_norm),
    "layers.k_norm": Weight(("head_dim",), _ATTN + "k_norm.weight", init="ones", present=_qk_norm),
    "final_norm": Weight(("hidden",), "model.norm.weight", init="ones"),
    "lm_head": Weight(("hidden", "vocab"), "lm_head.weight", transpose=True, present=_untied),  # absent: tied
}


def model_weights(cfg) -> dict[str, Weight]:
    """The weights ``cfg``'s model has, in WEIGHTS order."""
    return {name: w for name, w in WEIGHTS.items() if w.present is None or w.present(cfg)}


def param_shapes(cfg) -> dict[str, tuple[int, ...] | None]:
    """Shape of every field (layer fields prefixed `layers.`, stacked: a leading L) for `cfg`; None where the
    model lacks it."""
    present = model_weights(cfg)
    return {name: None if name not in present else
            ((cfg.num_layers,) if name.startswith("layers.") else ()) + w.shape(cfg)
            for name, w in WEIGHTS.items()}


def _serving_layer_parts() -> dict[str, tuple[str, ...]]:
    """ServingLayer field -> the LayerParams fields it holds, in order (several: fused by ``fuse_columns``).

    The parts of a fused buffer are joined along their last axis, which tensor parallelism splits (each shard
    its own columns of every part), so they must agree on everything else."""
    parts: dict[str, tuple[str, ...]] = {}
    for name, w in WEIGHTS.items():
        if name.startswith("layers.") != w.per_layer:
            raise ValueError(f"WEIGHTS: {name} is a layer weight exactly when its HF name has a {{layer}}")
        if name.startswith("layers."):
            field = name.removeprefix("layers.")
            key = w.fused or field
            parts[key] = parts.get(key, ()) + (field,)
    for key, fields in parts.items():
        group = [WEIGHTS["layers." + f] for f in fields]
        first = group[0]
        if len(group) > 1 and (first.axes[-1] not in TENSOR_PARALLEL_AXES or any(
                (w.axes[:-1], w.transpose, w.spec(), w.present) != (first.axes[:-1], first.transpose,
                                                                    first.spec(), first.present)
                or w.axes[-1] not in TENSOR_PARALLEL_AXES for w in group)):
            raise ValueError(f"WEIGHTS: the parts {fields} of {key} must differ only in their split last axis")
    return parts


SERVING_LAYER_PARTS = _serving_layer_parts()


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
    return ServingParams(embed=params.embed, layers=tuple(serving_layer(params.layers, i, shards)
                                                          for i in range(num_layers)),
                         final_norm=params.final_norm, lm_head=params.lm_head, shards=shards)


@functools.partial(jax.jit, static_argnums=2)
def serving_layer(stacked: LayerParams, i, shards: int) -> ServingLayer:
    """Layer ``i`` of ``stacked`` in the serving layout."""
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
    """Where each leaf of ``params`` lives on ``mesh``: each weight's split (``Weight.spec``) — column-parallel
    fused q/k/v and gate/up (and the bias), row-parallel o/down, everything else replicated. A fused buffer
    takes its parts' split; its columns are grouped per shard (see ``ServingLayer``), so an even split gives
    each shard its own heads."""
    def sharding(name: str, value):
        return None if value is None else NamedSharding(mesh, WEIGHTS[name].spec())

    top = {name: sharding(name, getattr(params, name)) for name in WEIGHTS if not name.startswith("layers.")}
    layers = tuple(ServingLayer(**{field: sharding("layers." + parts[0], getattr(layer, field))
                                   for field, parts in SERVING_LAYER_PARTS.items()}) for layer in params.layers)
    return params.replace(layers=layers, **top)
