"""Device side of the engine: jitted prefill / decode steps per shape bucket over the donated KV pool.

Each step gets its integers as one packed buffer (one host→device copy), feeds decode tokens that are still
on the device straight from a persistent token buffer (no host round-trip), samples on the device and starts
an asynchronous copy of the sampled tokens back to the host. The host reads them one step later.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax import kv_cache, packing, sharding
from zipage_jax.compression import CompressionPlan, ScoringConfig, compress
from zipage_jax.models import PagedBatch, forward_paged
from zipage_jax.request import PENDING
from zipage_jax.sampling import SamplingParams, SamplingRow, SamplingTensors, sample

GREEDY = SamplingParams(temperature=0.0)


def scoring_config(config) -> ScoringConfig:
    """The static scoring knobs of the engine config (same names, but ``eviction_policy`` → ``policy``)."""
    names = {f.name for f in dataclasses.fields(ScoringConfig)} - {"policy"}
    return ScoringConfig(policy=config.eviction_policy, **{name: getattr(config, name) for name in names})


def bucket_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` up to and including ``largest``."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return sizes + [largest]


def pick_bucket(sizes: list[int], n: int) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: which request each output row belongs to (None = no sample) and its device results."""

    requests: list
    tokens: jax.Array
    logprobs: jax.Array
    kind: str
    num_tokens: int

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.tokens), np.asarray(self.logprobs)


def _step(params, k_pool, v_pool, query_cache, token_buffer, packed, *, spec, model_cfg, backend, store_queries):
    inputs = packing.unpack(packed, spec)
    batch, sampling = inputs["batch"], inputs["sampling"]
    in_flight = token_buffer[inputs["buffer_slot"]]
    batch = batch.replace(tokens=jnp.where(inputs["from_buffer"], in_flight, batch.tokens))
    if store_queries:  # the window queries that compression scores with: a ring indexed by position % W
        logits, k_pool, v_pool, queries = forward_paged(params, model_cfg, k_pool, v_pool, batch, backend,
                                                        return_queries=True)
        ring = batch.positions % query_cache.shape[2]
        query_cache = query_cache.at[:, inputs["query_slot"], ring].set(queries.astype(query_cache.dtype))
    else:
        logits, k_pool, v_pool = forward_paged(params, model_cfg, k_pool, v_pool, batch, backend)
    # penalties must see the token each row is being fed even when the host does not know it yet
    pending = sampling.history_is_output & (sampling.history == PENDING)
    history = jnp.where(pending, token_buffer[inputs["sample_slot"]][:, None], sampling.history)
    tokens, logprobs = sample(logits, sampling.replace(history=history))
    token_buffer = token_buffer.at[inputs["sample_slot"]].set(tokens)
    return k_pool, v_pool, query_cache, token_buffer, tokens, logprobs


def _compress_step(k_pool, v_pool, score_cache, query_cache, packed, *, spec, cfg, sm_scale):
    return compress(k_pool, v_pool, score_cache, query_cache, packing.unpack(packed, spec), cfg, sm_scale)


