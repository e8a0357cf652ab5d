"""Pack a pytree of small host arrays into ONE int32 buffer, so each step makes a single host→device copy.

The spec (tree structure + shapes + dtypes) is hashable and becomes a static argument of the jitted step:
it is the shape bucket.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def pack(tree):
    leaves, treedef = jax.tree.flatten(tree)
    parts, specs = [], []
    for leaf in leaves:
        a = np.ascontiguousarray(leaf)
        if a.dtype == np.bool_:
            flat = a.astype(np.int32)
        elif a.dtype.itemsize == 4:
            flat = a.view(np.int32)
        else:
            raise ValueError(f"pack: unsupported dtype {a.dtype} (need 4-byte or bool leaves)")
        parts.append(flat.ravel())
        specs.append((a.shape, a.dtype.str))
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buffer, (treedef, tuple(specs))


def unpack(buffer, spec):
    """Inverse of ``pack`` inside jit: static slices plus bitcasts, no data-dependent work."""
    treedef, specs = spec
    leaves, offset = [], 0
    for shape, dtype_str in specs:
        dtype = np.dtype(dtype_str)
        size = math.prod(shape)
        x = buffer[offset:offset + size].reshape(shape)
        offset += size
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
