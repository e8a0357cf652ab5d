"""The kernel interface: every device kernel the engine calls, declared in one object (docs/ARCHITECTURE.md,
Kernel interface).

An ``AttentionBackend`` is a frozen dataclass of functions whose defaults are the jnp references (the CPU path
and the oracle of every kernel test). A named backend replaces some of them with kernels: the Mosaic GPU ones
(Hopper), the Triton ones (Ampere). The engine resolves its backend once and hands it, as a static argument,
to the jitted steps; nothing downstream asks a backend what it has. All implementations share the semantics
of ``pallas_kernels.reference`` and the compression modules' jnp functions.

The registry lives here, not in ``pallas_kernels``: the kernels know nothing of the engine.
"""

import dataclasses
import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import reference
from pallas_kernels.kv_quant import is_fp8, round_queries, upcast
from zipage_jax.compression import compaction, scoring, selection
from zipage_jax.parallel import AXIS, KV_HEADS


def with_fp8_queries(decode: Callable, rounds_own_head_dims: tuple[int, ...] = ()) -> Callable:
    """A decode that reads e4m3 queries over FP8 pools (``kv_quant.round_queries``), whatever its backend: the
    Mosaic kernel multiplies them with the 8-bit keys directly (an FP8 wgmma: on an H100 89-90 % of the 16-bit
    kernel's bandwidth, where upcasting K reached 73-77 %), and every other path rounds them the same way, so the
    backends agree. ``rounds_own_head_dims``: head dims where ``decode`` quantizes its queries itself (the same
    quantization), so they are not rounded twice. 16-bit pools: the queries as they are."""

    def attend(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        if is_fp8(k_pool.dtype) and q.shape[-1] not in rounds_own_head_dims:
            q = round_queries(q, k_pool.shape[2])
        return decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale)

    return attend


REFERENCE_DECODE = with_fp8_queries(reference.paged_decode_ref)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The kernels of one backend (hashable: a jit static argument). Signatures, for a KV pool
    ``[L, num_pages, Hkv, S, D]`` of which the kernels read or write one ``layer``:

    - ``write_kv(k_pool, v_pool, layer, slot_mapping, k, v) -> (k_pool, v_pool)``: new K/V rows into flat slots;
    - ``decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale) -> out``: one query token a row (over
      FP8 pools its queries in e4m3: ``with_fp8_queries``);
    - ``prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale) -> out``: packed chunks;
    - ``window_scores(k_pool, layer, page_tables, num_live, queries, sm_scale) -> [B, Hkv, N]``: compression's
      window attention A;
    - ``lightning_row_sums(k_pool, layer, page_tables, num_pages, threshold) -> [B, Hkv, N]``: raw in-page key
      redundancy;
    - ``selection_threshold(key, keep) -> (last_key, last_slot)``: each row's ``keep``-th best (key, slot);
    - ``compact_slots(k_pool, v_pool, layer, kept, src_tables, dst_tables, valid) -> (k_pool, v_pool)``.

    ``fused_compression`` declares that the compression kernels read the pool pages in place (no gathered K/V
    scratch), which the memory plan reserves less for.
    """

    name: str = "reference"
    write_kv: Callable = reference.write_kv_ref
    decode: Callable = REFERENCE_DECODE
    prefill: Callable = reference.ragged_prefill_ref
    window_scores: Callable = scoring.paged_window_attention
    lightning_row_sums: Callable = scoring.paged_lightning_row_sums
    selection_threshold: Callable = selection.sorted_threshold
    compact_slots: Callable = compaction.compact_slots
    fused_compression: bool = False


REFERENCE = AttentionBackend()
XLA_COMPACTION_MAX_ROWS = 4  # compression dispatches of up to this many rows compact through XLA on the kernel backends


def compaction_by_rows(kernel: Callable) -> Callable:
    """A ``compact_slots`` that gives dispatches of up to ``XLA_COMPACTION_MAX_ROWS`` rows XLA's gather-then-scatter
    and larger ones the in-place ``kernel``. The kernel walks each (row, KV head) pool in one CTA, serially (the
    order is what makes it safe in place), so a layer costs one walk whatever the rows, and a few rows leave most
    SMs idle; XLA gathers every kept slot at once into a scratch of the kept K/V (``2*B*Hkv*M*S*D*it``), small at
    these rows and faster there (``bench compression``; BENCHMARKS.md, compression cost)."""

    def compact_slots(k_pool, v_pool, layer, kept, src_tables, dst_tables, valid):
        small = kept.shape[0] <= XLA_COMPACTION_MAX_ROWS
        return (compaction.compact_slots if small else kernel)(k_pool, v_pool, layer, kept, src_tables, dst_tables,
                                                                valid)

    return compact_slots


def fp8_through_reference(kernel: Callable, reference_fn: Callable) -> Callable:
    """A decode kernel without an FP8 path (Triton): FP8 pools go through the jnp reference (the memory plan
    reserves its scratch: ``kv_cache.step_scratch_bytes``), 16-bit ones through the kernel."""

    def attend(q, k_pool, *args):
        return (reference_fn if is_fp8(k_pool.dtype) else kernel)(q, k_pool, *args)

    return attend


def fp8_prefill_through_copies(kernel: Callable) -> Callable:
    """A prefill kernel without an FP8 path (Triton's): FP8 pools give it 16-bit copies of the
    step's own pages (``[1 + R * P]`` pages of one layer, exact upcasts; the memory plan reserves them:
    ``kv_cache.step_scratch_bytes``), 16-bit pools go straight in."""

    def prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        if not is_fp8(k_pool.dtype):
            return kernel(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale)

        def copies(pool):  # copy 0, which no table names, is the null page: one gather, no concatenated copy
            ids = jnp.concatenate([jnp.zeros((1,), jnp.int32), page_tables.reshape(-1).astype(jnp.int32)])
            return upcast(pool[layer, ids], q.dtype)[None]

        tables = 1 + jnp.arange(page_tables.size, dtype=jnp.int32).reshape(page_tables.shape)
        return kernel(q, copies(k_pool), copies(v_pool), 0, cu_q_lens, kv_lens, tables, sm_scale)

    return prefill


BACKENDS = {"reference": REFERENCE}  # name -> backend; the kernel backends are added on first use


def sharded(base: AttentionBackend, mesh: jax.sharding.Mesh) -> AttentionBackend:
    """``base`` per tensor-parallel shard: attention heads are independent, so write_kv / decode / prefill run
    per shard (``shard_map``) over its own KV heads. The compression fields stay base's own: the runner runs the
    whole compression step per shard (``runner._compress_step``), where they see one shard's heads."""

    def per_shard(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    pool, heads = KV_HEADS, P(None, AXIS)

    def write_kv(k_pool, v_pool, layer, slot_mapping, k, v):
        return per_shard(base.write_kv, (pool, pool, P(), P(), heads, heads), (pool, pool))(
            k_pool, v_pool, layer, slot_mapping, k, v)

    def decode(q, k_pool, v_pool, layer, kv_lens, page_tables, sm_scale):
        fn = functools.partial(base.decode, sm_scale=sm_scale)
        return per_shard(lambda *a: fn(*a), (heads, pool, pool, P(), P(), P()), heads)(
            q, k_pool, v_pool, layer, kv_lens, page_tables)

    def prefill(q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables, sm_scale):
        fn = functools.partial(base.prefill, sm_scale=sm_scale)
        return per_shard(lambda *a: fn(*a), (heads, pool, pool, P(), P(), P(), P()), heads)(
            q, k_pool, v_pool, layer, cu_q_lens, kv_lens, page_tables)

    return dataclasses.replace(base, write_kv=write_kv, decode=decode, prefill=prefill)


def resolve_backend(name: str = "auto") -> AttentionBackend:
    """Pick the backend: ``auto`` → Mosaic GPU kernels on Hopper+, Triton kernels on Ampere, jnp on CPU."""
    if name == "auto":
        name = default_backend_name(jax.devices()[0])
    if name not in BACKENDS and name in KERNEL_BACKENDS:
        BACKENDS.update(KERNEL_BACKENDS[name]())
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown or unavailable backend {name!r}; "
                         f"have {sorted(set(BACKENDS) | set(KERNEL_BACKENDS))}")
    return BACKENDS[name]


