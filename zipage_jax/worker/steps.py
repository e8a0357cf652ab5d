"""The device functions the worker jits: a decode or prefill step, the prompt-logprobs head, a compression and the
swaps of a compressed request. Pure functions of the ``DeviceState`` they are given (donated by their callers) and
of one packed buffer of step integers (``packing``); ``catalog`` binds them to shapes.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.kv_quant import is_fp8
from zipage_jax import parallel
from zipage_jax.compression.step import compress
from zipage_jax.core.request import PENDING
from zipage_jax.layers.logprobs import token_logprobs
from zipage_jax.layers.sampler import apply_token_bitmask, sample
from zipage_jax.models import forward_paged
from zipage_jax.models.transformer import final_logits
from zipage_jax.sampling_params import MAX_LOGPROBS
from zipage_jax.worker import packing
from zipage_jax.worker.device_state import DeviceState, centre_specs

# Compiler options of every engine program. XLA's rematerialization pass compares a program's footprint with a
# memory limit that the preallocated KV pool always exceeds, and then recomputes work to save memory (in the
# decode step: the fused QKV matmul, three times a layer). The pool sizing already reserves every program's
# scratch, so the pass can only cost time.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
# From this many tokens a step (a decode step: one a row) on, cuBLAS beats XLA's Triton GEMMs (BENCHMARKS.md,
# decode step).
CUBLAS_MIN_TOKENS = 64


def compiler_options(num_tokens: int) -> dict:
    """XLA options of a step program over ``num_tokens`` tokens (its matmuls' first dimension)."""
    if jax.default_backend() == "gpu" and num_tokens >= CUBLAS_MIN_TOKENS:
        return {**COMPILER_OPTIONS, "xla_gpu_enable_triton_gemm": False}
    return COMPILER_OPTIONS


def step(params, state: DeviceState, packed, *, spec, model_cfg, backend, store_queries, hidden_rows,
         hidden_sharding):
    """One decode or prefill step: ``(state, ids, values)`` of the sampled rows (``token_logprobs`` layout), and
    for a prefill the residual stream of its tokens, padded to ``hidden_rows`` so that one prompt-logprobs
    program reads every prefill bucket's."""
    inputs = packing.unpack(packed, spec)
    batch, sampling = inputs["batch"], inputs["sampling"]
    k_pool, v_pool, query_cache, token_buffer = state.k_pool, state.v_pool, state.query_cache, state.token_buffer
    in_flight = token_buffer[inputs["buffer_row"]]
    batch = batch.replace(tokens=jnp.where(inputs["from_buffer"], in_flight, batch.tokens))
    prefill = batch.cu_q_lens is not None
    logits, k_pool, v_pool, *extra = forward_paged(params, model_cfg, k_pool, v_pool, batch, backend,
                                                   return_queries=store_queries, return_hidden=prefill,
                                                   kv_scales=fp8_scales(state))
    if store_queries:  # the window queries that compression scores with: a ring indexed by position % W
        ring = batch.positions % query_cache.shape[2]
        query_cache = query_cache.at[:, inputs["query_row"], ring].set(extra[0].astype(query_cache.dtype))
    logits = apply_token_bitmask(logits, state.token_bitmask[inputs["sample_row"]])
    # penalties must see the token each row is being fed even when the host does not know it yet
    pending = sampling.history_is_output & (sampling.history == PENDING)
    history = jnp.where(pending, token_buffer[inputs["sample_row"]][:, None], sampling.history)
    tokens, _ = sample(logits, sampling.replace(history=history))
    ids, values = token_logprobs(logits, tokens, MAX_LOGPROBS)
    token_buffer = token_buffer.at[inputs["sample_row"]].set(tokens)
    state = state.replace(k_pool=k_pool, v_pool=v_pool, query_cache=query_cache, token_buffer=token_buffer)
    if not prefill:
        return state, ids, values
    hidden = jnp.pad(extra[-1], ((0, hidden_rows - extra[-1].shape[0]), (0, 0)))
    return state, ids, values, jax.lax.with_sharding_constraint(hidden, hidden_sharding)


def fp8_scales(state: DeviceState):
    """An FP8 pool's static scales, or None: a pool in the model's dtype never reads them."""
    return state.kv_scales if is_fp8(state.k_pool.dtype) else None


def set_token_bitmask(state: DeviceState, rows, masks):
    """Write structured-output masks into the bitmask table at these token rows (padding rows: the sink's, all
    ones)."""
    return state.replace(token_bitmask=state.token_bitmask.at[rows].set(masks))


def prompt_logprobs(params, hidden, rows, targets, *, model_cfg):
    """Logprobs (``token_logprobs`` layout) of ``targets [R]``, each predicted by ``hidden[rows]``."""
    return token_logprobs(final_logits(params, model_cfg, hidden[rows]), targets, MAX_LOGPROBS)


def compress_step(state: DeviceState, packed, *, spec, cfg, sm_scale, backend, mesh, max_pages=None):
    """Under tensor parallelism each shard compresses its own KV heads (``shard_map``): a head's scores, selection
    and compaction read only that head and its query group, so the step needs no collective and the backend's
    compression kernels run on one shard's heads. ``max_pages``: the source pages whose scratch the memory plan
    reserved (``compress`` groups layers within it)."""
    def run(k_pool, v_pool, score_cache, query_cache, batch, centres, kv_scales):
        return compress(k_pool, v_pool, score_cache, query_cache, batch, cfg, sm_scale, backend=backend,
                        query_centres=centres, kv_scales=kv_scales, max_pages=max_pages)

    scales = fp8_scales(state)
    if mesh.size > 1:
        heads, scores = parallel.KV_HEADS, parallel.KV_HEADS if cfg.tracks_history else P()  # as allocated
        queries = parallel.QUERY_HEADS if cfg.reads_window_queries else P()
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, scores, queries, P(),
                                                      centre_specs(state.query_centres),
                                                      None if scales is None else heads),
                            out_specs=(heads, heads, scores), check_vma=False)
    k_pool, v_pool, score_cache = run(state.k_pool, state.v_pool, state.score_cache, state.query_cache,
                                      packing.unpack(packed, spec), state.query_centres, scales)
    return state.replace(k_pool=k_pool, v_pool=v_pool, score_cache=score_cache)


