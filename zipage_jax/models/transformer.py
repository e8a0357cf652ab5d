"""Functional llama / qwen2 / qwen3 decoder: a dense forward (training, parity) over the layer-stacked `Params`
and a paged forward (engine) over `ServingParams`. Matmuls run in the params dtype; norms, RoPE, softmax and the
final logits are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.kv_quant import quantize, scale_outputs, scale_queries
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.params import LayerParams, Params, ServingLayer, ServingParams, unfuse_columns
from zipage_jax.models.rope import apply_rope, rope_cos_sin


@struct.dataclass
class PagedBatch:
    """Packed tokens of one engine step.

    `cu_q_lens is None` marks a decode step (one token per row, T == R); otherwise row r owns tokens
    [cu_q_lens[r], cu_q_lens[r+1]), the last ones of its kv_lens[r] tokens. `logits_indices` picks the
    tokens whose logits are returned.
    """

    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32 logical positions (RoPE)
    slot_mapping: jax.Array  # [T] int32 flat slot page * S + offset
    kv_lens: jax.Array  # [R] int32 physical lengths including this step's tokens
    page_tables: jax.Array  # [R, P] int32
    logits_indices: jax.Array  # [N] int32
    cu_q_lens: jax.Array | None = None  # [R+1] int32, None for decode


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in f32, cast back to x.dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _heads(q, k, v, q_norm, k_norm, cfg: ModelConfig, cos: jax.Array, sin: jax.Array):
    """Projections [..., Hq*D] / [..., Hkv*D] -> post-RoPE q [..., Hq, D], k/v [..., Hkv, D] (Qwen3's q/k norms)."""
    lead = q.shape[:-1]
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _gated(gate: jax.Array, up: jax.Array, down_proj: jax.Array) -> jax.Array:
    return (jax.nn.silu(gate) * up) @ down_proj


def _qkv(layer: LayerParams, cfg: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array):
    """Post-RoPE q [..., Hq, D], k/v [..., Hkv, D] for normed hidden states h [..., Hd]."""
    q, k, v = h @ layer.q_proj, h @ layer.k_proj, h @ layer.v_proj
    if layer.q_bias is not None:
        q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
    return _heads(q, k, v, layer.q_norm, layer.k_norm, cfg, cos, sin)


def _mlp(layer: LayerParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
    return _gated(h @ layer.gate_proj, h @ layer.up_proj, layer.down_proj)


def final_logits(params: Params | ServingParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """f32 logits [..., V] of residual-stream states x [..., Hd]: the final norm, then the (tied) LM head."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h, params.lm_head, preferred_element_type=jnp.float32)


def _dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float, mask=None) -> jax.Array:
    """q [B,T,Hq,D], k/v [B,T,Hkv,D] -> [B,T,Hq,D]; causal (or `mask` [T,T] / [B,T,T] / [B,Hkv,T,T]), GQA by
    grouping query heads, f32 softmax."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    causal = jnp.tril(jnp.ones((t, t), dtype=bool)) if mask is None else mask
    if causal.ndim == 3:  # per row: broadcast over the KV heads and their query groups
        causal = causal[:, None, None]
    elif causal.ndim == 4:  # per row and KV head: broadcast over each head's query group
        causal = causal[:, :, None]
    scores = jnp.where(causal, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def forward_dense(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
                  attention_mask: jax.Array | None = None, return_queries: bool = False):
    """Causal forward over whole sequences without a cache: tokens [B,T] -> logits [B,T,V] float32.

    Differentiable and jit-friendly (`cfg` must be static). `positions` [B,T] or [T] defaults to 0..T-1.
    `attention_mask` [T,T] or per row [B,T,T] (query, key) replaces the causal mask, e.g. to express which
    tokens an eviction kept; [L,B,Hkv,T,T] gives each layer and KV head its own (an eviction is per head).
    `return_queries`: also the pre-RoPE queries [L,B,T,Hq,D] (what query centres are calibrated from).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    t = tokens.shape[1]
    per_head = (cfg.num_layers, tokens.shape[0], cfg.num_kv_heads, t, t)
    if attention_mask is not None and attention_mask.shape not in ((t, t), (*tokens.shape, t), per_head):
        raise ValueError(f"attention_mask must be [T, T], [B, T, T] or {list(per_head)} for tokens {tokens.shape}, "
                         f"got shape {attention_mask.shape}")
    if positions is None:
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, tokens.shape)
    cos, sin = rope_cos_sin(positions, cfg)
    sm_scale = cfg.head_dim ** -0.5

    layer_masks = attention_mask is not None and attention_mask.ndim == 5

    def layer_step(x, xs):
        layer, mask = xs if layer_masks else (xs, attention_mask)
        q, k, v = _qkv(layer, cfg, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin)
        attn = _dense_causal_attention(q, k, v, sm_scale, mask)
        x = x + attn.reshape(*x.shape[:-1], cfg.q_size) @ layer.o_proj
        return x + _mlp(layer, cfg, x), (apply_rope(q, cos, -sin) if return_queries else None)

    xs = (params.layers, attention_mask) if layer_masks else params.layers
    x, queries = jax.lax.scan(layer_step, params.embed[tokens], xs)
    logits = final_logits(params, cfg, x)
    return (logits, queries) if return_queries else logits


def _fused_qkv(layer: ServingLayer, cfg: ModelConfig, shards: int, h: jax.Array, cos: jax.Array, sin: jax.Array):
    """`_qkv` with one matmul: post-RoPE q [T, Hq, D], k/v [T, Hkv, D]."""
    qkv = h @ layer.qkv_proj
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    q, k, v = unfuse_columns(qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size), shards)
    return _heads(q, k, v, layer.q_norm, layer.k_norm, cfg, cos, sin)


def _fused_mlp(layer: ServingLayer, cfg: ModelConfig, shards: int, x: jax.Array) -> jax.Array:
    h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
    gate, up = unfuse_columns(h @ layer.gate_up_proj, (cfg.intermediate_size,) * 2, shards)
    return _gated(gate, up, layer.down_proj)


def serving_kv(params: ServingParams, cfg: ModelConfig, tokens: jax.Array):
    """Post-RoPE K and V ``[L, T, Hkv, D]`` of one sequence ``tokens [T]`` through the serving weights (a dense
    causal forward): what an FP8 pool's scales are calibrated from (``worker.kv_scales``)."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    cos, sin = rope_cos_sin(positions, cfg)
    x, keys, values = params.embed[tokens], [], []
    for layer in params.layers:
        q, k, v = _fused_qkv(layer, cfg, params.shards, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin)
        attn = _dense_causal_attention(q[None], k[None], v[None], cfg.head_dim ** -0.5)[0]
        x = x + attn.reshape(x.shape[0], cfg.q_size) @ layer.o_proj
        x = x + _fused_mlp(layer, cfg, params.shards, x)
        keys.append(k)
        values.append(v)
    return jnp.stack(keys), jnp.stack(values)


@functools.partial(jax.jit, static_argnames=("cfg", "shards", "backend"))
def _paged_layer(layer: ServingLayer, x, k_pool, v_pool, index, batch: PagedBatch, cos, sin, kv_scales, *,
                 cfg: ModelConfig, shards: int, backend):
    """One decoder layer of ``forward_paged``: ``(x, k_pool, v_pool, q)``. With ``kv_scales`` (an FP8 pool) the
    write quantizes and the scales are folded around the attention (``pallas_kernels.kv_quant``)."""
    q, k, v = _fused_qkv(layer, cfg, shards, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin)
    q_attn = q
    if kv_scales is not None:
        k_scale, v_scale = kv_scales[0, index], kv_scales[1, index]
        k, v = quantize(k, k_scale, k_pool.dtype), quantize(v, v_scale, v_pool.dtype)
        q_attn = scale_queries(q, k_scale)
    k_pool, v_pool = backend.write_kv(k_pool, v_pool, index, batch.slot_mapping, k, v)
    sm_scale = cfg.head_dim ** -0.5
    if batch.cu_q_lens is None:
        attn = backend.decode(q_attn, k_pool, v_pool, index, batch.kv_lens, batch.page_tables, sm_scale)
    else:
        attn = backend.prefill(q_attn, k_pool, v_pool, index, batch.cu_q_lens, batch.kv_lens, batch.page_tables,
                               sm_scale)
    if kv_scales is not None:
        attn = scale_outputs(attn, v_scale)
    x = x + attn.reshape(x.shape[0], cfg.q_size) @ layer.o_proj
    return x + _fused_mlp(layer, cfg, shards, x), k_pool, v_pool, q


def forward_paged(
    params: ServingParams,
    cfg: ModelConfig,
    k_pool: jax.Array,
    v_pool: jax.Array,
    batch: PagedBatch,
    backend,
    return_queries: bool = False,
    return_hidden: bool = False,
    kv_scales: jax.Array | None = None,
):
    """One engine step over packed tokens with the paged KV pool.

    Writes this step's K/V at `batch.slot_mapping`, attends through `backend` (a static object with
    write_kv / decode / prefill, see docs/ARCHITECTURE.md) and returns
    `(logits [N,V] f32, k_pool, v_pool)`; with `return_queries=True` also the post-RoPE queries
    `[L, T, Hq, D]` (input of compression scoring), then with `return_hidden=True` the residual stream of every
    token after the last layer `[T, Hd]` (`final_logits` of a row gives its logits: prompt logprobs). An FP8 pool
    comes with its static scales `kv_scales [2, L, Hkv]` (`pallas_kernels.kv_quant`); the queries returned are
    unscaled.

    The layer loop is unrolled over `ServingParams`' per-layer buffers, so every matmul reads its weights in
    place (a scan would copy each layer's slice of stacked weights first); the pools are addressed by layer
    index, never sliced, and updated in place under donation. Each layer calls one jitted `_paged_layer`, traced
    once per program.
    """
    cos, sin = rope_cos_sin(batch.positions, cfg)
    x = params.embed[batch.tokens]
    queries = []
    for index, layer in enumerate(params.layers):
        # one traced function for every layer (the index is an operand): a program traces and lowers one layer,
        # not 36, and XLA inlines the 36 calls
        x, k_pool, v_pool, q = _paged_layer(layer, x, k_pool, v_pool, jnp.int32(index), batch, cos, sin, kv_scales,
                                            cfg=cfg, shards=params.shards, backend=backend)
        queries.append(q)
    out = (final_logits(params, cfg, x[batch.logits_indices]), k_pool, v_pool)
    if return_queries:
        out += (jnp.stack(queries),)
    if return_hidden:
        out += (x,)
    return out
