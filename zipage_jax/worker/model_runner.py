"""Device side of the engine: jitted prefill / decode / compression steps per shape bucket over the donated
DeviceState (pools, caches, token buffer).

Each step gets its integers as one packed buffer (one host→device copy), feeds decode tokens that are still
on the device straight from a persistent token buffer (no host round-trip), samples on the device and starts
an asynchronous copy of the sampled tokens back to the host, with their logprobs, ranks and the top
``MAX_LOGPROBS`` alternatives (``layers.logprobs``; every step computes them, so no request needs a program of
its own). The host reads them one step later. A prefill also returns its tokens' residual stream; when a chunk
belongs to a request asking for prompt logprobs, one more program (``_prompt_logprobs``, one shape) turns rows of
it into the logprobs of the prompt tokens they predict, ``prompt_logprob_rows`` rows a dispatch, so the
``[tokens, vocab]`` logits of a whole chunk never exist at once.

Every program (decode and prefill per shape bucket, compression, swaps) is compiled through ``Programs``: warm-up
compiles them all in parallel, and their number stays small (a handful of decode batch sizes and prefill token
counts, one prefill row count, powers of four of compression rows), see docs/ARCHITECTURE.md.

``execute`` runs one scheduler output in the order that makes it correct on one device stream: swap-outs copy
released pages to the host before anything reuses them, swap-ins restore pages, then compression (synchronous:
first, and the host waits; asynchronous: after the step's decode and prefill, never waited on), decode, prefill.
"""

import dataclasses
import functools
import itertools
import os
import time
import typing
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from zipage_jax import parallel
from zipage_jax.compression.step import CompressionBatch, compress
from zipage_jax.config import EngineConfig
from zipage_jax.core.request import PENDING
from zipage_jax.core.scheduler import SchedulerOutput
from zipage_jax.layers.attention import AttentionBackend
from zipage_jax.layers.logprobs import token_logprobs
from zipage_jax.layers.sampler import SamplingRow, SamplingTensors, sample
from zipage_jax.models import PagedBatch, forward_paged
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.transformer import final_logits
from zipage_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from zipage_jax.worker import device_state, kv_cache, packing
from zipage_jax.worker.device_state import DeviceState
from zipage_jax.worker.executable_store import ExecutableStore, engine_fingerprint
from zipage_jax.worker.programs import Program, Programs

GREEDY = SamplingParams(temperature=0.0)
# Compiler options of every engine program. XLA's rematerialization pass compares a program's footprint with a
# memory limit that the preallocated KV pool always exceeds, and then recomputes work to save memory (in the
# decode step: the fused QKV matmul, three times a layer). The pool sizing already reserves every program's
# scratch, so the pass can only cost time.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
# From this many tokens a step (a decode step: one a row) on, cuBLAS beats XLA's Triton GEMMs in the decode step;
# below it Triton wins (measured on the H200 at Qwen3-8B shapes: BENCHMARKS.md, "Decode step at the HBM roofline").
CUBLAS_MIN_TOKENS = 64
# Prompt positions scored per dispatch of the prompt-logprobs program: its [rows, vocab] f32 logits stay within
# the sampling scratch the memory plan reserves for a decode step.
PROMPT_LOGPROB_ROWS = 128


def compiler_options(num_tokens: int) -> dict:
    """XLA options of a step program over ``num_tokens`` tokens (its matmuls' first dimension)."""
    if jax.default_backend() == "gpu" and num_tokens >= CUBLAS_MIN_TOKENS:
        return {**COMPILER_OPTIONS, "xla_gpu_enable_triton_gemm": False}
    return COMPILER_OPTIONS


def bucket_sizes(smallest: int, largest: int, factor: int = 2) -> list[int]:
    """``smallest`` times powers of ``factor`` below ``largest``, then ``largest``."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= factor
    return sizes + [largest]


def pick_bucket(sizes: list[int], n: int) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens in flight: row i is prompt token ``positions[i]`` of ``requests[i]``; ``ids`` and
    ``values`` in the layout of ``layers.logprobs.token_logprobs`` (rows past ``len(positions)`` are padding)."""

    requests: list
    positions: list[int]
    ids: jax.Array
    values: jax.Array

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids), np.asarray(self.values)


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: which request each output row belongs to (None = no sample) and its device results
    (a fake device gives host arrays): ``ids [B, 2 + K]`` int32 (sampled token, its rank, the top-K ids) and
    ``values [B, 1 + K]`` f32 (its logprob, the top-K logprobs), and the prompt logprobs it computed."""

    requests: list
    ids: jax.Array
    values: jax.Array
    kind: str  # "decode" or "prefill"
    num_tokens: int
    prompt_logprobs: list[PromptLogprobs] = dataclasses.field(default_factory=list)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids), np.asarray(self.values)


@dataclasses.dataclass
class WarmupBucket:
    """The programs of one shape bucket: ``kind`` ("decode", "prefill", ("compress", budget, width), ...) and
    ``size`` (rows, tokens or pages). A light load needs the smallest bucket of each kind (``light``)."""

    kind: Hashable
    size: int
    programs: list[Program]
    light: bool = False


@typing.runtime_checkable
class Runner(typing.Protocol):
    """What the engine (step loop, warm-up, metrics) needs of the device side; ``ModelRunner`` is the real one,
    the scheduler's property tests bring a fake device."""

    compression_seconds: float  # device time spent compressing so far (engine metrics)
    programs: Programs  # its compiled programs; the metrics subtract their ``compile_wall_s`` from device time

    def execute(self, scheduled: SchedulerOutput) -> list[StepHandle]:
        """Dispatch one scheduler output (in the order of ``ModelRunner.execute``); one handle per step that
        samples tokens, read back by the engine one step later."""

    def warmup(self, progress=None) -> dict:
        """Compile every program a workload can need now; ``{"programs": count, "compile_s": wall seconds}``."""

    def limits(self) -> tuple[int, int] | None:
        """The most decode rows and prefill tokens a step may take now (while programs compile in the background),
        or None: no limit beyond the configuration's."""