def default_backend_name(device) -> str:
    if device.platform != "gpu":
        return "reference"
    capability = device.compute_capability
    major = int(str(capability).split(".")[0] or 0)
    if major >= 9:
        return "mosaic"
    if major == 8:
        return "triton"
    raise ValueError(f"attention_backend: auto found compute capability {capability}; the kernels need Ampere "
                     "(8.0+); pass attention_backend='reference' on older GPUs")


def mosaic_backends() -> dict:
    """Hopper: the Mosaic GPU paged decode and compression kernels (window attention, lightning redundancy,
    selection threshold, in-place compaction above ``XLA_COMPACTION_MAX_ROWS`` rows: ``compaction_by_rows``);
    ``mosaic`` adds the ragged prefill kernel, ``mosaic_decode`` keeps the XLA prefill. KV write: the in-place XLA
    scatter."""
    from pallas_kernels import compaction as k_compaction
    from pallas_kernels import paged_decode, ragged_prefill, redundancy
    from pallas_kernels import scoring as k_scoring
    from pallas_kernels import selection as k_selection

    def selection_threshold(key, keep):
        """The kernel where a row's keys fit its shared memory, else the sort."""
        if key.shape[1] > k_selection.MAX_SLOTS:
            return selection.sorted_threshold(key, keep)
        return k_selection.selection_threshold(key, keep)

    decode_only = AttentionBackend(
        name="mosaic_decode", decode=with_fp8_queries(paged_decode.paged_decode, paged_decode.FP8_QK_HEAD_DIMS),
        window_scores=k_scoring.window_scores, lightning_row_sums=redundancy.lightning_row_sums,
        selection_threshold=selection_threshold, compact_slots=compaction_by_rows(k_compaction.compact_slots),
        fused_compression=True)
    full = dataclasses.replace(decode_only, name="mosaic", prefill=ragged_prefill.ragged_prefill)
    return {"mosaic_decode": decode_only, "mosaic": full}


def triton_backends() -> dict:
    """Ampere (sm_80+): Triton paged decode and ragged prefill kernels through jax-triton (an optional extra, so
    CPU installs never import it); jnp compression; KV write as the XLA scatter."""
    try:
        triton_decode = importlib.import_module("pallas_kernels.triton_decode")
        triton_prefill = importlib.import_module("pallas_kernels.triton_prefill")
    except ImportError as e:
        raise ValueError("attention_backend: 'triton' needs jax-triton and triton "
                         f"(pip install 'zipage_jax[ampere]'); import failed: {e}") from e
    return {"triton": AttentionBackend(
        name="triton", decode=fp8_through_reference(triton_decode.paged_decode, REFERENCE_DECODE),
        prefill=fp8_prefill_through_copies(triton_prefill.ragged_prefill))}


KERNEL_BACKENDS = {"mosaic": mosaic_backends, "mosaic_decode": mosaic_backends, "triton": triton_backends}
