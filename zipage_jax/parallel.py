"""Tensor parallelism: one mesh axis ``tp`` over attention heads and the MLP's hidden dimension.

Parameters, the KV pool and the query/score caches get NamedShardings and XLA (GSPMD) partitions the jitted
steps; the attention kernels run per shard inside ``shard_map`` (see ``layers.attention.sharded``), and so does the
whole compression step (``worker.steps.compress_step``). A decode or prefill step then holds two all-reduces a layer
(after ``o_proj`` and after ``down_proj``) and no other collective; a compression holds none.
With one device this is the identity: the same code path serves both.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


def kv_head_sharding(mesh: Mesh) -> NamedSharding:
    """The pool and the score cache split over KV heads."""
    return NamedSharding(mesh, KV_HEADS)


def query_head_sharding(mesh: Mesh) -> NamedSharding:
    """The query cache split over query heads (shard i holds the query heads of its KV heads)."""
    return NamedSharding(mesh, QUERY_HEADS)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