def _step(params, state: DeviceState, packed, *, spec, model_cfg, backend, store_queries, hidden_rows,
          hidden_sharding):
    """One decode or prefill step: ``(state, ids, values)`` of the sampled rows (``token_logprobs`` layout), and
    for a prefill the residual stream of its tokens, padded to ``hidden_rows`` so that one prompt-logprobs
    program reads every prefill bucket's."""
    inputs = packing.unpack(packed, spec)
    batch, sampling = inputs["batch"], inputs["sampling"]
    k_pool, v_pool, query_cache, token_buffer = state.k_pool, state.v_pool, state.query_cache, state.token_buffer
    in_flight = token_buffer[inputs["buffer_row"]]
    batch = batch.replace(tokens=jnp.where(inputs["from_buffer"], in_flight, batch.tokens))
    prefill = batch.cu_q_lens is not None
    logits, k_pool, v_pool, *extra = forward_paged(params, model_cfg, k_pool, v_pool, batch, backend,
                                                   return_queries=store_queries, return_hidden=prefill)
    if store_queries:  # the window queries that compression scores with: a ring indexed by position % W
        ring = batch.positions % query_cache.shape[2]
        query_cache = query_cache.at[:, inputs["query_row"], ring].set(extra[0].astype(query_cache.dtype))
    # penalties must see the token each row is being fed even when the host does not know it yet
    pending = sampling.history_is_output & (sampling.history == PENDING)
    history = jnp.where(pending, token_buffer[inputs["sample_row"]][:, None], sampling.history)
    tokens, _ = sample(logits, sampling.replace(history=history))
    ids, values = token_logprobs(logits, tokens, MAX_LOGPROBS)
    token_buffer = token_buffer.at[inputs["sample_row"]].set(tokens)
    state = state.replace(k_pool=k_pool, v_pool=v_pool, query_cache=query_cache, token_buffer=token_buffer)
    if not prefill:
        return state, ids, values
    hidden = jnp.pad(extra[-1], ((0, hidden_rows - extra[-1].shape[0]), (0, 0)))
    return state, ids, values, jax.lax.with_sharding_constraint(hidden, hidden_sharding)


def _prompt_logprobs(params, hidden, rows, targets, *, model_cfg):
    """Logprobs (``token_logprobs`` layout) of ``targets [R]``, each predicted by ``hidden[rows]``."""
    return token_logprobs(final_logits(params, model_cfg, hidden[rows]), targets, MAX_LOGPROBS)


def _compress_step(state: DeviceState, packed, *, spec, cfg, sm_scale, backend, mesh):
    """Under tensor parallelism each shard compresses its own KV heads (``shard_map``): a head's scores, selection
    and compaction read only that head and its query group, so the step needs no collective and the backend's
    compression kernels run on one shard's heads."""
    def run(k_pool, v_pool, score_cache, query_cache, batch):
        return compress(k_pool, v_pool, score_cache, query_cache, batch, cfg, sm_scale, backend=backend)

    if mesh.size > 1:
        heads, scores = parallel.KV_HEADS, parallel.KV_HEADS if cfg.tracks_history else P()  # as allocated
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, scores, parallel.QUERY_HEADS, P()),
                            out_specs=(heads, heads, scores), check_vma=False)
    k_pool, v_pool, score_cache = run(state.k_pool, state.v_pool, state.score_cache, state.query_cache,
                                      packing.unpack(packed, spec))
    return state.replace(k_pool=k_pool, v_pool=v_pool, score_cache=score_cache)


def _swap_gather(state: DeviceState, pages, query_row, *, history):
    scores = state.score_cache[:, pages] if history else jnp.zeros((), jnp.float32)
    return state.k_pool[:, pages], state.v_pool[:, pages], scores, state.query_cache[:, query_row]


