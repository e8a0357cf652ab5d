"""Pack a pytree of small host arrays into ONE int32 buffer, so each step makes a single host→device copy.

The spec (tree structure + shapes + dtypes) is hashable and becomes a static argument of the jitted step:
it is the shape bucket. Every leaf starts at a multiple of ``ALIGN`` elements (256 bytes): XLA hands a leaf that a
kernel reads straight to it as a view into the buffer, and Mosaic GPU kernels require 256-byte aligned inputs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

ALIGN = 64  # int32 elements: 256 bytes


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def pack(tree):
    leaves, treedef = jax.tree.flatten(tree)
    flats, specs = [], []
    for leaf in leaves:
        a = np.ascontiguousarray(leaf)
        if a.dtype == np.bool_:
            flat = a.astype(np.int32)
        elif a.dtype.itemsize == 4:
            flat = a.view(np.int32)
        else:
            raise ValueError(f"pack: unsupported dtype {a.dtype} (need 4-byte or bool leaves)")
        flats.append(flat.ravel())
        specs.append((a.shape, a.dtype.str))
    buffer = np.zeros(sum(_padded(f.size) for f in flats), np.int32)
    offset = 0
    for flat in flats:
        buffer[offset:offset + flat.size] = flat
        offset += _padded(flat.size)
    return buffer, (treedef, tuple(specs))


def leaf_offsets(spec) -> list[int]:
    """Where each leaf starts in the packed buffer (elements)."""
    sizes = [_padded(math.prod(shape)) for shape, _ in spec[1]]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def unpack(buffer, spec):
    """Inverse of ``pack`` inside jit: static slices plus bitcasts, no data-dependent work."""
    treedef, specs = spec
    leaves = []
    for (shape, dtype_str), offset in zip(specs, leaf_offsets(spec)):
        dtype = np.dtype(dtype_str)
        x = buffer[offset:offset + math.prod(shape)].reshape(shape)
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
