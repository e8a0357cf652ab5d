"""Tensor parallelism: one mesh axis ``tp`` over attention heads and the MLP's hidden dimension.

Parameters, the KV pool and the query/score caches get NamedShardings and XLA (GSPMD) partitions the jitted
steps; the attention kernels run per shard inside ``shard_map`` (see ``attention.ShardedBackend``).
With one device this is the identity: the same code path serves both.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zipage_jax.models.params import LayerParams, Params

AXIS = "tp"


def make_mesh(tensor_parallel_size: int, model_cfg) -> Mesh:
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} exceeds the {len(devices)} devices")
    if model_cfg.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} must divide the model's "
                         f"{model_cfg.num_kv_heads} KV heads")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def param_shardings(params: Params, mesh: Mesh) -> Params:
    """Column-parallel q/k/v/gate/up (and their biases), row-parallel o/down, everything else replicated."""
    def spec(*axes):
        return NamedSharding(mesh, P(*axes))

    rep = spec()
    column, row, column_bias = spec(None, None, AXIS), spec(None, AXIS, None), spec(None, AXIS)
    layers = params.layers

    def maybe(value, sharding):
        return None if value is None else sharding

    return Params(
        embed=rep, final_norm=rep, lm_head=maybe(params.lm_head, rep),
        layers=LayerParams(
            input_norm=rep, post_norm=rep, q_proj=column, k_proj=column, v_proj=column, o_proj=row,
            gate_proj=column, up_proj=column, down_proj=row,
            q_bias=maybe(layers.q_bias, column_bias), k_bias=maybe(layers.k_bias, column_bias),
            v_bias=maybe(layers.v_bias, column_bias),
            q_norm=maybe(layers.q_norm, rep), k_norm=maybe(layers.k_norm, rep)))


def shard_params(params: Params, mesh: Mesh) -> Params:
    return jax.device_put(params, param_shardings(params, mesh))


def kv_head_sharding(mesh: Mesh) -> NamedSharding:
    """The pool ``[L, pages, Hkv, S, D]`` and score cache ``[L, pages, Hkv, S]`` split over KV heads."""
    return NamedSharding(mesh, P(None, None, AXIS))


def query_head_sharding(mesh: Mesh) -> NamedSharding:
    """The query cache ``[L, C, W, Hq, D]`` split over query heads."""
    return NamedSharding(mesh, P(None, None, None, AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