def swapped_shapes(state: DeviceState, size: int, history: bool) -> tuple:
    """What ``_swap_gather`` returns for ``size`` pages, without tracing it (a warm start traces nothing)."""
    def pages(x):
        return jax.ShapeDtypeStruct(x.shape[:1] + (size,) + x.shape[2:], x.dtype)

    scores = pages(state.score_cache) if history else jax.ShapeDtypeStruct((), jnp.float32)
    queries = state.query_cache
    return (pages(state.k_pool), pages(state.v_pool), scores,
            jax.ShapeDtypeStruct(queries.shape[:1] + queries.shape[2:], queries.dtype))


def _swap_scatter(state: DeviceState, pages, query_row, k, v, scores, queries, *, history):
    score_cache = state.score_cache.at[:, pages].set(scores) if history else state.score_cache
    return state.replace(k_pool=state.k_pool.at[:, pages].set(k), v_pool=state.v_pool.at[:, pages].set(v),
                         score_cache=score_cache, query_cache=state.query_cache.at[:, query_row].set(queries))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, plan: kv_cache.MemoryPlan, params,
                 backend: AttentionBackend, mesh, eos_token_ids=(), progress=None, state: DeviceState | None = None):
        self.config = config
        self.model_cfg = model_cfg
        self.params = params
        self.backend = backend
        self.page_size = config.page_size
        self.num_pages = num_pages = plan.num_pages
        self.pages_per_seq = plan.pages_per_seq
        self.eos_token_ids = tuple(eos_token_ids)
        self.sink_row = config.max_num_seqs  # rows that sample nothing write here
        self.compression = config.compression
        self.async_compression = config.async_compression
        self.window = config.scoring.window
        self.num_query_rows = plan.num_query_rows
        self.query_sink = self.num_query_rows  # rows of requests without a query row store their queries here
        self.max_compression_pages = plan.max_compression_pages
        if state is None:  # else allocated by the caller, before the weights (``LLMEngine``)
            state = device_state.allocate(config, model_cfg, num_pages, self.num_query_rows, plan.dtype, mesh)
        self.state = state
        self.scoring = config.scoring
        store = None
        if config.compilation_cache_dir:  # warm starts load the programs without tracing them
            store = ExecutableStore(os.path.join(config.compilation_cache_dir, "executables"),
                                    engine_fingerprint(config, model_cfg, backend.name, mesh), mesh.devices.flat)
        self.programs = Programs(progress, store)
        self._compress = jax.jit(functools.partial(_compress_step, cfg=self.scoring,
                                                   sm_scale=model_cfg.head_dim ** -0.5, backend=backend, mesh=mesh),
                                 static_argnames=("spec",), donate_argnames=("state",))
        history = config.tracks_history
        self._swap_gather = jax.jit(functools.partial(_swap_gather, history=history))
        self._swap_scatter = jax.jit(functools.partial(_swap_scatter, history=history),
                                     donate_argnames=("state",))
        self.swap_page_sizes = bucket_sizes(1, self.pages_per_seq)
        self.compression_seconds = 0.0  # device time of the compressions dispatched (measured or estimated)
        # of which those wider than M + 1 pages: first compressions of long contexts (long prompts, the throughput
        # benchmark's aged start), which a steady state of short prompts does not have
        self.wide_compression_seconds = 0.0
        self.last_decode_key = None  # program key of the last decode step (``programs.compiled``: its HLO)
        self._last_decode = None  # its host inputs, requests and rows (``replay_last_decode``)
        self._compression_times: dict = {}  # shape -> measured seconds (asynchronous mode: probed once)
        self._compression_dispatches: dict = {}  # shape -> [dispatches, requests compressed]
        self._pending_buckets: list[WarmupBucket] | None = None  # while a ready-early warm-up compiles (``limits``)
        self.replicated = parallel.replicated(mesh)  # where each step's packed integers go
        self.decode_sizes = bucket_sizes(min(8, config.max_num_seqs), config.max_num_seqs)
        self.prefill_token_sizes = bucket_sizes(min(max(16, config.max_num_batched_tokens // 16),
                                                    config.max_num_batched_tokens), config.max_num_batched_tokens)
        self.prefill_rows = config.max_num_prefill_seqs  # one row count: its arrays are small next to the tokens
        self._step = jax.jit(functools.partial(_step, model_cfg=model_cfg, backend=backend,
                                               store_queries=config.compression,
                                               hidden_rows=config.max_num_batched_tokens,
                                               hidden_sharding=self.replicated),
                             static_argnames=("spec",), donate_argnames=("state",))
        self.prompt_logprob_rows = min(PROMPT_LOGPROB_ROWS, config.max_num_batched_tokens)
        self._prompt_logprobs = jax.jit(functools.partial(_prompt_logprobs, model_cfg=model_cfg))

    # -- host-side packing -------------------------------------------------------------------------------
    def _page_table(self, rows: int, requests) -> np.ndarray:
        """``[rows, pages_per_seq]`` page ids of ``requests`` (zeros past each one's pages), filled in one scatter."""
        table = np.zeros((rows, self.pages_per_seq), np.int32)
        lengths = np.fromiter((len(r.page_ids) for r in requests), np.int64, len(requests))
        total = int(lengths.sum())
        if total:
            ids = np.fromiter(itertools.chain.from_iterable(r.page_ids for r in requests), np.int32, total)
            row = np.repeat(np.arange(len(requests)), lengths)
            col = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            table[row, col] = ids
        return table

    def _sampling(self, rows: int, requests, force_sampled: bool = False) -> SamplingTensors:
        """Per-row sampling tensors; ``force_sampled`` picks the sampling code path even for all-greedy rows
        (prefill always does: one program per bucket, and its cost is small next to the prefill)."""
        sampling_rows = [
            SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.seed, len(r.output_token_ids))
            if r is not None else SamplingRow(GREEDY, (), (), 0, 0)
            for r in requests
        ]
        tensors = SamplingTensors.from_rows(sampling_rows, self.model_cfg.vocab_size, self.eos_token_ids,
                                            batch_size=rows)
        return tensors.replace(sampled=True) if force_sampled else tensors

    def _step_program(self, inputs, kind: str, num_tokens: int) -> tuple[Program, np.ndarray]:
        """The step program for ``inputs`` of ``num_tokens`` tokens (the bucket: one a row in a decode step)."""
        packed, spec = packing.pack(inputs)
        sampling = inputs["sampling"]
        mode = "penalized" if sampling.penalized else "sampled" if sampling.sampled else "greedy"
        unit = "rows" if kind == "decode" else "tokens"
        program = Program(key=("step", spec), name=f"{kind} {num_tokens} {unit}, {mode}", jitted=self._step,
                          args=(self.params, self.state,
                                jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=self.replicated)),
                          static=dict(spec=spec), options=compiler_options(num_tokens))
        return program, packed

    def _dispatch(self, inputs, requests, kind: str, num_tokens: int, bucket: int) -> tuple[StepHandle, list]:
        """Run the step on ``inputs`` (``num_tokens`` real tokens, padded to ``bucket``); its handle, and for a
        prefill its tokens' residual stream (else None)."""
        program, packed = self._step_program(inputs, kind, bucket)
        self.state, ids, values, *hidden = self.programs.run(program, self.params, self.state,
                                                             jax.device_put(packed, self.replicated))
        ids.copy_to_host_async()
        values.copy_to_host_async()
        if kind == "decode":
            self.last_decode_key, self._last_decode = program.key, (inputs, requests, bucket)
        return StepHandle(requests, ids, values, kind, num_tokens), (hidden[0] if hidden else None)

    def replay_last_decode(self) -> jax.Array:
        """Dispatch the last decode step again and return its sampled tokens (block on them): one step's device
        time with no host work around it, for benchmarks and profiles. The input tokens that step read on the
        device are known on the host by now (read back with it) and are fed as such, so the replay rewrites what
        the step wrote (its KV slots; its token-buffer rows, the same tokens unless penalties apply); valid until
        the next step changes pages or rows."""
        if self._last_decode is None:
            raise RuntimeError("replay_last_decode: no decode step was dispatched yet")
        inputs, requests, rows = self._last_decode
        batch = inputs["batch"]
        tokens = np.array(batch.tokens)
        for row in np.flatnonzero(inputs["from_buffer"]):
            tokens[row] = requests[row].token_at(int(batch.positions[row]))
        inputs = dict(inputs, batch=batch.replace(tokens=tokens), from_buffer=np.zeros(rows, bool))
        program, packed = self._step_program(inputs, "decode", rows)
        self.state, ids, *_ = self.programs.run(program, self.params, self.state,
                                                jax.device_put(packed, self.replicated))
        return ids[:, 0]  # the sampled tokens (``layers.logprobs``: each row's token first)

    # -- steps ---------------------------------------------------------------------------------------------
    def _decode_inputs(self, requests, rows: int, force_sampled: bool = False) -> dict:
        n = len(requests)
        index = np.fromiter((r.num_computed_tokens for r in requests), np.int32, n) - 1  # logical position
        physical = np.fromiter((r.num_physical_tokens for r in requests), np.int32, n) - 1  # its slot's index
        known = np.fromiter((r.token_at(i) for r, i in zip(requests, index.tolist())), np.int32, n)
        token_row = np.fromiter((r.token_row for r in requests), np.int32, n)
        query = np.fromiter((self.query_sink if r.query_row is None else r.query_row for r in requests),
                            np.int32, n)
        table = self._page_table(rows, requests)
        pending = known == PENDING

        def padded(values, fill=0, dtype=np.int32):
            out = np.full(rows, fill, dtype)
            out[:n] = values
            return out

        page_of_slot = table[np.arange(n), physical // self.page_size]
        batch = PagedBatch(tokens=padded(np.where(pending, 0, known)), positions=padded(index),
                           slot_mapping=padded(page_of_slot * self.page_size + physical % self.page_size),
                           kv_lens=padded(physical + 1), page_tables=table,
                           logits_indices=np.arange(rows, dtype=np.int32))
        return dict(batch=batch, sampling=self._sampling(rows, requests, force_sampled),
                    from_buffer=padded(pending, False, bool),
                    buffer_row=padded(np.where(pending, token_row, self.sink_row), self.sink_row),
                    sample_row=padded(token_row, self.sink_row), query_row=padded(query, self.query_sink))

    def decode(self, requests) -> StepHandle:
        """One token per request: the one at index ``num_computed_tokens - 1`` (already counted by the scheduler)."""
        rows = pick_bucket(self.decode_sizes, len(requests))
        inputs = self._decode_inputs(requests, rows)
        return self._dispatch(inputs, list(requests), "decode", len(requests), rows)[0]

    def _prefill_inputs(self, chunks, num_tokens: int, rows: int) -> tuple[dict, list]:
        total = sum(c.num_tokens for c in chunks)
        tokens, positions, slots = (np.zeros(num_tokens, np.int32) for _ in range(3))
        cu_q_lens = np.full(rows + 1, total, np.int32)
        kv_lens, last_token = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        sample_row = np.full(rows, self.sink_row, np.int32)
        query_row = np.full(num_tokens, self.query_sink, np.int32)
        offset, sampled = 0, []
        for i, c in enumerate(chunks):
            r, n = c.request, c.num_tokens
            ids = r.token_slice(c.start, c.start + n)
            assert PENDING not in ids, "prefill over a token still on the device"
            tokens[offset:offset + n] = ids
            index = np.arange(c.start, c.start + n)
            positions[offset:offset + n] = index
            pages = np.asarray(r.page_ids, np.int32)[index // self.page_size]
            slots[offset:offset + n] = pages * self.page_size + index % self.page_size
            cu_q_lens[i] = offset
            if r.query_row is not None:  # one writer per ring slot: the chunk's last W tokens
                query_row[max(offset, offset + n - self.window):offset + n] = r.query_row
            offset += n
            kv_lens[i], last_token[i] = c.start + n, offset - 1
            if c.samples:
                sample_row[i] = r.token_row
            sampled.append(r if c.samples else None)
        batch = PagedBatch(tokens=tokens, positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                           page_tables=self._page_table(rows, [c.request for c in chunks]),
                           logits_indices=last_token, cu_q_lens=cu_q_lens)
        inputs = dict(batch=batch, sampling=self._sampling(rows, sampled, force_sampled=True),
                      from_buffer=np.zeros(num_tokens, bool), buffer_row=np.full(num_tokens, self.sink_row, np.int32),
                      sample_row=sample_row, query_row=query_row)
        return inputs, sampled

    def prefill(self, chunks) -> StepHandle:
        """Packed prompt chunks; rows whose chunk reaches the last known token sample the next one."""
        total = sum(c.num_tokens for c in chunks)
        num_tokens = pick_bucket(self.prefill_token_sizes, total)
        inputs, sampled = self._prefill_inputs(chunks, num_tokens, self.prefill_rows)
        handle, hidden = self._dispatch(inputs, sampled, "prefill", total, num_tokens)
        handle.prompt_logprobs = self._score_prompts(chunks, hidden)
        return handle

    def _score_prompts(self, chunks, hidden) -> list[PromptLogprobs]:
        """Dispatch the prompt logprobs of the chunks whose requests ask for them: the token at position t
        predicts prompt token t + 1, which the host knows (a chunk's last token predicts the next chunk's first)."""
        rows, targets, requests, positions = [], [], [], []
        offset = 0
        for c in chunks:
            r = c.request
            if r.sampling_params.prompt_logprobs is not None:
                prompt = r.prompt_token_ids
                end = min(c.start + c.num_tokens, len(prompt) - 1)  # output tokens (a recompute) are not scored
                rows.extend(range(offset, offset + max(end - c.start, 0)))
                targets.extend(prompt[c.start + 1:end + 1])
                requests.extend([r] * max(end - c.start, 0))
                positions.extend(range(c.start + 1, end + 1))
            offset += c.num_tokens
        parts, size = [], self.prompt_logprob_rows
        for start in range(0, len(rows), size):
            index = np.zeros((2, size), np.int32)  # padding rows score row 0 against token 0; nobody reads them
            index[0, :len(rows[start:start + size])] = rows[start:start + size]
            index[1, :len(targets[start:start + size])] = targets[start:start + size]
            row_index, target = jax.device_put((index[0], index[1]), self.replicated)
            ids, values = self.programs.run(self._prompt_program(), self.params, hidden, row_index, target)
            ids.copy_to_host_async()
            values.copy_to_host_async()
            parts.append(PromptLogprobs(requests[start:start + size], positions[start:start + size], ids, values))
        return parts

    def _prompt_program(self) -> Program:
        hidden = jax.ShapeDtypeStruct((self.config.max_num_batched_tokens, self.model_cfg.hidden_size),
                                      self.params.embed.dtype, sharding=self.replicated)
        index = jax.ShapeDtypeStruct((self.prompt_logprob_rows,), jnp.int32, sharding=self.replicated)
        return Program(key=("prompt_logprobs",), name=f"prompt logprobs {self.prompt_logprob_rows} rows",
                       jitted=self._prompt_logprobs, args=(self.params, hidden, index, index),
                       options=compiler_options(self.prompt_logprob_rows))

    def compression_widths(self, budget: int) -> list[int]:
        """Source-table widths (pages) of compressions at budget M: the steady state M+1, then quadruplings up to
        a request's most pages (a last quadrupling within 2x of that merges into it). Wider, first compressions
        (long prompts) are rare and their kernels read only the live blocks, so coarse widths cost little at run
        time, and each width saved is a program less to trace (~1.5 s of a cold start, four Mosaic kernels) and
        compile."""
        widths = bucket_sizes(budget + 1, self.pages_per_seq, factor=4)
        if len(widths) > 2 and widths[-1] < 2 * widths[-2]:
            del widths[-2]
        return widths

    def compression_rows(self, width: int) -> int:
        """Most rows of one compression dispatch of this width within ``max_compression_pages`` (a power of four)."""
        rows = 1
        while rows * 4 * width <= self.max_compression_pages and rows * 4 <= self.config.max_num_seqs:
            rows *= 4
        return rows

    def compress(self, compressions, wait: bool = False):
        """Dispatch the compaction of the due requests, grouped by budget M and padded source width, in
        dispatches of at most ``max_compression_pages`` padded pages (the scratch reserved at start-up); the
        steady-state width ``M+1`` batches rows in powers of four, wider (first) compressions go one by one.
        ``wait``: block until done (synchronous mode) and time it."""
        groups = {}
        for c in compressions:
            budget = len(c.dst_pages)
            width = pick_bucket(self.compression_widths(budget), len(c.src_pages))
            groups.setdefault((budget, width), []).append(c)
        for (budget, width), group in groups.items():
            # wider first compressions (long prompts) are rare: one row a dispatch, one program per width
            most = self.compression_rows(width) if width == budget + 1 else 1
            most = self._compression_rows_ready(budget, width, most)
            for start in range(0, len(group), most):
                part = group[start:start + most]
                rows = pick_bucket(bucket_sizes(1, most, 4), len(part))
                self._timed_compress(part, budget, width, rows, wait)

    def _timed_compress(self, group, budget: int, width: int, rows: int, wait: bool):
        """Compression device time for the metrics: measured around each dispatch when the host waits anyway
        (synchronous mode); otherwise measured on the first two dispatches of a shape and reused."""
        key = (budget, width, rows)
        counts = self._compression_dispatches.setdefault(key, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + len(group)
        seen = self._compression_times.get(key, [])
        measure = wait or len(seen) < 2
        if measure:
            jax.block_until_ready(self.state.k_pool)
            start, compiling = time.perf_counter(), self.programs.compile_wall_s
        self._compress_group(group, budget, rows, width)
        if measure:
            jax.block_until_ready(self.state.k_pool)
            # a program met here for the first time compiles inside the dispatch: that is start-up, not device time
            elapsed = time.perf_counter() - start - (self.programs.compile_wall_s - compiling)
            self._compression_times[key] = seen + [elapsed]
        else:
            elapsed = min(seen)
        self.compression_seconds += elapsed
        if width > budget + 1:
            self.wide_compression_seconds += elapsed

    def compression_profile(self) -> list[dict]:
        """Per dispatch shape (budget M, padded width, row bucket): dispatches, requests compressed and the
        fastest measured seconds of one, to tell a dispatch's fixed cost from its per-row cost."""
        return [dict(budget=b, width=w, rows=r, dispatches=n, requests=k,
                     seconds=min(self._compression_times.get((b, w, r), []), default=None))
                for (b, w, r), (n, k) in sorted(self._compression_dispatches.items())]

    def _compression_batch(self, group, budget: int, rows: int, width: int) -> CompressionBatch:
        src = np.zeros((rows, width), np.int32)
        dst = np.zeros((rows, budget), np.int32)
        num_src, query_rows, logical = (np.zeros(rows, np.int32) for _ in range(3))
        before, valid = np.zeros(rows, bool), np.zeros(rows, bool)
        for i, c in enumerate(group):
            assert c.request.query_row is not None, "compression without a query row"
            src[i, :len(c.src_pages)] = c.src_pages
            dst[i] = c.dst_pages
            num_src[i], query_rows[i], logical[i] = len(c.src_pages), c.request.query_row, c.logical_len
            before[i], valid[i] = c.compressed_before, True
        targets = dst[valid]  # the compaction's scatter assumes distinct real pages (unique_indices)
        assert targets.min(initial=1) > 0 and len(np.unique(targets)) == targets.size, "overlapping dst pages"
        return CompressionBatch(src_tables=src, num_src_pages=num_src, dst_tables=dst, query_rows=query_rows,
                               logical_lens=logical, compressed_before=before, valid=valid)

    def _compress_program(self, packed, spec, rows: int, width: int) -> Program:
        return Program(key=("compress", spec), name=f"compress {rows} rows x {width} pages", jitted=self._compress,
                       args=(self.state, jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=self.replicated)),
                       static=dict(spec=spec), options=COMPILER_OPTIONS)

    def _compress_group(self, group, budget: int, rows: int, width: int):
        packed, spec = packing.pack(self._compression_batch(group, budget, rows, width))
        self.state = self.programs.run(self._compress_program(packed, spec, rows, width), self.state,
                                       jax.device_put(packed, self.replicated))

    # -- swapping ------------------------------------------------------------------------------------------
    def _swap_programs(self, size: int, state=None) -> tuple[Program, Program]:
        index = (jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated),
                 jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated))
        gather = Program(("swap_out", size), f"swap out {size} pages", self._swap_gather, (self.state,) + index,
                         options=COMPILER_OPTIONS)
        state = swapped_shapes(self.state, size, self.config.tracks_history) if state is None else \
            tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state)
        scatter = Program(("swap_in", size), f"swap in {size} pages", self._swap_scatter,
                          (self.state,) + index + state, options=COMPILER_OPTIONS)
        return gather, scatter

    def _swap_index(self, pages: np.ndarray, query_row: int):
        return jax.device_put((pages, np.int32(query_row)), self.replicated)

    def swap_out(self, pages: list[int], query_row: int) -> tuple:
        """Host copies of the pages' K/V (and scores) and of the query-cache row, ordered after every step
        dispatched so far; the host waits for them (swaps are rare), so the pages can be reused right away.
        Across processes every one gathers the whole copy (its heads live on other hosts' devices too)."""
        padded = np.zeros(pick_bucket(self.swap_page_sizes, len(pages)), np.int32)
        padded[:len(pages)] = pages
        gather, _ = self._swap_programs(len(padded))
        arrays = self.programs.run(gather, self.state, *self._swap_index(padded, query_row))
        k, v, scores, queries = multihost_utils.process_allgather(arrays, tiled=True)
        n = len(pages)
        return k[:, :n], v[:, :n], scores[:, :n] if scores.ndim else scores, queries

    def swap_in(self, pages: list[int], query_row: int, state: tuple):
        """Write swapped-out contents into the request's new pages and query row (padding goes to the null page)."""
        k, v, scores, queries = state
        size = pick_bucket(self.swap_page_sizes, len(pages))
        padded = np.zeros(size, np.int32)
        padded[:len(pages)] = pages

        def pad(a):
            return np.concatenate([a, np.zeros((a.shape[0], size - a.shape[1]) + a.shape[2:], a.dtype)], axis=1)

        scores = pad(scores) if scores.ndim else scores
        state = (pad(k), pad(v), scores, queries)
        _, scatter = self._swap_programs(size, state)
        self.state = self.programs.run(scatter, self.state, *self._swap_index(padded, query_row), *state)

    # -- one scheduler output ------------------------------------------------------------------------------
    def execute(self, scheduled: SchedulerOutput) -> list[StepHandle]:
        """Dispatch everything ``scheduled`` asks for (see the module docstring); returns the step handles."""
        for swap in scheduled.swap_outs:
            swap.request.swap_state = self.swap_out(swap.pages, swap.query_row)
        for request in scheduled.swap_ins:
            self.swap_in(request.page_ids, request.query_row, request.swap_state)
            request.swap_state = None
        if scheduled.compressions and not self.async_compression:
            self.compress(scheduled.compressions, wait=True)
        handles = []
        if scheduled.decodes:
            handles.append(self.decode(scheduled.decodes))
        if scheduled.prefills:
            handles.append(self.prefill(scheduled.prefills))
        if scheduled.compressions and self.async_compression:
            self.compress(scheduled.compressions)
        return handles

    # -- warm-up -------------------------------------------------------------------------------------------
    def warmup_buckets(self) -> list[WarmupBucket]:
        """Every program a workload without penalties can need, by bucket, the ones a light load needs first: the
        prompt-logprobs program, greedy and sampled decode per batch bucket, prefill per token bucket, and with
        compression the steady-state compression at every row bucket, the wider first compressions of long prompts
        at one row, and the swaps of a steady-state request. Penalties (repetition, presence, frequency) widen the
        sampling history and compile on first use."""
        buckets = [WarmupBucket("prompt_logprobs", 0, [self._prompt_program()])]
        for rows in self.decode_sizes:
            buckets.append(WarmupBucket("decode", rows, [
                self._step_program(self._decode_inputs([], rows, sampled), "decode", rows)[0]
                for sampled in (False, True)]))
        for num_tokens in self.prefill_token_sizes:
            inputs, _ = self._prefill_inputs([], num_tokens, self.prefill_rows)
            buckets.append(WarmupBucket("prefill", num_tokens, [self._step_program(inputs, "prefill", num_tokens)[0]]))
        compressions = self._warmup_compressions()
        for budget, width, rows in compressions:
            packed, spec = packing.pack(self._compression_batch([], budget, rows, width))
            buckets.append(WarmupBucket(("compress", budget, width), rows,
                                        [self._compress_program(packed, spec, rows, width)]))
        if compressions:
            size = pick_bucket(self.swap_page_sizes, self.config.kv_budget_pages + 1)
            buckets.append(WarmupBucket("swap", size, list(self._swap_programs(size))))
        # a light load needs the smallest bucket of each kind (every compression width at one row); the rest
        # follow level by level (the second size of every kind, then the third, ...), so all kinds grow together
        sizes = {}
        for bucket in buckets:
            sizes.setdefault(bucket.kind, []).append(bucket.size)
        level = {id(b): sorted(sizes[b.kind]).index(b.size) for b in buckets}
        for bucket in buckets:
            bucket.light = level[id(bucket)] == 0
        return sorted(buckets, key=lambda b: level[id(b)])

    def warmup_programs(self) -> list[Program]:
        return [p for bucket in self.warmup_buckets() for p in bucket.programs]

    def _warmup_compressions(self) -> list[tuple[int, int, int]]:
        budget = self.config.kv_budget_pages
        if not self.compression or budget + 1 > self.pages_per_seq:
            return []
        shapes = []
        for width in self.compression_widths(budget):
            sizes = bucket_sizes(1, self.compression_rows(width), 4) if width == budget + 1 else [1]
            shapes.extend((budget, width, rows) for rows in sizes)
        return shapes

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile (or load from the executable store) every warm-up program, in parallel; returns their number,
        the wall seconds it took and where they went (see ``Programs``). ``stop``: a future that ends it early once
        done (``Programs.compile_all``).

        ``ready_early``: return once the light-load programs (the smallest bucket of each kind) are ready and
        compile the rest in the background; meanwhile ``limits()`` keeps the steps within the compiled buckets,
        so no step waits on a compile. The report then counts the first part; ``background`` the rest. Across
        processes every one must pick the same programs at every step, so there it compiles everything first."""
        ready_early = ready_early and jax.process_count() == 1
        buckets = self.warmup_buckets()
        first = [b for b in buckets if b.light] if ready_early else buckets
        rest = [b for b in buckets if not b.light] if ready_early else []
        p = self.programs
        before = (p.load_s, p.lower_s, p.compile_s, p.store.loaded if p.store else 0)
        wall = p.compile_all([program for b in first for program in b.programs], progress, stop)
        report = dict(programs=sum(len(b.programs) for b in first), compile_s=wall, load_s=p.load_s - before[0],
                      lower_s=p.lower_s - before[1], compile_sum_s=p.compile_s - before[2],
                      loaded=(p.store.loaded if p.store else 0) - before[3])
        if rest:
            self._pending_buckets = buckets
            p.compile_in_background([program for b in rest for program in b.programs], progress, stop,
                                    done=self._background_done)
            report["background"] = sum(len(b.programs) for b in rest)
        return report

    def _background_done(self):
        self._pending_buckets = None

    def limits(self) -> tuple[int, int] | None:
        """While a ready-early warm-up still compiles: the most decode rows and prefill tokens one step may take
        with every program it can pick compiled (the largest bucket whose smaller ones are all ready); None once
        everything is, or without such a warm-up."""
        buckets = self._pending_buckets
        if buckets is None:
            return None
        return (self._compiled_prefix(buckets, "decode") or self.decode_sizes[0],
                self._compiled_prefix(buckets, "prefill") or self.prefill_token_sizes[0])

    def _compiled_prefix(self, buckets: list[WarmupBucket], kind) -> int | None:
        """The largest size of ``kind`` whose buckets up to it are all compiled (None: not even the smallest);
        ``buckets`` in ``warmup_buckets``' order, each kind's sizes ascending."""
        largest = None
        for bucket in (b for b in buckets if b.kind == kind):
            if not all(program.key in self.programs.compiled for program in bucket.programs):
                break
            largest = bucket.size
        return largest

    def _compression_rows_ready(self, budget: int, width: int, most: int) -> int:
        """``most``, or less while a ready-early warm-up still compiles the larger row buckets of this shape."""
        buckets = self._pending_buckets
        if buckets is None or not any(b.kind == ("compress", budget, width) for b in buckets):
            return most
        return min(most, self._compiled_prefix(buckets, ("compress", budget, width)) or 1)

