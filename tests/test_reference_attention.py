"""The jnp attention references against a naive per-token numpy loop."""

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import reference
from seeds import seeded_rng


def naive_attention(q, keys, values, scale):
    """q [Hq, D]; keys/values [N, Hkv, D] → [Hq, D] (zeros when N == 0)."""
    hq, hkv = q.shape[0], keys.shape[1]
    out = np.zeros_like(q)
    if keys.shape[0] == 0:
        return out
    for h in range(hq):
        kh = h // (hq // hkv)
        s = keys[:, kh] @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ values[:, kh]
    return out


def random_pool(rng, layers, pages, hkv, page_size, dim):
    k = rng.standard_normal((layers, pages, hkv, page_size, dim)).astype(np.float32)
    v = rng.standard_normal((layers, pages, hkv, page_size, dim)).astype(np.float32)
    return k, v


def request_kv(pool, layer, table, length):
    page_size = pool.shape[3]
    return np.stack([pool[layer, table[i // page_size], :, i % page_size] for i in range(length)]) if length else \
        np.zeros((0, pool.shape[2], pool.shape[4]), np.float32)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_paged_decode_ref_matches_naive(hq, hkv):
    rng = seeded_rng()
    layers, pages, page_size, dim = 2, 12, 4, 8
    k_pool, v_pool = random_pool(rng, layers, pages, hkv, page_size, dim)
    kv_lens = np.array([5, 0, 9, 4], np.int32)  # a padding row and lengths off the page grid
    tables = np.stack([rng.permutation(np.arange(1, pages))[:3] for _ in kv_lens]).astype(np.int32)
    q = rng.standard_normal((len(kv_lens), hq, dim)).astype(np.float32)
    out = np.asarray(reference.paged_decode_ref(q, k_pool, v_pool, 1, kv_lens, tables, 0.3))
    for b, n in enumerate(kv_lens):
        want = naive_attention(q[b], request_kv(k_pool, 1, tables[b], n), request_kv(v_pool, 1, tables[b], n), 0.3)
        np.testing.assert_allclose(out[b], want, rtol=1e-5, atol=1e-5)


def test_ragged_prefill_ref_matches_naive():
    rng = seeded_rng()
    layers, pages, hkv, hq, page_size, dim = 2, 16, 2, 4, 4, 8
    k_pool, v_pool = random_pool(rng, layers, pages, hkv, page_size, dim)
    q_lens = np.array([3, 5, 1, 0])
    kv_lens = np.array([3, 11, 7, 0], np.int32)  # request 1 and 2 have cached prefixes
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.stack([rng.permutation(np.arange(1, pages))[:3] for _ in q_lens]).astype(np.int32)
    num_tokens = int(cu[-1]) + 3  # bucket padding rows
    q = rng.standard_normal((num_tokens, hq, dim)).astype(np.float32)
    out = np.asarray(reference.ragged_prefill_ref(q, k_pool, v_pool, 0, cu, kv_lens, tables, 0.5))
    for r, n in enumerate(q_lens):
        for i in range(n):
            pos = kv_lens[r] - n + i
            keys = request_kv(k_pool, 0, tables[r], pos + 1)
            values = request_kv(v_pool, 0, tables[r], pos + 1)
            np.testing.assert_allclose(out[cu[r] + i], naive_attention(q[cu[r] + i], keys, values, 0.5),
                                       rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[cu[-1]:], 0.0)


def test_write_kv_ref_writes_exact_slots():
    rng = seeded_rng()
    k_pool, v_pool = random_pool(rng, 2, 6, 2, 4, 8)
    slots = np.array([5, 6, 13, 22], np.int32)
    k = rng.standard_normal((4, 2, 8)).astype(np.float32)
    v = rng.standard_normal((4, 2, 8)).astype(np.float32)
    nk, nv = reference.write_kv_ref(jnp.asarray(k_pool), jnp.asarray(v_pool), 1, slots, k, v)
    want_k, want_v = k_pool.copy(), v_pool.copy()
    for t, s in enumerate(slots):
        want_k[1, s // 4, :, s % 4] = k[t]
        want_v[1, s // 4, :, s % 4] = v[t]
    np.testing.assert_array_equal(np.asarray(nk), want_k)
    np.testing.assert_array_equal(np.asarray(nv), want_v)
