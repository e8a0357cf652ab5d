"""The device KV pool, the compression state, and their sizing from a memory budget.

Layout ``[L, num_pages, Hkv, S, D]`` for K and for V: a (page, head) tile is one contiguous ``S x D`` block,
what both the TMA loads of the kernels and per-head compaction want. Page 0 is the null page.
"""

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax import parallel
from zipage_jax.core.memory_plan import MemoryPlan
from zipage_jax.layers import attention
from zipage_jax.worker import device_memory

CPU_DEFAULT_KV_BYTES = 512 * 2**20  # CPU devices report no memory limit
KV_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def pool_dtype(config, dtype):
    """The KV pool's dtype: ``kv_cache_dtype``'s FP8 format, or the model's ``dtype`` (``auto``)."""
    return jnp.dtype(KV_DTYPES.get(config.kv_cache_dtype, dtype))


def page_bytes(model_cfg, page_size: int, dtype, with_score: bool = False) -> int:
    """Bytes of one page of K and V across all layers (plus its f32 score-cache entry where the engine keeps a
    score history: ``EngineConfig.tracks_history``)."""
    slots = model_cfg.num_layers * model_cfg.num_kv_heads * page_size
    return slots * (2 * model_cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if with_score else 0))


def query_row_bytes(model_cfg, config, dtype) -> int:
    """One row of the query cache: the last ``W`` post-RoPE queries of one request, all layers and heads."""
    c = model_cfg
    return c.num_layers * config.scoring.window * c.num_heads * c.head_dim * jnp.dtype(dtype).itemsize


