"""Kernel-backed attention backends, registered with ``zipage_jax.attention``: the Mosaic ones on import, the
Triton one by ``register_triton`` (jax-triton is an optional extra, so CPU installs never import it)."""

import dataclasses

from pallas_kernels.compaction import compact_slots
from pallas_kernels.paged_decode import paged_decode
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.redundancy import lightning_row_sums
from pallas_kernels.scoring import window_scores
from pallas_kernels.selection import MAX_SLOTS, selection_threshold
from zipage_jax.attention import ReferenceBackend, register_backend
from zipage_jax.compression.selection import sorted_threshold


@register_backend
@dataclasses.dataclass(frozen=True)
class MosaicDecodeBackend(ReferenceBackend):
    """Hopper: the Mosaic GPU paged decode and compression kernels (window attention, lightning redundancy,
    selection threshold, in-place compaction); XLA prefill; KV write as an in-place XLA scatter."""

    name = "mosaic_decode"

    def decode(self, q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        return paged_decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale)

    def window_scores(self, k_pool, layer, page_tables, num_live, queries, sm_scale):
        return window_scores(k_pool, layer, page_tables, num_live, queries, sm_scale)

    def lightning_row_sums(self, k_pool, layer, page_tables, num_pages, threshold):
        return lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold)

    def selection_threshold(self, key, keep):
        """The kernel where a row's keys fit its shared memory, else the sort."""
        if key.shape[1] > MAX_SLOTS:
            return sorted_threshold(key, keep)
        return selection_threshold(key, keep)

    def compact_slots(self, k_pool, v_pool, layer, kept, src_tables, dst_tables, valid):
        return compact_slots(k_pool, v_pool, layer, kept, src_tables, dst_tables, valid)


@register_backend
@dataclasses.dataclass(frozen=True)
class MosaicBackend(MosaicDecodeBackend):
    """Hopper: Mosaic GPU paged decode and ragged prefill kernels (the default on Hopper)."""

    name = "mosaic"

    def prefill(self, q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        return ragged_prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale)


@dataclasses.dataclass(frozen=True)
class TritonBackend(ReferenceBackend):
    """Ampere (sm_80+): Triton paged decode and ragged prefill kernels through jax-triton; jnp compression
    scoring; KV write as the inherited in-place XLA scatter."""

    name = "triton"

    def decode(self, q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        from pallas_kernels.triton_decode import paged_decode as triton_decode
        return triton_decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale)

    def prefill(self, q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        from pallas_kernels.triton_prefill import ragged_prefill as triton_prefill
        return triton_prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale)


def register_triton():
    """Register ``triton`` if its kernel modules import (they need jax-triton and triton)."""
    try:
        import pallas_kernels.triton_decode  # noqa: F401
        import pallas_kernels.triton_prefill  # noqa: F401
    except ImportError as e:
        raise ValueError("attention_backend: 'triton' needs jax-triton and triton "
                         f"(pip install 'zipage_jax[ampere]'); import failed: {e}") from e
    register_backend(TritonBackend)
