"""The one-buffer packing of a step's integers: exact round trip, and every leaf 256-byte aligned (Mosaic GPU
kernels read leaves in place and require it)."""

import jax
import numpy as np

from zipage_jax.worker import packing
from seeds import fresh_seed


def test_round_trip_and_alignment():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    tree = {
        "ints": rng.integers(-2**31, 2**31, size=(int(rng.integers(0, 9)), 3), dtype=np.int32),
        "flags": rng.random(int(rng.integers(1, 70))) < 0.5,
        "floats": rng.standard_normal((2, int(rng.integers(1, 5)))).astype(np.float32),
        "words": rng.integers(0, 2**32, size=int(rng.integers(1, 130)), dtype=np.uint32),
        "scalar": np.int32(rng.integers(100)),
    }
    packed, spec = packing.pack(tree)
    assert packed.dtype == np.int32 and packed.ndim == 1, seed
    assert all(offset * 4 % 256 == 0 for offset in packing.leaf_offsets(spec)), seed
    out = jax.jit(packing.unpack, static_argnums=1)(packed, spec)
    for key, value in tree.items():
        np.testing.assert_array_equal(np.asarray(out[key]), value, err_msg=f"seed {seed}: {key}")
        assert out[key].dtype == np.asarray(value).dtype, (seed, key)
