"""Everything the engine keeps on the device between steps, as one pytree that every program donates by name.

The step, compression and swap-in programs take a ``DeviceState`` and return the next one; jit's
``donate_argnames=("state",)`` lets XLA update each array in place (a field a program does not change is
passed through, aliased, never copied). Shapes: docs/ARCHITECTURE.md (KV pool, Compression).
"""

import flax.struct
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zipage_jax import parallel
from zipage_jax.compression.query_centres import QueryCentres
from zipage_jax.structured_output.manager import bitmask_words
from zipage_jax.worker import device_memory, kv_cache, kv_scales


@flax.struct.dataclass
class DeviceState:
    k_pool: jax.Array  # [L, num_pages, Hkv, S, D] in the pool dtype (kv_cache.pool_dtype)
    v_pool: jax.Array
    query_cache: jax.Array  # [L, C+1, W, Hq, D]: window queries of the query-row holders (a ring)
    score_cache: jax.Array  # [L, num_pages, Hkv, S] f32: score history of every slot
    token_buffer: jax.Array  # [max_num_seqs + 1] int32: each running request's last sampled token
    # [max_num_seqs + 1, ceil(V/32)] int32 by token row: the structured-output mask of its next token (all ones:
    # unconstrained; ``structured_output.manager``)
    token_bitmask: jax.Array
    # the pre-RoPE query centres that the "triattention" policy scores with ([L, Hq, ...] over query heads, placed
    # by ``place_centres``); a tiny stand-in under the other policies
    query_centres: QueryCentres
    # [2, L, Hkv] f32: an FP8 pool's static K and V scales (``kv_scales``; read only when the pool is FP8)
    kv_scales: jax.Array


def allocate(config, model_cfg, num_pages: int, num_query_rows: int, dtype, mesh) -> DeviceState:
    """The zeroed state, committed to its shardings (pools and caches over heads, the token buffer replicated);
    a pool the allocator did not really grow by is warned about (``device_memory.check_allocated``). An FP8 pool's
    scales start at 1: the worker calibrates them once the weights are loaded."""
    device = mesh.devices.flat[0]
    before = device_memory.in_use(device)
    k_pool, v_pool = kv_cache.allocate_pool(model_cfg, num_pages, config.page_size,
                                            kv_cache.pool_dtype(config, dtype), parallel.kv_head_sharding(mesh))
    query_cache, score_cache = kv_cache.allocate_compression_state(model_cfg, config, num_pages, num_query_rows,
                                                                   dtype, mesh)
    token_buffer = jax.device_put(np.zeros(config.max_num_seqs + 1, np.int32), parallel.replicated(mesh))
    token_bitmask = jax.device_put(np.full((config.max_num_seqs + 1, bitmask_words(model_cfg.vocab_size)), -1,
                                           np.int32), parallel.replicated(mesh))
    centres = jax.device_put(QueryCentres.placeholder(), parallel.replicated(mesh))
    state = DeviceState(k_pool, v_pool, query_cache, score_cache, token_buffer, token_bitmask, centres,
                        kv_scales.unit_scales(model_cfg, mesh))
    device_memory.check_allocated(device, before, device_memory.bytes_on(device, state), "the KV pool and caches")
    return state


def centre_specs(centres: QueryCentres) -> QueryCentres:
    """Partition specs of placed centres: split over query heads (each shard those of its KV heads), frequencies
    replicated; a stand-in replicated whole."""
    if centres.mean.shape[1] == 1:
        return QueryCentres(P(), P(), P())
    return QueryCentres(P(None, parallel.AXIS), P(None, parallel.AXIS), P())


def place_centres(state: DeviceState, centres: QueryCentres, mesh) -> DeviceState:
    """The state with ``centres`` (host arrays) on the devices, split as ``centre_specs`` says."""
    specs = centre_specs(centres)
    placed = QueryCentres(*(jax.device_put(np.asarray(x, np.float32), NamedSharding(mesh, spec))
                            for x, spec in zip((centres.mean, centres.norm, centres.inv_freq),
                                               (specs.mean, specs.norm, specs.inv_freq))))
    return state.replace(query_centres=placed)
