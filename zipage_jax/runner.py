"""Device side of the engine: jitted prefill / decode / compression steps per shape bucket over the donated pool.

Each step gets its integers as one packed buffer (one host→device copy), feeds decode tokens that are still
on the device straight from a persistent token buffer (no host round-trip), samples on the device and starts
an asynchronous copy of the sampled tokens back to the host. The host reads them one step later.

``execute`` runs one scheduler output in the order that makes it correct on one device stream: swap-outs copy
released pages to the host before anything reuses them, swap-ins restore pages, then compression (synchronous:
first, and the host waits; asynchronous: after the step's decode and prefill, never waited on), decode, prefill.
"""

import dataclasses
import functools
import time

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


def _compress_step(k_pool, v_pool, score_cache, query_cache, packed, *, spec, cfg, sm_scale, backend):
    return compress(k_pool, v_pool, score_cache, query_cache, packing.unpack(packed, spec), cfg, sm_scale,
                    backend=backend)


def _swap_gather(k_pool, v_pool, score_cache, query_cache, pages, query_slot, *, history):
    scores = score_cache[:, pages] if history else jnp.zeros((), jnp.float32)
    return k_pool[:, pages], v_pool[:, pages], scores, query_cache[:, query_slot]


def _swap_scatter(k_pool, v_pool, score_cache, query_cache, pages, query_slot, k, v, scores, queries, *, history):
    k_pool = k_pool.at[:, pages].set(k)
    v_pool = v_pool.at[:, pages].set(v)
    if history:
        score_cache = score_cache.at[:, pages].set(scores)
    return k_pool, v_pool, score_cache, query_cache.at[:, query_slot].set(queries)


