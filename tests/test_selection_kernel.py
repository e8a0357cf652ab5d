"""The selection-threshold kernel against the stable sort (``sorted_threshold``), and ``select_slots`` through it.

CPU tests run the kernel in Mosaic GPU interpret mode; the ``gpu`` test runs it compiled on a Hopper GPU.
Fresh random inputs each run; the seed is in the failure message.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.selection import MAX_SLOTS, selection_threshold
from zipage_jax.layers.attention import resolve_backend
from zipage_jax.compression.selection import descending_key, select_slots, sorted_threshold
from seeds import fresh_seed

INTERPRET = plgpu.InterpretGPUParams()


def random_scores(rng, rows, num_slots):
    """Scores with plateaus (rounded rows), signed zeros, protected +inf tails and -inf padding."""
    scores = rng.standard_normal((rows, num_slots)).astype(np.float32)
    scores[:, ::5] = np.round(scores[:, ::5])
    scores[1] = np.round(scores[1])  # a row of few distinct values: long runs of ties
    scores[2, ::2] = -0.0
    scores[2, 1::2] = 0.0
    scores[:, -8:] = np.inf
    scores[3, num_slots // 3:-8] = -np.inf  # a short request: most of the row is padding
    return scores


@pytest.mark.parametrize("num_slots,keeps", [(48, (1, 20, 47, 48)), (300, (7, 150, 299)), (512, (384, 511)),
                                            (33000, (32000,))])  # the last: two TMA copies a row
def test_threshold_matches_the_stable_sort(num_slots, keeps):
    seed = fresh_seed()
    key = descending_key(jnp.asarray(random_scores(np.random.default_rng(seed), 5, num_slots)))
    for keep in keeps:
        got = selection_threshold(key, keep, interpret=INTERPRET)
        want = sorted_threshold(key, keep)
        for name, g, w in zip(("last_key", "last_slot"), got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"seed {seed}: {name}, keep {keep}")


def test_select_slots_through_the_kernel_equals_the_sort():
    seed = fresh_seed()
    scores = jnp.asarray(random_scores(np.random.default_rng(seed), 6, 200)).reshape(2, 3, 200)
    kernel = lambda key, keep: selection_threshold(key, keep, interpret=INTERPRET)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(select_slots(scores, 150, kernel)), np.asarray(select_slots(scores, 150)),
                                  err_msg=f"seed {seed}")


def test_long_rows_fall_back_to_the_sort():
    """Rows longer than the kernel's shared memory holds: the backend sorts (no kernel runs on CPU here)."""
    seed = fresh_seed()
    key = descending_key(jnp.asarray(random_scores(np.random.default_rng(seed), 4, MAX_SLOTS + 128)))
    for g, w in zip(resolve_backend("mosaic").selection_threshold(key, MAX_SLOTS), sorted_threshold(key, MAX_SLOTS)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"seed {seed}")


@pytest.mark.parametrize("bad", ["key", "keep", "long key"])
def test_threshold_rejects_bad_input(bad):
    key = jnp.zeros((2, MAX_SLOTS + 1 if bad == "long key" else 64), jnp.int32)
    keep = 65 if bad == "keep" else 8
    if bad == "key":
        key = key.astype(jnp.float32)
    with pytest.raises(ValueError, match=bad.split()[-1]):
        selection_threshold(key, keep, interpret=INTERPRET)


@pytest.mark.parametrize("num_slots", [2304, MAX_SLOTS])  # the longest rows arrive in several TMA copies
def test_threshold_lowers_for_hopper(num_slots):
    """Mosaic GPU lowering runs on CPU, so lowering errors show up without a GPU."""
    lowered = selection_threshold.trace(jax.ShapeDtypeStruct((512, num_slots), jnp.int32), num_slots - 256)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not (jax.default_backend() == "gpu" and float(jax.devices()[0].compute_capability) >= 9.0),
                    reason="needs a Hopper GPU")
def test_compiled_threshold_matches_the_stable_sort():
    seed = fresh_seed()
    key = descending_key(jnp.asarray(random_scores(np.random.default_rng(seed), 64, 2304)))
    for keep in (1, 2048, 2304):
        for g, w in zip(selection_threshold(key, keep), sorted_threshold(key, keep)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"seed {seed}, keep {keep}")
