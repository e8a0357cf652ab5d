"""Tensor parallelism: one mesh axis ``tp`` over attention heads and the MLP's hidden dimension.

Parameters, the KV pool and the query/score caches get NamedShardings and XLA (GSPMD) partitions the jitted
steps; the attention kernels run per shard inside ``shard_map`` (see ``attention.sharded``), and so does the
whole compression step (``runner._compress_step``). A decode or prefill step then holds two all-reduces a layer
(after ``o_proj`` and after ``down_proj``) and no other collective; a compression holds none.
With one device this is the identity: the same code path serves both.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zipage_jax.models.params import Params, ServingLayer, ServingParams, to_serving

AXIS = "tp"
KV_HEADS = P(None, None, AXIS)  # the pool [L, pages, Hkv, S, D] and the score cache [L, pages, Hkv, S]
QUERY_HEADS = P(None, None, None, AXIS)  # the query cache [L, C+1, W, Hq, D]


def join_processes(config) -> None:
    """Several hosts: join the others through ``jax.distributed.initialize``, once per process and before anything
    asks for a device; ``jax.devices()`` then lists every process's devices and ``make_mesh`` spans them. One
    process (``coordinator_address`` None): nothing to do."""
    if config.coordinator_address is None or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=config.coordinator_address, num_processes=config.num_processes,
                               process_id=config.process_id)


def make_mesh(tensor_parallel_size: int, model_cfg) -> Mesh:
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} exceeds the {len(devices)} devices")
    if model_cfg.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} must divide the model's "
                         f"{model_cfg.num_kv_heads} KV heads")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


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


def shard_params(params: Params, mesh: Mesh) -> ServingParams:
    """The engine's weights: ``params`` in the serving layout (fused per shard of ``mesh``), placed on it."""
    serving = to_serving(params, mesh.size)
    return jax.device_put(serving, param_shardings(serving, mesh))


def kv_head_sharding(mesh: Mesh) -> NamedSharding:
    """The pool and the score cache split over KV heads."""
    return NamedSharding(mesh, KV_HEADS)


def query_head_sharding(mesh: Mesh) -> NamedSharding:
    """The query cache split over query heads (shard i holds the query heads of its KV heads)."""
    return NamedSharding(mesh, QUERY_HEADS)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