class ModelRunner:
    def __init__(self, config, model_cfg, params, num_pages: int, max_model_len: int, dtype, backend, mesh,
                 eos_token_ids=(), num_query_slots: int | None = None, max_compression_pages: int | None = None):
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
        self.sink_slot = config.max_num_seqs  # rows that sample nothing write here
        self.compression = config.compression
        self.async_compression = config.async_compression
        self.window = config.window
        self.num_query_slots = num_query_slots or config.max_num_seqs
        self.query_sink = self.num_query_slots  # rows of requests without a query slot store their queries here
        self.max_compression_pages = max_compression_pages or self.pages_per_seq * config.max_num_seqs
        self.query_cache, self.score_cache = kv_cache.allocate_compression_state(
            model_cfg, config, num_pages, self.num_query_slots, dtype, mesh)
        self.scoring = scoring_config(config)
        self._compress = jax.jit(functools.partial(_compress_step, cfg=self.scoring,
                                                   sm_scale=model_cfg.head_dim ** -0.5, backend=backend),
                                 static_argnames=("spec",), donate_argnums=(0, 1, 2))
        history = config.compression and config.global_score
        self._swap_gather = jax.jit(functools.partial(_swap_gather, history=history))
        self._swap_scatter = jax.jit(functools.partial(_swap_scatter, history=history), donate_argnums=(0, 1, 2, 3))
        self.swap_page_sizes = bucket_sizes(1, self.pages_per_seq)
        self.compression_seconds = 0.0  # device time of the compressions dispatched (measured or estimated)
        self._compression_times: dict = {}  # shape -> measured seconds (asynchronous mode: probed once)
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
        query_slot = np.full(rows, self.query_sink, np.int32)
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
            if r.query_slot is not None:
                query_slot[i] = r.query_slot
        batch = PagedBatch(tokens=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                           page_tables=self._page_table(rows, requests), logits_indices=np.arange(rows, dtype=np.int32))
        inputs = dict(batch=batch, sampling=self._sampling(rows, requests, force_sampled), from_buffer=from_buffer,
                      buffer_slot=buffer_slot, sample_slot=sample_slot, query_slot=query_slot)
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
        query_slot = np.full(num_tokens, self.query_sink, np.int32)
        offset, sampled = 0, []
        for i, c in enumerate(chunks):
            r, n = c.request, c.num_tokens
            ids = r.token_slice(c.start, c.start + n)
            assert PENDING not in ids, "prefill over a token still on the device"
            tokens[offset:offset + n] = ids
            positions[offset:offset + n] = np.arange(c.start, c.start + n)
            slots[offset:offset + n] = [self._slot(r, j) for j in range(c.start, c.start + n)]
            cu_q_lens[i] = offset
            if r.query_slot is not None:  # one writer per ring slot: the chunk's last W tokens
                query_slot[max(offset, offset + n - self.window):offset + n] = r.query_slot
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

    def compression_widths(self, budget: int) -> list[int]:
        """Source-table widths (pages) of compressions at budget M: the steady state M+1, then doublings."""
        return bucket_sizes(budget + 1, self.pages_per_seq)

    def compression_rows(self, width: int) -> int:
        """Most rows of one compression dispatch of this width within ``max_compression_pages`` (a power of two)."""
        rows = 1
        while rows * 2 * width <= self.max_compression_pages and rows * 2 <= self.config.max_num_seqs:
            rows *= 2
        return rows

    def compress(self, compressions, wait: bool = False):
        """Dispatch the compaction of the due requests, grouped by budget M and padded source width, in
        dispatches of at most ``max_compression_pages`` padded pages (the scratch reserved at start-up).
        ``wait``: block until done (synchronous mode) and time it."""
        groups = {}
        for c in compressions:
            budget = len(c.dst_pages)
            width = pick_bucket(self.compression_widths(budget), len(c.src_pages))
            groups.setdefault((budget, width), []).append(c)
        for (budget, width), group in groups.items():
            most = self.compression_rows(width)
            for start in range(0, len(group), most):
                part = group[start:start + most]
                rows = pick_bucket(bucket_sizes(1, most), len(part))
                self._timed_compress(part, budget, width, rows, wait)

    def _timed_compress(self, group, budget: int, width: int, rows: int, wait: bool):
        """Compression device time for the metrics: measured around each dispatch when the host waits anyway
        (synchronous mode); otherwise measured on the first two dispatches of a shape and reused."""
        key = (budget, width, rows)
        seen = self._compression_times.get(key, [])
        measure = wait or len(seen) < 2
        if measure:
            jax.block_until_ready(self.k_pool)
            start = time.perf_counter()
        self._compress_group(group, budget, rows, width)
        if measure:
            jax.block_until_ready(self.k_pool)
            elapsed = time.perf_counter() - start
            self._compression_times[key] = seen + [elapsed]
            self.compression_seconds += elapsed
        else:
            self.compression_seconds += min(seen)

    def _compress_group(self, group, budget: int, rows: int, width: int | None = None):
        width = width or self.pages_per_seq
        src = np.zeros((rows, width), np.int32)
        dst = np.zeros((rows, budget), np.int32)
        num_src, query_slots, logical = (np.zeros(rows, np.int32) for _ in range(3))
        before, valid = np.zeros(rows, bool), np.zeros(rows, bool)
        for i, c in enumerate(group):
            assert c.request.query_slot is not None, "compression without a query slot"
            src[i, :len(c.src_pages)] = c.src_pages
            dst[i] = c.dst_pages
            num_src[i], query_slots[i], logical[i] = len(c.src_pages), c.request.query_slot, c.logical_len
            before[i], valid[i] = c.compressed_before, True
        targets = dst[valid]  # the compaction's scatter assumes distinct real pages (unique_indices)
        assert targets.min(initial=1) > 0 and len(np.unique(targets)) == targets.size, "overlapping dst pages"
        plan = CompressionPlan(src_tables=src, num_src_pages=num_src, dst_tables=dst, query_slots=query_slots,
                               logical_lens=logical, compressed_before=before, valid=valid)
        packed, spec = packing.pack(plan)
        self.k_pool, self.v_pool, self.score_cache = self._compress(
            self.k_pool, self.v_pool, self.score_cache, self.query_cache, jnp.asarray(packed), spec=spec)

    # -- swapping ------------------------------------------------------------------------------------------
    def swap_out(self, pages: list[int], query_slot: int) -> tuple:
        """Host copies of the pages' K/V (and scores) and of the query-cache row, ordered after every step
        dispatched so far; the host waits for them (swaps are rare), so the pages can be reused right away."""
        padded = np.zeros(pick_bucket(self.swap_page_sizes, len(pages)), np.int32)
        padded[:len(pages)] = pages
        arrays = self._swap_gather(self.k_pool, self.v_pool, self.score_cache, self.query_cache,
                                   jnp.asarray(padded), jnp.int32(query_slot))
        k, v, scores, queries = (np.asarray(a) for a in arrays)
        n = len(pages)
        return k[:, :n], v[:, :n], scores[:, :n] if scores.ndim else scores, queries

    def swap_in(self, pages: list[int], query_slot: int, state: tuple):
        """Write swapped-out contents into the request's new pages and query slot (padding goes to the null page)."""
        k, v, scores, queries = state
        size = pick_bucket(self.swap_page_sizes, len(pages))
        padded = np.zeros(size, np.int32)
        padded[:len(pages)] = pages

        def pad(a):
            return np.concatenate([a, np.zeros((a.shape[0], size - a.shape[1]) + a.shape[2:], a.dtype)], axis=1)

        scores = pad(scores) if scores.ndim else scores
        self.k_pool, self.v_pool, self.score_cache, self.query_cache = self._swap_scatter(
            self.k_pool, self.v_pool, self.score_cache, self.query_cache, jnp.asarray(padded),
            jnp.int32(query_slot), pad(k), pad(v), scores, queries)

    # -- one scheduler output ------------------------------------------------------------------------------
    def execute(self, scheduled, prefill_tokens: int | None = None, prefill_rows: int | None = None) -> list:
        """Dispatch everything ``scheduled`` asks for (see the module docstring); returns the step handles."""
        for swap in scheduled.swap_outs:
            swap.request.swap_state = self.swap_out(swap.pages, swap.query_slot)
        for request in scheduled.swap_ins:
            self.swap_in(request.block_ids, request.query_slot, request.swap_state)
            request.swap_state = None
        if scheduled.compressions and not self.async_compression:
            self.compress(scheduled.compressions, wait=True)
        handles = []
        if scheduled.decodes:
            handles.append(self.decode(scheduled.decodes))
        if scheduled.prefills:
            handles.append(self.prefill(scheduled.prefills, prefill_tokens, prefill_rows))
        if scheduled.compressions and self.async_compression:
            self.compress(scheduled.compressions)
        return handles

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
        budget = self.config.kv_budget_blocks
        if self.compression and budget + 1 <= self.pages_per_seq:
            # the steady-state width at every row bucket; wider ones (first compressions of long prompts) one row
            for width in self.compression_widths(budget):
                sizes = bucket_sizes(1, self.compression_rows(width)) if width == budget + 1 else [1]
                for rows in sizes:
                    self._compress_group([], budget, rows, width)
            size = pick_bucket(self.swap_page_sizes, budget + 1)
            state = self.swap_out([0] * size, self.query_sink)
            self.swap_in([0] * size, self.query_sink, state)
        jax.block_until_ready(self.token_buffer)
