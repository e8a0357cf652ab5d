"""The Triton (Ampere) attention backend: selection and launch sizing on CPU; the kernels against the jnp
references on a GPU (``gpu`` marker; jax-triton kernels cannot run on CPU).

GPU tests use fresh random bf16 inputs (the seed is in the failure message), lengths that are not page
multiples, empty padding rows, and device memory refilled with NaN just before each call, so kernel outputs
allocated there start poisoned (best effort: XLA's allocator usually reuses the freed block).
"""

import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import paged_decode_ref, ragged_prefill_ref
from pallas_kernels.triton_sizing import chunk_tiles, decode_splits, group_rows
from zipage_jax.layers import attention
from zipage_jax.layers.attention import BACKENDS, REFERENCE, default_backend_name, resolve_backend
from helpers import assert_close
from seeds import fresh_seed, seeded_rng

needs_triton_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu" or importlib.util.find_spec("jax_triton") is None,
    reason="needs an NVIDIA GPU and jax-triton")


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


@pytest.mark.parametrize("platform,capability,expected", [
    ("cpu", None, "reference"), ("gpu", "8.0", "triton"), ("gpu", "8.6", "triton"), ("gpu", "8.9", "triton"),
    ("gpu", "9.0", "mosaic"), ("gpu", "10.0", "mosaic")])
def test_auto_selection_by_compute_capability(platform, capability, expected):
    assert default_backend_name(fake_device(platform, capability)) == expected


def test_auto_rejects_pre_ampere_gpus():
    with pytest.raises(ValueError, match="attention_backend.*7.5"):
        default_backend_name(fake_device("gpu", "7.5"))


def forget(monkeypatch, mapping, key):
    """Remove ``key`` for this test only (also dropping whatever the test adds under it)."""
    monkeypatch.setitem(mapping, key, None)
    del mapping[key]