def swap_gather(state: DeviceState, pages, query_row, *, history, queries):
    """A compressed request's pages (K, V and, with a score history, scores) and, where the steps record them
    (``queries``), its window queries."""
    scores = state.score_cache[:, pages] if history else jnp.zeros((), jnp.float32)
    window = state.query_cache[:, query_row] if queries else jnp.zeros((), state.query_cache.dtype)
    return state.k_pool[:, pages], state.v_pool[:, pages], scores, window


def swapped_shapes(state: DeviceState, size: int, history: bool, queries: bool) -> tuple:
    """What ``swap_gather`` returns for ``size`` pages, without tracing it (a warm start traces nothing)."""
    def pages(x):
        return jax.ShapeDtypeStruct(x.shape[:1] + (size,) + x.shape[2:], x.dtype)

    scores = pages(state.score_cache) if history else jax.ShapeDtypeStruct((), jnp.float32)
    cache = state.query_cache
    window = jax.ShapeDtypeStruct(cache.shape[:1] + cache.shape[2:] if queries else (), cache.dtype)
    return pages(state.k_pool), pages(state.v_pool), scores, window


def swap_scatter(state: DeviceState, pages, query_row, k, v, scores, window, *, history, queries):
    """``swap_gather``'s inverse: the contents written into the request's new pages and query row."""
    score_cache = state.score_cache.at[:, pages].set(scores) if history else state.score_cache
    query_cache = state.query_cache.at[:, query_row].set(window) if queries else state.query_cache
    return state.replace(k_pool=state.k_pool.at[:, pages].set(k), v_pool=state.v_pool.at[:, pages].set(v),
                         score_cache=score_cache, query_cache=query_cache)