def step_scratch_bytes(model_cfg, config, dtype, max_model_len: int, backend_name: str) -> int:
    """Upper estimate of the temporaries of the largest prefill or decode step (f32 activations).

    The reference attention materialises, per request, the gathered K/V of its whole page table (in the pool
    dtype and cast to f32) and, per query, f32 logits, masked logits and weights against them; the kernels
    stream pages instead.
    """
    it = jnp.dtype(dtype).itemsize
    c, span = model_cfg, -(-max_model_len // config.page_size) * config.page_size
    tokens, rows = config.max_num_batched_tokens, config.max_num_prefill_seqs
    width = (4 * c.hidden_size + 3 * c.intermediate_size + 2 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * 4
    queries = c.num_layers * tokens * c.num_heads * c.head_dim * it if config.compression else 0
    sample = 16 * c.vocab_size * 4 + 4 * max_model_len * 4  # logits, sort keys/indices, penalty history
    bitmask_table = (config.max_num_seqs + 1) * -(-c.vocab_size // 32) * 4  # structured outputs' masks
    prefill = tokens * width + queries + rows * sample + bitmask_table
    decode = config.max_num_seqs * (width + sample) + bitmask_table
    gathered = 2 * c.num_kv_heads * span * c.head_dim * (it + 4)
    fp8 = config.kv_cache_dtype != "auto"  # FP8 pages and Triton's kernels, which have no FP8 path (layers/attention.py)
    if backend_name == "reference":
        prefill += gathered + 3 * c.num_heads * tokens * span * 4
    elif fp8 and backend_name == "triton":  # its prefill kernel reads 16-bit copies of the step's pages
        prefill += 2 * (rows * span + config.page_size) * c.num_kv_heads * c.head_dim * it
    if backend_name == "reference" or (fp8 and backend_name == "triton"):
        decode += config.max_num_seqs * (gathered + 3 * c.num_heads * span * 4)
    return int(max(prefill, decode))


COMPRESSION_ROWS = 64  # rows of the widest steady-state dispatch whose scratch is reserved by default


def compression_scratch_bytes(model_cfg, config, dtype, pages: int, fused: bool = False) -> int:
    """Upper estimate of the temporaries of one compression dispatch over ``pages`` (padded) source pages.

    ``pages`` counts every layer of a group compressed together (``compression.step.compress`` groups layers
    within the reserved pages, so one layer of ``pages`` pages bounds any group). The jnp / XLA path: the gathered
    keys, one window query's logits, a handful of f32 score vectors, the redundancy similarities of one page against the rest,
    the kept K/V. ``fused`` (the Mosaic kernels: window scores, lightning redundancy, in-place compaction):
    only the score vectors and the kept slots' pool rows, plus the gathered keys and similarities of "full"
    redundancy, which stays jnp, and the kept K/V of the small dispatches that compact through XLA
    (``attention.compaction_by_rows``).
    """
    it = jnp.dtype(dtype).itemsize
    c, slots = model_cfg, pages * config.page_size
    keys_and_similarities = c.head_dim * it + config.page_size * 4
    small_compactions = 0
    if fused:
        per_slot = c.num_kv_heads * (9 * 4 + (keys_and_similarities if config.scoring.redundancy == "full" else 0))
        kept_kv = 2 * c.num_kv_heads * config.kv_budget_pages * config.page_size * c.head_dim * it  # one row's
        small_compactions = attention.XLA_COMPACTION_MAX_ROWS * kept_kv
    else:
        per_slot = c.num_kv_heads * (2 * c.head_dim * it + 8 * 4 + keys_and_similarities) + 2 * c.num_heads * 4
    history = slots * c.num_kv_heads * 4 * 2 if config.tracks_history else 0
    return int(slots * per_slot + history + small_compactions)


def plan_memory(config, model_cfg, dtype, max_model_len: int,
                backend: attention.AttentionBackend = attention.REFERENCE, device=None,
                allocator: device_memory.Allocator | None = None, weights_bytes: int | None = None) -> MemoryPlan:
    """Pool size, query rows ``C`` and concurrency from the memory budget (docs/ARCHITECTURE.md, Memory plan).

    From the device (the default): the engine's share of the card (``gpu_memory_utilization`` of it, within the
    allocator's limit: ``device_memory.read``) less what is allocated (the weights: ``weights_bytes``, counted from
    the engine's arrays, else what the allocator has in use) and a headroom; from it the
    peak scratch of the largest step and of the largest compression batch (plus one request's swap staging) is
    reserved first, so a full pool never leaves a step without room. ``C = available / (page_bytes * (M + 1) +
    query_row_bytes)``: every query-row holder can reach its steady state of ``M + 1`` pages; requests without a
    query row (hybrid admission) live on the remaining pages. An explicit pool (``kv_cache_memory_bytes``,
    ``num_gpu_pages_override``) that does not fit beside the weights and the scratch is a ValueError naming it.

    The budget is per device (like the device's memory), and so are the page and query-row bytes: with
    ``tensor_parallel_size`` devices a page costs each of them ``1 / tensor_parallel_size`` of its bytes (the
    scratch estimates stay those of one device holding every head: an upper bound).
    """
    S, M = config.page_size, config.kv_budget_pages
    shards = config.tensor_parallel_size  # divides the KV heads, hence the query heads
    pages_per_seq = -(-max_model_len // S)
    kv_dtype = pool_dtype(config, dtype)  # FP8 pages: one byte a value (their static scales: a few bytes a layer)
    per_page = page_bytes(model_cfg, S, kv_dtype, config.tracks_history) // shards
    row_bytes = query_row_bytes(model_cfg, config, dtype) // shards if config.stores_window_queries else 0
    max_comp = 0
    if config.compression:
        max_comp = config.max_compression_pages or max(pages_per_seq, min(config.max_num_seqs, COMPRESSION_ROWS) * (M + 1))
        if max_comp < pages_per_seq:
            raise ValueError(f"max_compression_pages: {max_comp} cannot hold the {pages_per_seq} pages of one "
                             f"request of max_model_len={max_model_len}")
    step = step_scratch_bytes(model_cfg, config, dtype, max_model_len, backend.name)
    comp = 0
    if config.compression:
        comp = compression_scratch_bytes(model_cfg, config, dtype, max_comp, backend.fused_compression)
    swap = (M + 1) * per_page + row_bytes if config.compression else 0
    scratch = step + comp + swap
    memory = device_memory.read(device or jax.local_devices()[0], config.gpu_memory_utilization, allocator,
                                weights_bytes)
    reserved = 0  # scratch is reserved from a budget taken from the device only
    if config.num_gpu_pages_override is not None:
        budget, source = None, "num_gpu_pages_override"
    elif config.kv_cache_memory_bytes is not None:
        budget, source = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif memory is None:
        budget, source = CPU_DEFAULT_KV_BYTES, "cpu_default"
    else:
        budget = memory.share_bytes - memory.taken_bytes - device_memory.HEADROOM_BYTES
        source, reserved = "gpu_memory_utilization", scratch
    cap = config.max_num_seqs * pages_per_seq + 1
    if budget is None:
        num_pages = config.num_gpu_pages_override
        rows = config.num_query_rows or min(config.max_num_seqs, max(1, (num_pages - 1) // (M + 1)))
    else:
        available = max(0, budget - reserved)
        rows = 0
        if config.compression:
            holder = (M + 1) * per_page + row_bytes
            rows = config.num_query_rows or min(config.max_num_seqs, available // holder)
        num_pages = min(max(0, available - (rows + 1) * row_bytes) // per_page, cap)
    if not config.compression:
        rows = 0
    pool = int(num_pages) * per_page + ((rows + 1) * row_bytes if row_bytes else 0)
    if num_pages < pages_per_seq + 1 or (config.compression and rows < 1):
        field = "kv_cache_memory_bytes" if source == "cpu_default" else source
        raise ValueError(f"{field}: {_budget_text(memory, budget, reserved)} holds {num_pages} pages of {per_page} "
                         f"bytes and {rows} query rows; one request of max_model_len={max_model_len} needs "
                         f"{pages_per_seq + 1} pages" + (" and a query row" if row_bytes else "")
                         + f" (lower max_model_len or raise {field})")
    if memory is not None and source in ("kv_cache_memory_bytes", "num_gpu_pages_override"):
        room = memory.limit_bytes - memory.taken_bytes - scratch - device_memory.HEADROOM_BYTES
        if pool > room:
            raise ValueError(
                f"{source}: a KV pool of {_gib(pool)} does not fit: jax's allocator holds {_gib(memory.limit_bytes)} "
                f"of the {_gib(memory.card_bytes)} card ({memory.allocator.source}), the weights take "
                f"{_gib(memory.in_use_bytes)}{_held_text(memory)}, the step scratch {_gib(scratch)} and the headroom "
                f"{_gib(device_memory.HEADROOM_BYTES)}, which leaves {_gib(max(0, room))} (lower {source}, or let "
                f"the engine hold more of the card: gpu_memory_utilization)")
    compressed = min(rows, (num_pages - 1) // (M + 1)) if config.compression else 0
    if not config.compression:
        concurrency = config.max_num_seqs
    elif config.admission != "constrained":
        concurrency = config.max_num_seqs
    else:
        concurrency = rows
    return MemoryPlan(
        max_model_len=max_model_len, dtype=jnp.dtype(dtype), kv_dtype=kv_dtype, budget_source=source, budget_bytes=budget,
        card_bytes=memory and memory.card_bytes, share_bytes=memory and memory.share_bytes,
        weights_bytes=memory and memory.in_use_bytes,
        headroom_bytes=memory and memory.share_bytes - memory.taken_bytes - pool - scratch,
        held_bytes=memory and memory.held_bytes,
        reserved_step_scratch_bytes=step if reserved else 0,
        reserved_compression_scratch_bytes=comp if reserved else 0, reserved_swap_bytes=swap if reserved else 0,
        step_scratch_bytes=step, compression_scratch_bytes=comp, swap_bytes=swap,
        page_bytes=per_page, num_pages=int(num_pages), pool_bytes=int(num_pages) * per_page,
        query_row_bytes=row_bytes, num_query_rows=int(rows),
        query_cache_bytes=(rows + 1) * row_bytes if row_bytes else 0,
        max_compression_pages=int(max_comp), pages_per_seq=pages_per_seq,
        max_concurrency=int(concurrency), max_compressed_concurrency=int(compressed),
        full_length_concurrency=int(min(config.max_num_seqs, (num_pages - 1) // pages_per_seq)))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _held_text(memory) -> str:
    return f", other arrays on the device {_gib(memory.held_bytes)}" if memory.held_bytes else ""


def _budget_text(memory, budget, reserved: int) -> str:
    """How a budget came about, for an error message."""
    if budget is None:
        return "the pool"
    if not reserved:
        return f"a budget of {budget} bytes"
    return (f"the engine's share of the {_gib(memory.card_bytes)} card, {_gib(memory.share_bytes)}, less the "
            f"weights ({_gib(memory.in_use_bytes)}){_held_text(memory)}, the headroom "
            f"({_gib(device_memory.HEADROOM_BYTES)}) and the step scratch ({_gib(reserved)}),")


def allocate_pool(model_cfg, num_pages: int, page_size: int, dtype, pool_sharding=None):
    """Zeroed K and V pools, created once on the device (optionally sharded over KV heads).

    Committed to their sharding, like the step outputs that replace them, so the first step does not compile
    an executable of its own. The zeros are a fill of a runtime operand, each pool its own execution: a program
    whose output is a constant can hand back pools that the allocator never held, and the first step, donating
    them, then allocates the missing pool after warm-up has fragmented the free memory, and can fail.
    """
    pool_sharding = pool_sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shape = (model_cfg.num_layers, num_pages, model_cfg.num_kv_heads, page_size, model_cfg.head_dim)
    make = jax.jit(lambda fill: jnp.full(shape, fill, dtype), out_shardings=pool_sharding)
    return make(np.zeros((), dtype)), make(np.zeros((), dtype))


def allocate_compression_state(model_cfg, config, num_pages: int, num_query_rows: int, dtype, mesh):
    """Query cache ``[L, C+1, W, Hq, D]`` (row C is the sink of requests without a query row) and score cache
    ``[L, num_pages, Hkv, S]`` f32 (``config.stores_window_queries``, ``config.tracks_history``); tiny stand-ins
    when unused."""
    layers = model_cfg.num_layers
    if config.stores_window_queries:
        q_shape = (layers, num_query_rows + 1, config.scoring.window, model_cfg.num_heads, model_cfg.head_dim)
    else:
        q_shape = (1, 1, 1, 1, 1)
    if config.tracks_history:
        s_shape = (layers, num_pages, model_cfg.num_kv_heads, config.page_size)
    else:
        s_shape = (1, 1, 1, 1)
    q_sharding = parallel.query_head_sharding(mesh) if config.stores_window_queries else parallel.replicated(mesh)
    s_sharding = parallel.kv_head_sharding(mesh) if config.tracks_history else parallel.replicated(mesh)
    make = jax.jit(lambda fill: (jnp.full(q_shape, fill, dtype), jnp.full(s_shape, fill, jnp.float32)),
                   out_shardings=(q_sharding, s_sharding))  # a runtime fill: see allocate_pool
    return make(np.zeros((), np.float32))
