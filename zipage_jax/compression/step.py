"""One compression of a batch of requests over all layers: score, select, compact (docs/ARCHITECTURE.md, Compression).

The caches ride in a ``fori_loop`` carry over groups of layers, each addressed by index, so under donation the
compaction is in place and the scratch is one group's worth (see ``compress``). A group's (layer, request) pairs are
the rows of one call of each kernel: a dispatch of a few requests still fills the card.
"""

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import scale_queries
from pallas_kernels.reference import row_layers
from zipage_jax.compression.compaction import scatter_slots
from zipage_jax.compression.scoring import paged_redundancy_scores, protect, recency_scores, zipage_scores
from zipage_jax.compression.selection import select_slots
from zipage_jax.compression.trig_scores import paged_trig_scores
from zipage_jax.config import EVICTION_POLICIES, REDUNDANCY_MODES, ScoringConfig


@flax.struct.dataclass
class CompressionBatch:
    """The requests of one compression dispatch, ``B`` rows (bucket-padded), as int32 / bool arrays: what
    ``compress`` reads, as ``PagedBatch`` is what a model step reads.

    ``src_tables [B, P]``: live pages in order (first ``num_src_pages`` valid, all full).
    ``dst_tables [B, M]``: pages receiving the ``M * S`` kept slots (own first pages, or copy-on-write pages).
    ``query_rows [B]``: query-cache row; ``logical_lens [B]``: window queries are positions
    ``logical_len - W .. logical_len - 1``; ``compressed_before [B]``: has score history;
    ``valid [B]``: padding rows change nothing.
    """

    src_tables: jax.Array
    num_src_pages: jax.Array
    dst_tables: jax.Array
    query_rows: jax.Array
    logical_lens: jax.Array
    compressed_before: jax.Array
    valid: jax.Array


def _check(k_pool, score_cache, query_cache, batch, cfg, query_centres):
    num_layers, _, num_kv_heads, page_size, head_dim = k_pool.shape
    if cfg.eviction_policy not in EVICTION_POLICIES:
        raise ValueError(f"cfg.eviction_policy: must be one of {EVICTION_POLICIES} (got {cfg.eviction_policy!r})")
    if cfg.redundancy not in REDUNDANCY_MODES:
        raise ValueError(f"cfg.redundancy: must be one of {REDUNDANCY_MODES} (got {cfg.redundancy!r})")
    if cfg.eviction_policy == "zipage":
        if query_cache.ndim != 5 or query_cache.shape[0] != num_layers or query_cache.shape[2] != cfg.window \
                or query_cache.shape[3] % num_kv_heads or query_cache.shape[4] != head_dim:
            raise ValueError(f"query_cache: expected [{num_layers}, C, {cfg.window}, Hq, {head_dim}] with Hq a "
                             f"multiple of {num_kv_heads} (got {query_cache.shape})")
    if cfg.eviction_policy == "triattention":
        shape = None if query_centres is None else query_centres.mean.shape
        if shape is None or len(shape) != 3 or shape[0] != num_layers or shape[1] % num_kv_heads \
                or shape[2] != head_dim:
            raise ValueError(f"query_centres: expected mean [{num_layers}, Hq, {head_dim}] with Hq a multiple of "
                             f"{num_kv_heads} (got {shape})")
    if cfg.tracks_history and score_cache.shape != k_pool.shape[:4]:
        raise ValueError(f"score_cache: expected {k_pool.shape[:4]} (got {score_cache.shape})")
    num_slots = batch.src_tables.shape[1] * page_size
    keep = batch.dst_tables.shape[1] * page_size
    if not cfg.window + cfg.sink_tokens <= keep < num_slots:
        raise ValueError(f"batch.dst_tables: keeps {keep} slots; needs window + sink_tokens "
                         f"({cfg.window + cfg.sink_tokens}) <= kept < {num_slots} source slots")


def _layer_scores(k_pool, score_cache, query_cache, batch, layer, cfg, sm_scale, backend, query_centres=None,
                  kv_scales=None):
    """Score the requests from the caches at ``layer`` (one, or one per row ``[B]``): ``(final, G)``, each
    ``[B, Hkv, N]``. An FP8 pool's K scale goes into the window queries (redundancy, a cosine, and the query-free
    scores, ranked per head, do not see a per-head scale)."""
    num_rows, num_pages_per_row = batch.src_tables.shape
    page_size, num_kv_heads = k_pool.shape[3], k_pool.shape[2]
    num_slots = num_pages_per_row * page_size
    if cfg.eviction_policy == "window":
        score = recency_scores(num_rows, num_kv_heads, num_slots)
        history = jnp.zeros_like(score)
    elif cfg.eviction_policy == "triattention":  # the future queries follow the last position written
        score = paged_trig_scores(k_pool, layer, batch.src_tables, query_centres, batch.logical_lens - 1)
        history = jnp.zeros_like(score)
    else:
        layers = row_layers(layer, num_rows)
        ring = (batch.logical_lens[:, None] - cfg.window + jnp.arange(cfg.window)) % cfg.window
        queries = query_cache[layers[:, None], batch.query_rows[:, None], ring]  # [B, W, Hq, D]
        if kv_scales is not None:
            queries = scale_queries(queries, kv_scales[0, layers][:, None])
        attn = backend.window_scores(k_pool, layer, batch.src_tables, batch.num_src_pages * page_size, queries,
                                     sm_scale)
        redundancy = None
        if cfg.redundancy != "off":
            redundancy = paged_redundancy_scores(k_pool, layer, batch.src_tables, batch.num_src_pages, cfg,
                                                 backend.lightning_row_sums)
        history = None
        if cfg.tracks_history:
            history = score_cache[layers[:, None], batch.src_tables].transpose(0, 2, 1, 3).reshape(attn.shape)
        score, history = zipage_scores(attn, redundancy, history, batch.num_src_pages, batch.compressed_before,
                                       page_size, cfg)
    return protect(score, batch.num_src_pages, batch.valid, page_size, cfg), history