@pytest.fixture
def without_jax_triton(monkeypatch):
    """jax_triton not importable, and no Triton kernel module or backend loaded yet."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)
    for module in ("pallas_kernels.triton_decode", "pallas_kernels.triton_prefill"):
        forget(monkeypatch, sys.modules, module)
    forget(monkeypatch, BACKENDS, "triton")


def test_triton_without_jax_triton_is_a_clear_error(without_jax_triton):
    with pytest.raises(ValueError, match="attention_backend: 'triton' needs jax-triton"):
        resolve_backend("triton")
    assert "triton" not in BACKENDS


def test_auto_on_ampere_resolves_to_triton(without_jax_triton, monkeypatch):
    monkeypatch.setattr(attention.jax, "devices", lambda: [fake_device("gpu", "8.0")])
    with pytest.raises(ValueError, match="'triton' needs jax-triton"):
        resolve_backend()


def test_triton_registers_when_its_kernels_import(monkeypatch):
    forget(monkeypatch, BACKENDS, "triton")
    stand_ins = {}
    for module, kernel in (("pallas_kernels.triton_decode", "paged_decode"),
                           ("pallas_kernels.triton_prefill", "ragged_prefill")):
        stand_ins[kernel] = types.ModuleType(module)  # stands in for the kernel module
        setattr(stand_ins[kernel], kernel, lambda *args, name=kernel: name)
        monkeypatch.setitem(sys.modules, module, stand_ins[kernel])
    backend = resolve_backend("triton")
    assert backend.name == "triton" and BACKENDS["triton"] is backend
    # a 16-bit pool goes to the kernel (an FP8 one through the jnp reference: the kernel has no FP8 path)
    assert backend.decode(None, jnp.zeros((1, 2, 1, 4, 8), jnp.bfloat16)) == "paged_decode"
    pool = jnp.zeros((1, 2, 1, 4, 8), jnp.bfloat16)
    assert backend.prefill(None, pool, pool, 0, None, None, None, 1.0) == "ragged_prefill"
    assert backend.write_kv is REFERENCE.write_kv  # KV write: the XLA scatter
    assert backend.window_scores is REFERENCE.window_scores  # no Triton scoring kernel: jnp scoring
    assert not backend.fused_compression


@pytest.mark.parametrize("table_width,page_size,block_n,num_splits,expected", [
    (8, 64, 64, 3, (3, 192)),
    (5, 64, 64, 4, (3, 128)),  # 2 blocks a split: a 4th split would start past the table
    (10, 16, 64, 1, (1, 192)),  # 160 slots round up to 3 blocks
    (1, 256, 16, 16, (16, 16)),
])
def test_decode_splits(table_width, page_size, block_n, num_splits, expected):
    assert decode_splits(2, 8, table_width, page_size, block_n, num_splits) == expected


def test_decode_splits_default_fills_the_gpu_and_covers_the_table():
    assert decode_splits(1, 1, 32, 256, 64) == (128, 64)  # one CTA per block: still under two waves
    assert decode_splits(64, 8, 32, 256, 64) == (1, 8192)  # 512 CTAs fill the GPU without splitting
    rng = seeded_rng()
    for _ in range(50):
        width, page, block = int(rng.integers(1, 40)), int(rng.choice([16, 64, 256])), int(rng.choice([16, 64]))
        slots = width * page
        num, split = decode_splits(int(rng.integers(1, 300)), int(rng.integers(1, 9)), width, page, block)
        assert split % block == 0 and num * split >= slots and (num - 1) * split < slots, (width, page, block)


@pytest.mark.parametrize("kwargs,bad", [
    (dict(block_n=48), "block_n"), (dict(block_n=8), "block_n"),
    (dict(num_splits=0), "num_splits"), (dict(num_splits=5), "num_splits")])
def test_decode_splits_rejects_bad_sizes(kwargs, bad):
    args = dict(batch=1, num_kv_heads=1, table_width=4, page_size=16, block_n=16) | kwargs  # 4 blocks
    with pytest.raises(ValueError, match=bad):
        decode_splits(**args)


@pytest.mark.parametrize("group,rows", [(1, 16), (4, 16), (8, 16), (16, 16), (24, 32), (32, 32), (64, 64)])
def test_group_rows(group, rows):
    assert group_rows(group) == rows


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_chunk_tiles_cover_every_row_once_inside_its_chunk(block_m):
    rng = seeded_rng()
    q_lens = rng.integers(0, 3 * block_m, size=int(rng.integers(1, 7)))
    q_lens[rng.integers(len(q_lens))] = 0
    num_tokens = int(q_lens.sum()) + int(rng.integers(0, 9))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tile_request, tile_row0 = map(np.asarray, chunk_tiles(cu, num_tokens, block_m))
    assert tile_request.shape == tile_row0.shape == (-(-num_tokens // block_m) + len(q_lens),)
    covered = [(r, row) for r, row0 in zip(tile_request, tile_row0) if row0 < q_lens[r]
               for row in range(row0, min(row0 + block_m, q_lens[r]))]
    assert sorted(covered) == [(r, row) for r in range(len(q_lens)) for row in range(q_lens[r])], q_lens
    used = tile_row0 < q_lens[tile_request]
    assert (tile_row0[used] % block_m == 0).all()


# ---------------------------------------------------------------- GPU: kernels against the references

def random_case(rng, kv_lens, page_size, num_kv_heads, head_dim, num_layers=2):
    """Pools in bf16 and page tables with distinct random pages per live slot (unused entries: null page 0)."""
    pages_per_row = max(-(-n // page_size) for n in kv_lens) + 1
    num_pages = len(kv_lens) * pages_per_row + 2
    shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    ids = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(kv_lens), pages_per_row), np.int32)
    for row, n in enumerate(kv_lens):
        for i in range(-(-n // page_size)):
            tables[row, i] = next(ids)
    return k_pool, v_pool, jnp.asarray(tables)


def poison_freed_memory(nbytes=1 << 28):
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready()  # freed at once, NaN left behind


DECODE_CASES = [
    # group, head_dim, page_size, block_n, num_splits, kv_lens, compute_capability
    (1, 128, 16, 64, None, [70, 0, 33, 1000], None),  # a block spans 4 pages; empty padding row
    (4, 128, 256, 64, 3, [300, 0, 513, 1], 80),      # blocks are page slices; Ampere code; empty splits
    (8, 64, 16, 16, 2, [150, 0, 64, 1], None),       # one page a block
    (8, 128, 128, 128, None, [1000, 77, 0], 80),
]


@pytest.mark.gpu
@needs_triton_gpu
@pytest.mark.parametrize("group,head_dim,page_size,block_n,num_splits,kv_lens,capability", DECODE_CASES)
def test_triton_decode_matches_reference(group, head_dim, page_size, block_n, num_splits, kv_lens, capability):
    from pallas_kernels.triton_decode import paged_decode
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_kv_heads, layer, scale = 2, 1, head_dim ** -0.5
    k_pool, v_pool, tables = random_case(rng, kv_lens, page_size, num_kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), num_kv_heads * group, head_dim)), jnp.bfloat16)
    lens = jnp.asarray(kv_lens, jnp.int32)
    fn = jax.jit(lambda *a: paged_decode(*a, scale, block_n=block_n, num_splits=num_splits,
                                         compute_capability=capability))
    fn.lower(q, k_pool, v_pool, layer, lens, tables).compile()
    poison_freed_memory()
    out = fn(q, k_pool, v_pool, layer, lens, tables)
    assert_close(out, paged_decode_ref(q, k_pool, v_pool, layer, lens, tables, scale), seed)
    assert (np.asarray(out, np.float32)[np.asarray(kv_lens) == 0] == 0).all()


PREFILL_CASES = [
    # group, head_dim, page_size, q_lens, kv_lens, padding rows, block_m, block_n, compute_capability
    (4, 128, 16, [70, 0, 5], [90, 3, 5], 5, 128, 64, None),         # chunk behind a prefix; idle request
    (1, 128, 256, [3, 300], [530, 300], 0, 128, 64, 80),            # long cached prefix; 3-tile chunk; Ampere
    (8, 64, 16, [40, 1, 129], [40, 200, 129], 3, 64, 32, None),     # single-token chunk at position 199
]


@pytest.mark.gpu
@needs_triton_gpu
@pytest.mark.parametrize("group,head_dim,page_size,q_lens,kv_lens,padding,block_m,block_n,capability", PREFILL_CASES)
def test_triton_prefill_matches_reference(group, head_dim, page_size, q_lens, kv_lens, padding, block_m, block_n,
                                          capability):
    from pallas_kernels.triton_prefill import ragged_prefill
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_kv_heads, layer, scale = 2, 0, head_dim ** -0.5
    k_pool, v_pool, tables = random_case(rng, kv_lens, page_size, num_kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + padding, num_kv_heads * group, head_dim)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    fn = jax.jit(lambda *a: ragged_prefill(*a, scale, block_m=block_m, block_n=block_n,
                                           compute_capability=capability))
    fn.lower(q, k_pool, v_pool, layer, cu, lens, tables).compile()
    poison_freed_memory()
    out = fn(q, k_pool, v_pool, layer, cu, lens, tables)
    assert_close(out, ragged_prefill_ref(q, k_pool, v_pool, layer, cu, lens, tables, scale), seed)
    assert (np.asarray(out, np.float32)[sum(q_lens):] == 0).all()


@pytest.mark.gpu
@needs_triton_gpu
def test_triton_backend_matches_reference_backend():
    """Through the backend interface: write a chunk's KV, prefill it, then decode one more token."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    triton, ref = resolve_backend("triton"), REFERENCE
    num_kv_heads, group, head_dim, page_size, layer, scale = 8, 4, 128, 16, 1, 128 ** -0.5
    kv_lens = [37, 100]
    k_pool, v_pool, tables = random_case(rng, kv_lens, page_size, num_kv_heads, head_dim)
    slots = np.concatenate([np.asarray(tables)[r, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for r, n in enumerate(kv_lens)])
    k, v = (jnp.asarray(rng.standard_normal((len(slots), num_kv_heads, head_dim)), jnp.bfloat16) for _ in range(2))
    pools = {name: b.write_kv(k_pool, v_pool, layer, jnp.asarray(slots, jnp.int32), k, v)
             for name, b in (("triton", triton), ("ref", ref))}
    for pool, new, written in zip((k_pool, v_pool), (k, v), pools["triton"]):  # oracle: numpy scatter by slot
        expected = np.asarray(pool, np.float32).copy()
        expected[layer, slots // page_size, :, slots % page_size, :] = np.asarray(new, np.float32)
        np.testing.assert_array_equal(np.asarray(written, np.float32), expected, err_msg=f"seed={seed}")
    q = jnp.asarray(rng.standard_normal((len(slots), num_kv_heads * group, head_dim)), jnp.bfloat16)
    cu, lens = jnp.asarray([0, 37, 137], jnp.int32), jnp.asarray(kv_lens, jnp.int32)
    assert_close(triton.prefill(q, *pools["triton"], layer, cu, lens, tables, scale),
                 ref.prefill(q, *pools["ref"], layer, cu, lens, tables, scale), seed)
    assert_close(triton.decode(q[:2], *pools["triton"], layer, lens, tables, scale),
                 ref.decode(q[:2], *pools["ref"], layer, lens, tables, scale), seed)
