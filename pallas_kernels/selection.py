"""The selection threshold of compression (docs/ARCHITECTURE.md, Compression) as a Mosaic GPU (Hopper) kernel: no sort.

The engine's ``select_slots`` (compression selection) keeps, per (layer, request, KV head) row, the slots whose integer
key ranks among the ``keep`` best (smallest), ties to the earlier slot. All it needs is the ``keep``-th best
(key, slot) pair, which a stable sort of the row finds in O(N log^2 N) work over global memory. This kernel
finds it by bisection instead: one CTA per row holds the row's keys in shared memory and fixes the key's 32
bits from the top, each by one count of the keys below a candidate (a warpgroup reduction); then, among the
keys equal to it, the bits of the last kept tie's slot the same way. That is 32 + log2(N) counting passes
over N/128 keys a thread, with nothing written but two scalars per row.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LANES = 128  # keys per SMEM row: a warpgroup's threads each hold N / 128 of them
MAX_SLOTS = 48 * 1024  # the row's keys must fit shared memory (192 KiB); longer rows use the sort
_COPY_ROWS = 256  # a TMA box spans at most 256 SMEM rows: longer rows arrive in several copies
_WORST_KEY = 2 ** 31 - 1  # padding: ranks after every real key


def _threshold_kernel(key_ref, out_ref, key_smem, out_smem, barrier, *, keep, slot_bits):
    row = lax.axis_index("r")
    for start in range(0, key_smem.shape[0], _COPY_ROWS):
        rows = pl.ds(start, min(_COPY_ROWS, key_smem.shape[0] - start))
        plgpu.copy_gmem_to_smem(key_ref.at[row, rows], key_smem.at[rows], barrier)
    plgpu.barrier_wait(barrier)
    layout = plgpu.Layout.WG_STRIDED(key_smem.shape, vec_size=1)

    def keys():  # a fresh load per pass: a value carried across loop iterations defeats layout inference
        return plgpu.load(key_smem, layout=layout)

    def count(below):
        return jnp.sum(below.astype(jnp.int32))

    def key_bit(i, prefix):  # bits 30 .. 0 of the keep-th key, given its sign
        candidate = prefix | lax.shift_left(jnp.int32(1), 30 - i)
        return jnp.where(count(keys() < candidate) < keep, candidate, prefix)

    negative = count(keys() < 0) >= keep
    last_key = lax.fori_loop(0, 31, key_bit, jnp.where(negative, jnp.int32(-2 ** 31), jnp.int32(0)))
    ties = keep - count(keys() < last_key)  # keys equal to last_key that are kept, the earliest slots first

    def slot_bit(i, prefix):  # the largest slot with fewer than ``ties`` equal keys before it: the last kept tie
        candidate = prefix | lax.shift_left(jnp.int32(1), slot_bits - 1 - i)
        slots = (plgpu.broadcasted_iota(jnp.int32, key_smem.shape, 0, layout=layout) * LANES
                 + plgpu.broadcasted_iota(jnp.int32, key_smem.shape, 1, layout=layout))
        return jnp.where(count((keys() == last_key) & (slots < candidate)) < ties, candidate, prefix)

    last_slot = lax.fori_loop(0, slot_bits, slot_bit, jnp.int32(0))
    out_layout = plgpu.Layout.WG_STRIDED(out_smem.shape, vec_size=1)
    which = plgpu.broadcasted_iota(jnp.int32, out_smem.shape, 0, layout=out_layout)
    out_smem[...] = jnp.where(which == 0, last_key, last_slot)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[row])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("keep", "interpret"))
def selection_threshold(key, keep, *, interpret=False):
    """``(last_key, last_slot)``, each ``[R]`` int32: per row of ``key [R, N]`` int32, the ``keep``-th smallest
    (key, slot) pair in (key, slot) order, as the engine's jnp ``sorted_threshold`` gives.
    N is at most ``MAX_SLOTS``. ``interpret`` may be ``plgpu.InterpretGPUParams()`` to run on CPU."""
    if key.ndim != 2 or key.dtype != jnp.int32:
        raise ValueError(f"key must be [R, N] int32, got {key.shape} {key.dtype}")
    rows, num_slots = key.shape
    if num_slots > MAX_SLOTS:
        raise ValueError(f"key rows of {num_slots} slots exceed the kernel's {MAX_SLOTS} (shared memory)")
    if not 0 < keep <= num_slots:
        raise ValueError(f"keep: must be in [1, {num_slots}] (got {keep})")
    padded = -(-num_slots // LANES) * LANES
    copies = -(-padded // (LANES * _COPY_ROWS))
    key = jnp.pad(key, ((0, 0), (0, padded - num_slots)), constant_values=_WORST_KEY)
    out = plgpu.kernel(
        functools.partial(_threshold_kernel, keep=keep, slot_bits=max(1, math.ceil(math.log2(padded)))),
        out_type=jax.ShapeDtypeStruct((rows, 2, LANES), jnp.int32),
        grid=(rows,),
        grid_names=("r",),
        scratch_types=(plgpu.SMEM((padded // LANES, LANES), jnp.int32), plgpu.SMEM((2, LANES), jnp.int32),
                       plgpu.Barrier(num_arrivals=copies)),
        interpret=interpret,
    )(key.reshape(rows, padded // LANES, LANES))
    return out[:, 0, 0], out[:, 1, 0]
