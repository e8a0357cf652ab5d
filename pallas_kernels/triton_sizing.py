"""Launch sizing of the Triton kernels, kept apart from them so it imports (and is tested) without jax-triton."""

import jax.numpy as jnp

from pallas_kernels.paged_decode import default_num_splits

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


def check_block(name, size):
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def group_rows(group):
    """Rows of the decode query tile: the group padded to a power of two, at least ``tl.dot``'s 16."""
    return max(MIN_DOT_ROWS, 1 << (group - 1).bit_length())


def decode_splits(batch, num_kv_heads, table_width, page_size, block_n, num_splits=None):
    """``(num_splits, split_slots)``: KV splits of whole ``block_n`` blocks covering a row's table.

    ``num_splits`` None fills the GPU (``default_num_splits``). Splits that would start past the table are
    dropped, so every launched split owns at least one block.
    """
    check_block("block_n", block_n)
    max_blocks = -(-table_width * page_size // block_n)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_blocks)
    if not 1 <= num_splits <= max_blocks:
        raise ValueError(f"num_splits must be in [1, {max_blocks}], got {num_splits}")
    blocks_per_split = -(-max_blocks // num_splits)
    return -(-max_blocks // blocks_per_split), blocks_per_split * block_n


def chunk_tiles(cu_q_lens, num_tokens, block_m):
    """Static-size tiling of the packed rows into ``block_m``-row tiles inside single chunks.

    Returns ``(tile_request [N], tile_row0 [N])`` with ``N = cdiv(T, block_m) + R``; ``tile_row0`` counts rows
    from the chunk's start, and unused tiles get one at or past their request's chunk length.
    """
    num_requests = cu_q_lens.shape[0] - 1
    num_tiles = -(-num_tokens // block_m) + num_requests
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tile_end = jnp.cumsum((q_lens + block_m - 1) // block_m)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_request = jnp.clip(jnp.searchsorted(tile_end, tiles, side="right"), 0, num_requests - 1).astype(jnp.int32)
    tile_start = tile_end - (q_lens + block_m - 1) // block_m
    tile_row0 = ((tiles - tile_start[tile_request]) * block_m).astype(jnp.int32)
    return tile_request, tile_row0
