"""The lightning-redundancy kernel under Mosaic GPU interpret mode (CPU) against the jnp row sums.

Fresh random keys each run (the seed is in the failure message), with planted near-duplicates so the
similarity threshold and the "latest match" correction really fire; the threshold is moved off every float64
similarity by a margin, so float rounding cannot flip a comparison between the two implementations.
Interpret mode fills the kernel's output with NaN, so a live slot it never writes fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.redundancy import lightning_row_sums
from pallas_kernels.reference import gather_request_kv
from helpers import shuffled_page_tables
from zipage_jax.config import ScoringConfig
from zipage_jax.compression.scoring import paged_redundancy_scores, redundancy_row_sums, redundancy_scores
from seeds import fresh_seed, seeded_rng

INTERPRET = plgpu.InterpretGPUParams(uninitialized_memory="nan")


def keys_with_near_duplicates(rng, shape):
    """Normal keys where every third slot is a noisy, rescaled copy of its predecessor (cosine ~0.6-0.95)."""
    keys = rng.standard_normal(shape)
    copies = keys[..., 1::3, :].shape[-2]
    noise = rng.uniform(0.2, 1.0, keys[..., 1::3, :1].shape)
    originals = keys[..., 0::3, :][..., :copies, :]
    keys[..., 1::3, :] = 1.3 * originals + noise * rng.standard_normal(originals.shape)
    return keys


def safe_threshold(keys, page_size, near=0.5, margin=3e-6):
    """A threshold close to ``near`` that no within-page float64 cosine similarity of ``keys`` comes within
    ``margin`` of."""
    k = np.asarray(keys, np.float64)
    k = k.reshape(*k.shape[:-2], -1, page_size, k.shape[-1])
    k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    sims = np.einsum("...md,...nd->...mn", k, k).ravel()
    for threshold in near + np.linspace(0.0, 0.05, 501):
        if np.abs(sims - threshold).min() > margin:
            return float(threshold)
    raise AssertionError("no safe threshold")


def random_problem(rng, num_pages, table_pages, page_size, head_dim, num_kv_heads=2, layers=2):
    """A bf16 pool whose requests hold ``num_pages`` distinct shuffled pages (padding entries: null page 0)."""
    pool_pages = sum(num_pages) + 3
    keys = keys_with_near_duplicates(rng, (layers, pool_pages, num_kv_heads, page_size, head_dim))
    tables = shuffled_page_tables(rng, num_pages, table_pages, pool_pages)
    return jnp.asarray(keys, jnp.bfloat16), tables, jnp.asarray(num_pages, jnp.int32)


CASES = [
    # page_size, head_dim, num_pages, table_pages, threshold near
    (64, 64, [3, 0, 1], 3, 0.5),      # one page per block; a padding row
    (16, 128, [5, 2], 6, 0.5),        # four pages per block, a partial last block, padded table
    (128, 64, [2], 2, 0.5),           # two 64-row tiles per page
    (32, 64, [1, 4, 3], 4, -0.1),     # two pages per block; a negative threshold (most pairs match)
    (256, 64, [3], 3, 0.5),           # four tiles per page, three blocks
]


def check_against_jnp(page_size, head_dim, num_pages, table_pages, near, interpret):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k_pool, tables, pages = random_problem(rng, num_pages, table_pages, page_size, head_dim)
    threshold = safe_threshold(k_pool[1].astype(jnp.float32), page_size, near)
    cfg = ScoringConfig(redundancy="lightning", similarity_threshold=threshold)
    keys = gather_request_kv(k_pool, 1, tables)
    out = np.asarray(lightning_row_sums(k_pool, 1, tables, pages, threshold, interpret=interpret))
    ref = np.asarray(redundancy_row_sums(keys, pages * page_size, page_size, cfg))
    assert out.shape == ref.shape == (len(num_pages), 2, table_pages * page_size) and out.dtype == np.float32
    assert np.isfinite(out).all(), f"seed {seed}: non-finite row sums (unwritten slots?)"
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")
    # the latest-match correction changed the sums: without any match they would be larger
    no_match = np.asarray(redundancy_row_sums(keys, pages * page_size, page_size,
                                              ScoringConfig(redundancy="lightning", similarity_threshold=2.0)))
    assert (no_match - ref).max() > 0.3, f"seed {seed}: the threshold never fired"
    dead = np.arange(out.shape[-1])[None, :] >= (np.asarray(num_pages) * page_size)[:, None]
    assert (out.transpose(1, 0, 2)[:, dead] == 0).all()


@pytest.mark.parametrize("page_size,head_dim,num_pages,table_pages,near", CASES)
def test_lightning_row_sums_match_jnp(page_size, head_dim, num_pages, table_pages, near):
    check_against_jnp(page_size, head_dim, num_pages, table_pages, near, INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(not (jax.default_backend() == "gpu" and float(jax.devices()[0].compute_capability) >= 9.0),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("page_size,head_dim,num_pages,table_pages,near",
                         CASES + [(256, 128, [9, 9, 4], 9, 0.5), (128, 128, [5, 2], 6, 0.5)])
def test_compiled_lightning_row_sums_match_jnp(page_size, head_dim, num_pages, table_pages, near):
    check_against_jnp(page_size, head_dim, num_pages, table_pages, near, False)


def test_paged_redundancy_uses_the_backend_kernel_only_for_lightning():
    """R through the kernel equals R from gathered keys; "full" never calls the kernel."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page_size = 64
    k_pool, tables, pages = random_problem(rng, [2, 3], 3, page_size, 64)
    calls = []

    def kernel(k_pool, layer, page_tables, num_pages, threshold):
        calls.append(threshold)
        return lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold, interpret=INTERPRET)

    threshold = safe_threshold(k_pool[0].astype(jnp.float32), page_size)
    for mode in ("lightning", "full"):
        cfg = ScoringConfig(redundancy=mode, similarity_threshold=threshold)
        got = np.asarray(paged_redundancy_scores(k_pool, 0, tables, pages, cfg, kernel))
        want = np.asarray(redundancy_scores(gather_request_kv(k_pool, 0, tables), pages * page_size, page_size, cfg))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7, err_msg=f"seed {seed} {mode}")
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    assert calls == [threshold]


@pytest.mark.parametrize("bad", ["head dim", "page size", "num_pages", "dtype"])
def test_lightning_row_sums_rejects_bad_input(bad):
    rng = seeded_rng()
    k_pool, tables, pages = random_problem(rng, [1, 2], 2, 64, 64)
    if bad == "head dim":
        k_pool = k_pool[..., :32]
    elif bad == "page size":
        k_pool = k_pool[..., :48, :]
    elif bad == "num_pages":
        pages = pages[:1]
    else:
        k_pool = k_pool.astype(jnp.float32)
    with pytest.raises(ValueError, match=bad):
        lightning_row_sums(k_pool, 0, tables, pages, 0.5, interpret=INTERPRET)


@pytest.mark.parametrize("page_size,head_dim", [(256, 128), (128, 128), (64, 64), (16, 128)])
def test_lightning_row_sums_lower_for_hopper(page_size, head_dim):
    """Mosaic GPU layout inference runs at lowering, so layout errors show up on CPU without a GPU."""
    pool = jax.ShapeDtypeStruct((2, 33, 2, page_size, head_dim), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    fn = functools.partial(lightning_row_sums, layer=1, threshold=0.5)
    lowered = jax.jit(lambda *a, **kw: fn(*a, **kw)).trace(
        pool, page_tables=i32(4, 8), num_pages=i32(4)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