def slot_scores(k_pool, score_cache, query_cache, batch, cfg: ScoringConfig, sm_scale, backend, query_centres=None,
                kv_scales=None):
    """The final per-slot selection score ``[B, L, Hkv, N]`` f32 (protected +inf, padding -inf), N = P * S."""
    _check(k_pool, score_cache, query_cache, batch, cfg, query_centres)
    per_layer = jax.lax.map(
        lambda layer: _layer_scores(k_pool, score_cache, query_cache, batch, layer, cfg, sm_scale, backend,
                                    query_centres, kv_scales)[0],
        jnp.arange(k_pool.shape[0]),
    )
    return per_layer.transpose(1, 0, 2, 3)


def layer_group(num_layers: int, rows: int, width: int, max_pages: int | None) -> int:
    """Layers compressed together: the most that divide ``num_layers`` with ``group * rows * width`` source pages
    within ``max_pages`` (the scratch the memory plan reserved, for one layer of that many pages); 1 without it."""
    if not max_pages:
        return 1
    return max(g for g in range(1, num_layers + 1) if num_layers % g == 0 and (g == 1 or g * rows * width <= max_pages))


def _tiled(batch: CompressionBatch, group: int) -> CompressionBatch:
    """The batch's rows once per layer of a group: row ``g * B + b`` is request ``b`` at the group's layer ``g``."""
    return jax.tree.map(lambda x: jnp.tile(x, (group,) + (1,) * (x.ndim - 1)), batch)


def compress(k_pool, v_pool, score_cache, query_cache, batch: CompressionBatch, cfg: ScoringConfig, sm_scale,
             backend, query_centres=None, kv_scales=None, max_pages: int | None = None):
    """Compress every valid request of ``batch``: per (layer, KV head) keep the top ``M * S`` slots.

    ``query_centres`` (``QueryCentres``) are what the "triattention" policy scores with (read by no other).
    Returns ``(k_pool, v_pool, score_cache)``; pages outside the valid rows' ``dst_tables`` are untouched.
    The score cache receives the kept slots' G when ``cfg.tracks_history``; otherwise it is neither read
    nor written (it may then be a placeholder of any shape). Jit with ``cfg`` and ``backend`` (the
    ``AttentionBackend`` whose window-scores, lightning-redundancy, selection and compaction kernels run) static
    and the three caches donated.
    Every valid row must have ``num_src_pages >= M + 1`` full pages. An FP8 pool comes with its static scales
    ``kv_scales [2, L, Hkv]``: its kept slots move as bytes, the scales stay.

    Scratch is one layer's worth (f32 = 4 bytes, ``it`` = pool itemsize, N = P * S): a few ``B*Hkv*N*4``
    score vectors; with the jnp window attention, one window query's logits ``B*Hq*N*4`` and the request
    keys ``B*Hkv*N*D*it`` (the kernel reads the pool pages instead: ``pallas_kernels.scoring``); jnp redundancy
    gathers the keys and adds ``B*Hkv*S*S*4`` (lightning) or ``B*Hkv*N*S*4`` (full) per column page (the
    lightning kernel reads the pool pages: ``pallas_kernels.redundancy``); then the
    kept K and V ``2*B*Hkv*M*S*D*it`` (none with the compaction kernel: ``pallas_kernels.compaction``).
    Nothing scales with ``W * Hq * N``.

    A device loop over groups of layers (``layer_group``: as many as ``max_pages`` source pages allow, all 36 of
    Qwen3-8B for a dispatch of one request at the steady width): each kernel runs once per group over its
    (layer, request) rows. One layer at a time, a dispatch of a few requests left most of the card idle (a CTA per
    request and head walking its slots) and its cost was fixed, 36 layers of four kernels whatever the rows.
    The layers' work is independent, so the order changes no result.
    """
    _check(k_pool, score_cache, query_cache, batch, cfg, query_centres)
    num_layers = k_pool.shape[0]
    rows, width = batch.src_tables.shape
    group = layer_group(num_layers, rows, width, max_pages)
    keep = batch.dst_tables.shape[1] * k_pool.shape[3]
    tiled = _tiled(batch, group)
    offsets = jnp.repeat(jnp.arange(group, dtype=jnp.int32), rows)  # each tiled row's layer within the group

    def group_step(i, caches):
        k_pool, v_pool, score_cache = caches
        layers = i * group + offsets
        scores, history = _layer_scores(k_pool, score_cache, query_cache, tiled, layers, cfg, sm_scale, backend,
                                        query_centres, kv_scales)
        kept = select_slots(scores, keep, backend.selection_threshold)  # [G * B, Hkv, keep]
        k_pool, v_pool = backend.compact_slots(k_pool, v_pool, layers, kept, tiled.src_tables, tiled.dst_tables,
                                               tiled.valid)
        if cfg.tracks_history:
            kept_history = jnp.take_along_axis(history, kept, axis=2)
            score_cache = scatter_slots(score_cache, layers, kept_history, tiled.dst_tables, tiled.valid)
        return k_pool, v_pool, score_cache

    return jax.lax.fori_loop(0, num_layers // group, group_step, (k_pool, v_pool, score_cache))
