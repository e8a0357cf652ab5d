"""Stable compaction of kept slots into destination pages (K, V and the score cache alike).

Slot ``i`` of a request's slot axis lives at ``(table[i // S], i % S)``. The kept slots are gathered
completely before anything is scattered, so source and destination pages may overlap (in-place compaction
into the request's own first pages).
"""

import jax.numpy as jnp

from pallas_kernels.reference import row_layers


def gather_slots(cache, layer, slots, tables):
    """Values of ``cache [L, pages, Hkv, S, ...]`` at per-head slots ``slots [B, Hkv, K]`` of ``tables [B, P]``
    (``layer``: one, or one per row ``[B]``)."""
    page_size = cache.shape[3]
    rows = jnp.arange(slots.shape[0])[:, None, None]
    heads = jnp.arange(slots.shape[1])[None, :, None]
    layers = row_layers(layer, slots.shape[0])[:, None, None]
    return cache[layers, tables[rows, slots // page_size], heads, slots % page_size]  # [B, Hkv, K, ...]


def scatter_slots(cache, layer, values, dst_tables, valid):
    """Write ``values [B, Hkv, K, ...]`` to slots ``0..K-1`` of ``dst_tables [B, K // S]`` of ``layer`` (one, or one
    per row ``[B]``).

    Rows not ``valid`` write nothing at all (not even to the null page). The valid rows' dst pages must be
    distinct within a layer (within and across rows; the page manager's own / copy-on-write pages are): every written
    (page, head, slot) is then unique, so the scatter is declared ``unique_indices`` (plain stores instead of
    GPU atomics). Invalid rows get distinct out-of-range pages, dropped, so they keep the indices unique.
    """
    num_pages, page_size = cache.shape[1], cache.shape[3]
    slots = jnp.arange(values.shape[2])
    spare = num_pages + jnp.arange(dst_tables.size, dtype=dst_tables.dtype).reshape(dst_tables.shape)
    pages = jnp.where(valid[:, None], dst_tables, spare)[:, slots // page_size]  # spare pages: out of range
    heads = jnp.arange(values.shape[1])[None, :, None]
    layers = row_layers(layer, values.shape[0])[:, None, None]
    return cache.at[layers, pages[:, None, :], heads, (slots % page_size)[None, None, :]].set(
        values.astype(cache.dtype), mode="drop", unique_indices=True
    )


def compact_slots(k_pool, v_pool, layer, kept, src_tables, dst_tables, valid):
    """K and V with the kept slots ``kept [B, Hkv, K]`` of ``src_tables`` packed into ``dst_tables``: the XLA
    path (CPU, tensor parallel, oracle) of the backends' in-place ``compact_slots`` kernel, same signature."""
    k_kept, v_kept = gather_slots(k_pool, layer, kept, src_tables), gather_slots(v_pool, layer, kept, src_tables)
    return scatter_slots(k_pool, layer, k_kept, dst_tables, valid), scatter_slots(v_pool, layer, v_kept, dst_tables,
                                                                                     valid)
