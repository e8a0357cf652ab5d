"""The device KV pool and its sizing from a memory budget.

Layout ``[L, num_pages, Hkv, S, D]`` for K and for V: a (page, head) tile is one contiguous ``S x D`` block,
what both the TMA loads of the kernels and per-head compaction want. Page 0 is the null page.
"""

import logging

import jax
import jax.numpy as jnp

from zipage_jax import sharding

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 512 * 2**20  # CPU devices report no memory limit


def page_bytes(model_cfg, block_size: int, dtype, with_score: bool = False) -> int:
    """Bytes of one page of K and V across all layers (plus its f32 score-cache entry with the global score)."""
    slots = model_cfg.num_layers * model_cfg.num_kv_heads * block_size
    return slots * (2 * model_cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if with_score else 0))


def query_cache_bytes(model_cfg, config, dtype) -> int:
    """The window-query ring of every token slot (plus the sink row), only with compression on."""
    if not config.compression:
        return 0
    return (model_cfg.num_layers * (config.max_num_seqs + 1) * config.window * model_cfg.num_heads
            * model_cfg.head_dim * jnp.dtype(dtype).itemsize)


def device_free_bytes(device, utilization: float) -> int:
    """Memory the KV pool may take: ``utilization`` of the device limit minus what is already in use."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return CPU_DEFAULT_KV_BYTES
    return int(stats["bytes_limit"] * utilization) - int(stats.get("bytes_in_use", 0))


def num_pages_for(config, model_cfg, dtype, max_model_len: int, reserved_bytes: int = 0) -> int:
    """Pool size in pages (null page included), never more than ``max_num_seqs`` full-length requests need."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = device_free_bytes(jax.devices()[0], config.gpu_memory_utilization) - reserved_bytes
    budget -= query_cache_bytes(model_cfg, config, dtype)
    per_page = page_bytes(model_cfg, config.block_size, dtype, config.compression and config.global_score)
    pages_per_seq = -(-max_model_len // config.block_size)
    num_pages = min(budget // per_page, config.max_num_seqs * pages_per_seq + 1)
    if num_pages < pages_per_seq + 1:
        raise ValueError(f"kv_cache_memory_bytes: a budget of {budget} bytes holds {budget // per_page} pages of "
                         f"{per_page} bytes; one request of max_model_len={max_model_len} needs "
                         f"{pages_per_seq + 1} (lower max_model_len or raise the budget)")
    return int(num_pages)


def allocate_pool(model_cfg, num_pages: int, block_size: int, dtype, pool_sharding=None):
    """Zeroed K and V pools, created once on the device (optionally sharded over KV heads).

    Committed to their sharding, like the step outputs that replace them, so the first step does not compile
    an executable of its own.
    """
    pool_sharding = pool_sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shape = (model_cfg.num_layers, num_pages, model_cfg.num_kv_heads, block_size, model_cfg.head_dim)
    make = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), out_shardings=pool_sharding)
    return make()


def allocate_compression_state(model_cfg, config, num_pages: int, dtype, mesh):
    """Query cache ``[L, C+1, W, Hq, D]`` and score cache ``[L, num_pages, Hkv, S]`` f32; tiny stand-ins when unused."""
    layers = model_cfg.num_layers
    if config.compression:
        q_shape = (layers, config.max_num_seqs + 1, config.window, model_cfg.num_heads, model_cfg.head_dim)
    else:
        q_shape = (1, 1, 1, 1, 1)
    if config.compression and config.global_score:
        s_shape = (layers, num_pages, model_cfg.num_kv_heads, config.block_size)
    else:
        s_shape = (1, 1, 1, 1)
    q_sharding = sharding.query_head_sharding(mesh) if config.compression else sharding.replicated(mesh)
    s_sharding = sharding.kv_head_sharding(mesh) if config.compression and config.global_score \
        else sharding.replicated(mesh)
    make = jax.jit(lambda: (jnp.zeros(q_shape, dtype), jnp.zeros(s_shape, jnp.float32)),
                   out_shardings=(q_sharding, s_sharding))
    return make()
