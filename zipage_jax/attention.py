"""One attention interface, several implementations: the jnp reference, Mosaic GPU kernels (Hopper) and Triton
kernels (Ampere).

A backend is a frozen, field-less dataclass, so it is hashable and can be a static argument of the jitted
steps. All backends share the semantics of ``pallas_kernels.reference``.
"""

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels import reference


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
    """Pure jnp: the CPU path and the oracle."""

    name = "reference"

    def write_kv(self, k_pool, v_pool, layer, slot_mapping, k, v):
        return reference.write_kv_ref(k_pool, v_pool, layer, slot_mapping, k, v)

    def decode(self, q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        return reference.paged_decode_ref(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale)

    def prefill(self, q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        return reference.ragged_prefill_ref(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale)


BACKENDS = {"reference": ReferenceBackend}


@dataclasses.dataclass(frozen=True)
class ShardedBackend:
    """Runs a backend per tensor-parallel shard: heads are independent, so each shard attends over its own."""

    base: object
    mesh: jax.sharding.Mesh

    @property
    def name(self):
        return self.base.name

    def _map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def write_kv(self, k_pool, v_pool, layer, slot_mapping, k, v):
        pool, rows = P(None, None, "tp"), P(None, "tp")
        return self._map(self.base.write_kv, (pool, pool, P(), P(), rows, rows), (pool, pool))(
            k_pool, v_pool, layer, slot_mapping, k, v)

    def decode(self, q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        pool, heads = P(None, None, "tp"), P(None, "tp")
        fn = functools.partial(self.base.decode, sm_scale=sm_scale)
        return self._map(lambda *a: fn(*a), (heads, pool, pool, P(), P(), P()), heads)(
            q, k_pool, v_pool, layer, kv_lens, page_tables)

    def prefill(self, q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        pool, heads = P(None, None, "tp"), P(None, "tp")
        fn = functools.partial(self.base.prefill, sm_scale=sm_scale)
        return self._map(lambda *a: fn(*a), (heads, pool, pool, P(), P(), P(), P()), heads)(
            q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables)


def register_backend(cls):
    """Kernel modules register their backend class here under ``cls.name``."""
    BACKENDS[cls.name] = cls
    return cls


def resolve_backend(name: str = "auto"):
    """Pick the backend: ``auto`` → Mosaic GPU kernels on Hopper+, Triton kernels on Ampere, jnp on CPU."""
    if name == "auto":
        name = default_backend_name(jax.devices()[0])
    if name not in BACKENDS:
        _load_kernel_backends(name)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown or unavailable backend {name!r}; have {sorted(BACKENDS)}")
    return BACKENDS[name]()


def default_backend_name(device) -> str:
    if device.platform != "gpu":
        return "reference"
    capability = getattr(device, "compute_capability", "0")
    major = int(str(capability).split(".")[0] or 0)
    if major >= 9:
        return "mosaic"
    if major == 8:
        return "triton"
    raise ValueError(f"attention_backend: auto found compute capability {capability}; the kernels need Ampere "
                     "(8.0+); pass attention_backend='reference' on older GPUs")


def _load_kernel_backends(name: str):
    """Import kernel modules lazily: mosaic / mosaic_decode always, triton (needs jax-triton) only when asked."""
    import pallas_kernels.backends as kernel_backends

    if name == "triton":
        kernel_backends.register_triton()