class ModelRunner:
    def __init__(self, config, model_cfg, params, num_pages: int, max_model_len: int, dtype, backend, mesh,
                 eos_token_ids=()):
        self.config = config
        self.model_cfg = model_cfg
        self.params = params
        self.backend = backend
        self.page_size = config.block_size
        self.num_pages = num_pages
        self.pages_per_seq = -(-max_model_len // config.block_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.k_pool, self.v_pool = kv_cache.allocate_pool(model_cfg, num_pages, config.block_size, dtype,
                                                          sharding.kv_head_sharding(mesh))
        self.sink_slot = config.max_num_seqs  # rows that sample (or store queries for) nothing write here
        self.compression = config.compression
        self.window = config.window
        self.query_cache, self.score_cache = kv_cache.allocate_compression_state(
            model_cfg, config, num_pages, dtype, mesh)
        self.scoring = scoring_config(config)
        self._compress = jax.jit(functools.partial(_compress_step, cfg=self.scoring,
                                                   sm_scale=model_cfg.head_dim ** -0.5),
                                 static_argnames=("spec",), donate_argnums=(0, 1, 2))
        self.token_buffer = jax.device_put(np.zeros(config.max_num_seqs + 1, np.int32), sharding.replicated(mesh))
        self.decode_sizes = bucket_sizes(1, config.max_num_seqs)
        self.prefill_token_sizes = bucket_sizes(min(16, config.max_num_batched_tokens), config.max_num_batched_tokens)
        self.prefill_row_sizes = bucket_sizes(1, config.max_num_prefill_seqs)
        self._jitted = jax.jit(functools.partial(_step, model_cfg=model_cfg, backend=backend,
                                                 store_queries=config.compression),
                               static_argnames=("spec",), donate_argnums=(1, 2, 3, 4))

    # -- host-side packing -------------------------------------------------------------------------------
    def _page_table(self, rows: int, requests) -> np.ndarray:
        table = np.zeros((rows, self.pages_per_seq), np.int32)
        for i, r in enumerate(requests):
            table[i, :len(r.block_ids)] = r.block_ids
        return table

    def _slot(self, request, index: int) -> int:
        return request.block_ids[index // self.page_size] * self.page_size + index % self.page_size

    def _sampling(self, rows: int, requests, force_sampled: bool = False) -> SamplingTensors:
        """Per-row sampling tensors; ``force_sampled`` picks the sampling code path even for all-greedy rows
        (prefill always does: one executable per bucket, and its cost is small next to the prefill)."""
        sampling_rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.seed, len(r.output_token_ids))
            if r is not None else SamplingRow(GREEDY, (), (), 0, 0)
            for r in requests
        ]
        tensors = SamplingTensors.from_rows(sampling_rows, self.model_cfg.vocab_size, self.eos_token_ids,
                                            batch_size=rows)
        return tensors.replace(sampled=True) if force_sampled else tensors

    def _dispatch(self, inputs, requests, kind: str, num_tokens: int) -> StepHandle:
        packed, spec = packing.pack(inputs)
        self.k_pool, self.v_pool, self.query_cache, self.token_buffer, tokens, logprobs = self._jitted(
            self.params, self.k_pool, self.v_pool, self.query_cache, self.token_buffer, jnp.asarray(packed), spec=spec)
        tokens.copy_to_host_async()
        logprobs.copy_to_host_async()
        return StepHandle(requests, tokens, logprobs, kind, num_tokens)

    # -- steps ---------------------------------------------------------------------------------------------
    def decode(self, requests, rows: int | None = None, force_sampled: bool = False) -> StepHandle:
        """One token per request: the one at index ``num_computed_tokens - 1`` (already counted by the scheduler)."""
        rows = rows or pick_bucket(self.decode_sizes, len(requests))
        tokens, positions, slots, kv_lens = (np.zeros(rows, np.int32) for _ in range(4))
        from_buffer = np.zeros(rows, bool)
        buffer_slot = np.full(rows, self.sink_slot, np.int32)
        sample_slot = np.full(rows, self.sink_slot, np.int32)
        for i, r in enumerate(requests):
            index = r.num_computed_tokens - 1  # logical position; its slot is at the physical index
            token = r.token_at(index)
            if token == PENDING:
                from_buffer[i], buffer_slot[i] = True, r.token_slot
            else:
                tokens[i] = token
            physical = r.num_physical_tokens - 1
            positions[i], slots[i], kv_lens[i] = index, self._slot(r, physical), physical + 1
            sample_slot[i] = r.token_slot
        batch = PagedBatch(tokens=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                           page_tables=self._page_table(rows, requests), logits_indices=np.arange(rows, dtype=np.int32))
        inputs = dict(batch=batch, sampling=self._sampling(rows, requests, force_sampled), from_buffer=from_buffer,
                      buffer_slot=buffer_slot, sample_slot=sample_slot, query_slot=sample_slot)
        return self._dispatch(inputs, list(requests), "decode", len(requests))

    def prefill(self, chunks, num_tokens: int | None = None, rows: int | None = None) -> StepHandle:
        """Packed prompt chunks; rows whose chunk reaches the last known token sample the next one."""
        total = sum(c.num_tokens for c in chunks)
        num_tokens = num_tokens or pick_bucket(self.prefill_token_sizes, total)
        rows = rows or pick_bucket(self.prefill_row_sizes, len(chunks))
        tokens, positions, slots = (np.zeros(num_tokens, np.int32) for _ in range(3))
        cu_q_lens = np.full(rows + 1, total, np.int32)
        kv_lens, last_token = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        sample_slot = np.full(rows, self.sink_slot, np.int32)
        query_slot = np.full(num_tokens, self.sink_slot, np.int32)
        offset, sampled = 0, []
        for i, c in enumerate(chunks):
            r, n = c.request, c.num_tokens
            ids = r.token_slice(c.start, c.start + n)
            assert PENDING not in ids, "prefill over a token still on the device"
            tokens[offset:offset + n] = ids
            positions[offset:offset + n] = np.arange(c.start, c.start + n)
            slots[offset:offset + n] = [self._slot(r, j) for j in range(c.start, c.start + n)]
            cu_q_lens[i] = offset
            query_slot[max(offset, offset + n - self.window):offset + n] = r.token_slot  # one writer per ring slot
            offset += n
            kv_lens[i], last_token[i] = c.start + n, offset - 1
            if c.samples:
                sample_slot[i] = r.token_slot
            sampled.append(r if c.samples else None)
        batch = PagedBatch(tokens=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                           page_tables=self._page_table(rows, [c.request for c in chunks]),
                           logits_indices=last_token, cu_q_lens=cu_q_lens)
        inputs = dict(batch=batch, sampling=self._sampling(rows, sampled, force_sampled=True),
                      from_buffer=np.zeros(num_tokens, bool), buffer_slot=np.full(num_tokens, self.sink_slot, np.int32),
                      sample_slot=sample_slot, query_slot=query_slot)
        return self._dispatch(inputs, sampled, "prefill", total)

    def compress(self, compressions):
        """Dispatch the compaction of the due requests, grouped by budget M (the width of the target tables)."""
        by_budget = {}
        for c in compressions:
            by_budget.setdefault(len(c.dst_pages), []).append(c)
        for budget, group in by_budget.items():
            self._compress_group(group, budget, pick_bucket(self.decode_sizes, len(group)))

    def _compress_group(self, group, budget: int, rows: int):
        src = np.zeros((rows, self.pages_per_seq), np.int32)
        dst = np.zeros((rows, budget), np.int32)
        num_src, query_slots, logical = (np.zeros(rows, np.int32) for _ in range(3))
        before, valid = np.zeros(rows, bool), np.zeros(rows, bool)
        for i, c in enumerate(group):
            src[i, :len(c.src_pages)] = c.src_pages
            dst[i] = c.dst_pages
            num_src[i], query_slots[i], logical[i] = len(c.src_pages), c.request.token_slot, c.logical_len
            before[i], valid[i] = c.compressed_before, True
        plan = CompressionPlan(src_tables=src, num_src_pages=num_src, dst_tables=dst, query_slots=query_slots,
                               logical_lens=logical, compressed_before=before, valid=valid)
        packed, spec = packing.pack(plan)
        self.k_pool, self.v_pool, self.score_cache = self._compress(
            self.k_pool, self.v_pool, self.score_cache, self.query_cache, jnp.asarray(packed), spec=spec)

    # -- warm-up -------------------------------------------------------------------------------------------
    def warmup(self):
        """Compile every shape bucket with all-padding steps (writes land in the null page): greedy and sampled
        decode, prefill, compression. Penalties widen the history and compile on first use."""
        for rows in self.decode_sizes:
            self.decode([], rows)
            self.decode([], rows, force_sampled=True)
        for num_tokens in self.prefill_token_sizes:
            for rows in self.prefill_row_sizes:
                if rows <= num_tokens:
                    self.prefill([], num_tokens, rows)
        if self.compression:
            for rows in self.decode_sizes:
                self._compress_group([], self.config.kv_budget_blocks, rows)
        jax.block_until_ready(self.token_buffer)
