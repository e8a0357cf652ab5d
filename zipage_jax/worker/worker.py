"""The device side of the engine: brings the device up (dtype, mesh, kernels, memory plan, the donated state, the
weights), then runs each scheduler output as jitted programs (``catalog``) over inputs packed on the host
(``input_batch``), never waiting for them: sampled tokens, their logprobs and prompt logprobs come back as handles
the engine reads one step later.

``execute`` runs one scheduler output in the order that makes it correct on one device stream: swap-outs copy
released pages to the host before anything reuses them, then compression (the host waits for it in synchronous
mode only), so that the pages it reads and releases are written by nothing before it, then swap-ins, decode (the
compressed requests among its rows), prefill.
Observers see each compression dispatch (``add_compression_observer``: a benchmark times or traces them) and each
step dispatch (``add_step_observer``); the default path has none and never syncs with the device.
"""

import dataclasses
import logging
import time
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zipage_jax import parallel
from zipage_jax.compression import query_centres
from zipage_jax.config import EngineConfig
from zipage_jax.core.scheduler_output import SchedulerOutput
from zipage_jax.layers.attention import resolve_backend, sharded
from zipage_jax.models import weights
from zipage_jax.models.config import ModelConfig
from zipage_jax.worker import device_memory, device_state, input_batch, kv_cache, kv_scales
from zipage_jax.worker.catalog import CompressionShape, ProgramCatalog, pick_bucket
from zipage_jax.structured_output.manager import TokenBitmask
from zipage_jax.worker.programs import Programs
from zipage_jax.worker.device_state import DeviceState
from zipage_jax.worker.handles import ExecuteResult, PromptLogprobs, StepHandle

log = logging.getLogger(__name__)


def resolve_dtype(name: str, model_cfg: ModelConfig):
    if name == "auto":
        name = model_cfg.dtype if model_cfg.dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """The worker's counters, for the engine's metrics."""

    compile_s: float  # wall seconds compiling programs, warm-up and first uses together
    compiled_on_use: int  # programs a step had to compile first (warm-up missed their bucket)
    compiling_in_background: bool
    compression_dispatches: int
    compression_s: float | None  # device seconds compressing, where measured (see ``compress``), else None
    wide_compression_s: float  # of which first compressions wider than M + 1 pages (long prompts, aged starts)
    kv_cache_dtype: str = "auto"  # the pool pages' dtype (``float8_e4m3fn`` with FP8 pages)


@dataclasses.dataclass(frozen=True)
class CompressionDispatch:
    """One compression dispatch, as an observer sees it: its bucket and requests, and the device state (before
    ``run()``: the input; after: the output)."""

    shape: CompressionShape
    compressions: list
    state: Callable[[], DeviceState]


@dataclasses.dataclass(frozen=True)
class StepDispatch:
    """One dispatched step, as an observer sees it: its host inputs (``input_batch``), the request of each row, its
    bucket and the key of the program that ran it (``programs.compiled[key]``)."""

    kind: str
    inputs: dict
    requests: list
    bucket: int
    program_key: object


@typing.runtime_checkable
class Executor(typing.Protocol):
    """What the engine needs of the device side; ``Worker`` is the real one, the scheduler's property tests bring a
    fake device."""

    plan: kv_cache.MemoryPlan
    programs: Programs  # its compiled programs (compile seconds for the metrics; background compiles)

    def execute(self, scheduled: SchedulerOutput) -> ExecuteResult:
        """Dispatch one scheduler output (in the order of ``Worker.execute``)."""

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile every program a workload can need now; ``{"programs": count, "compile_s": wall seconds}``."""

    def limits(self) -> tuple[int, int] | None:
        """The most decode rows and prefill tokens a step may take now (while programs compile in the background),
        or None: no limit beyond the configuration's."""

    def stats(self) -> WorkerStats:
        """The counters the engine's metrics read."""

    def set_eos_token_ids(self, eos_token_ids: tuple[int, ...]):
        """The end-of-sequence ids sampling bans below ``min_tokens``."""


class Worker:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, plan: kv_cache.MemoryPlan, params,
                 backend, mesh, state: DeviceState, eos_token_ids=(), progress=None):
        self.config, self.model_cfg, self.plan = config, model_cfg, plan
        self.params, self.state, self.mesh = params, state, mesh
        self.layout = input_batch.BatchLayout(
            page_size=config.page_size, pages_per_seq=plan.pages_per_seq, sink_row=config.max_num_seqs,
            query_sink=plan.num_query_rows, window=config.scoring.window, vocab_size=model_cfg.vocab_size,
            eos_token_ids=tuple(eos_token_ids))
        self.catalog = ProgramCatalog(config, model_cfg, plan, backend, mesh, self.layout, progress)
        self.programs = self.catalog.programs
        self.replicated = self.catalog.replicated
        self.allocator = None  # jax's allocator and its share of the card, when ``create`` started the backend
        self.compression_observers: list = []
        self.step_observers: list = []
        self._compression_dispatches = 0
        # device seconds of compression, where measured (synchronous mode, or an observer that syncs to time them)
        self._compression_s = None if config.compression and config.async_compression else 0.0
        self._wide_compression_s = 0.0  # of which first compressions wider than M + 1 pages (long contexts)

    @classmethod
    def create(cls, config: EngineConfig, model_cfg: ModelConfig, *, params=None, model_path: str | None = None,
               eos_token_ids=(), progress=None, startup_s: dict | None = None) -> "Worker":
        """Bring the device up: jax's backend (its allocator's share of each card set first; several processes
        joined before any device query), the mesh, the attention backend, the memory plan, the donated state and
        the weights (``params``: ``Params`` or ``ServingParams``, a function of no arguments that makes them, or
        None: the checkpoint at ``model_path``). ``startup_s`` receives the seconds of each phase."""
        startup_s = {} if startup_s is None else startup_s
        centres = None  # the "triattention" policy's calibration, shipped with the model: a missing one fails first
        if config.compression and config.scoring.eviction_policy == "triattention":
            centres = query_centres.load(model_path or config.model, model_cfg)
        mark = time.perf_counter()
        with device_memory.start_backend(config.gpu_memory_utilization) as allocator:
            parallel.join_processes(config)  # before any device query: the backend starts at the block's end
        jax.devices()  # the backend's start (CUDA, the client), timed apart
        startup_s["backend"] = time.perf_counter() - mark
        max_model_len = config.context_length(model_cfg.max_position_embeddings)
        dtype = resolve_dtype(config.dtype, model_cfg)
        mesh = parallel.make_mesh(config.tensor_parallel_size, model_cfg)
        backend = resolve_backend(config.attention_backend)
        if config.tensor_parallel_size > 1:
            backend = sharded(backend, mesh)
        device = jax.local_devices()[0]

        def plan(weights_bytes):
            return kv_cache.plan_memory(config, model_cfg, dtype, max_model_len, backend, allocator=allocator,
                                        weights_bytes=weights_bytes)

        state, memory_plan = None, None
        start = time.perf_counter()
        if params is None or callable(params):
            # The pool first, while the allocator is empty: its two largest blocks then cannot meet memory that the
            # weight load fragmented.
            memory_plan = plan(weights.device_bytes(model_cfg, dtype, mesh, device))
            state = device_state.allocate(config, model_cfg, memory_plan.num_pages, memory_plan.num_query_rows,
                                          dtype, mesh)
            jax.block_until_ready(state)
            startup_s["plan_and_pool"] = time.perf_counter() - start
            start = time.perf_counter()
            if params is None:
                params = weights.load_sharded(model_path, model_cfg, dtype, mesh)  # each device its shards
            else:
                params = weights.shard_params(params(), mesh)
        else:
            params = weights.shard_params(params, mesh)
        jax.block_until_ready(params)
        startup_s["weights"] = time.perf_counter() - start  # read, copied to the devices, converted there
        if state is None:
            memory_plan = plan(device_memory.bytes_on(device, params))
            state = device_state.allocate(config, model_cfg, memory_plan.num_pages, memory_plan.num_query_rows,
                                          dtype, mesh)
        if centres is not None:
            state = device_state.place_centres(state, centres, mesh)
        if memory_plan.kv_dtype != dtype:  # FP8 pages: their scales from the loaded weights
            start = time.perf_counter()
            state = state.replace(kv_scales=kv_scales.calibrate(params, model_cfg, memory_plan.kv_dtype, mesh))
            startup_s["kv_scales"] = time.perf_counter() - start
            if device.platform == "cpu":
                log.warning("kv_cache_dtype: FP8 pages run ~30x slower than 16-bit ones on the CPU (XLA's CPU "
                            "scatter into a float8 pool rewrites the whole pool at every KV write); they are meant "
                            "for GPUs")
        start = time.perf_counter()
        worker = cls(config, model_cfg, memory_plan, params, backend, mesh, state, eos_token_ids, progress)
        worker.allocator = allocator
        startup_s["runner"] = time.perf_counter() - start
        log.info("memory plan: %s", memory_plan.describe())
        return worker

    @property
    def dtype(self):
        return self.params.embed.dtype

    def set_eos_token_ids(self, eos_token_ids: tuple[int, ...]):
        """The end-of-sequence ids ``min_tokens`` bans (the tokenizer's joins the model's once it has loaded)."""
        self.layout = dataclasses.replace(self.layout, eos_token_ids=tuple(eos_token_ids))
        self.catalog.layout = self.layout

    def stats(self) -> WorkerStats:
        p = self.programs
        return WorkerStats(compile_s=p.compile_wall_s, compiled_on_use=p.compiled_on_use,
                           compiling_in_background=self.limits() is not None,
                           compression_dispatches=self._compression_dispatches, compression_s=self._compression_s,
                           wide_compression_s=self._wide_compression_s,
                           kv_cache_dtype=np.dtype(self.plan.kv_dtype).name)

    # -- one scheduler output ------------------------------------------------------------------------------
    def execute(self, scheduled: SchedulerOutput) -> ExecuteResult:
        """Dispatch everything ``scheduled`` asks for (see the module docstring)."""
        result = ExecuteResult()
        for swap in scheduled.swap_outs:  # read before anything of this step writes their pages
            result.swapped_out[swap.request.request_id] = self.swap_out(swap.pages, swap.query_row)
        if scheduled.compressions:  # before every other write: the pages they release are reused in this step
            self.compress(scheduled.compressions, wait=not self.config.async_compression)
        for swap in scheduled.swap_ins:
            self.swap_in(swap.request.page_ids, swap.request.query_row, swap.contents)
        if scheduled.token_bitmask is not None:
            self.set_token_bitmask(scheduled.token_bitmask)
        if scheduled.decodes:
            result.handles.append(self.decode(scheduled.decodes))
        if scheduled.prefills:
            result.handles.append(self.prefill(scheduled.prefills))
        return result

    # -- steps ---------------------------------------------------------------------------------------------
    def dispatch_step(self, kind: str, inputs: dict, requests: list, num_tokens: int,
                      bucket: int) -> tuple[StepHandle, jax.Array | None]:
        """Run the step on ``inputs`` (``num_tokens`` real tokens, padded to ``bucket``) and start copying its
        results to the host; returns its handle and, for a prefill, its tokens' hidden states (on the device)."""
        program, packed = self.catalog.step_program(inputs, kind, bucket, self.params, self.state)
        self.state, ids, values, *hidden = self.programs.run(program, self.params, self.state,
                                                             jax.device_put(packed, self.replicated))
        ids.copy_to_host_async()
        values.copy_to_host_async()
        for observer in self.step_observers:
            observer(StepDispatch(kind, inputs, requests, bucket, program.key))
        return StepHandle(requests, ids, values, kind, num_tokens), (hidden[0] if hidden else None)

    def decode(self, requests) -> StepHandle:
        """One token per request: the one at index ``num_computed_tokens - 1`` (already counted by the scheduler)."""
        rows = pick_bucket(self.catalog.decode_sizes, len(requests))
        inputs = input_batch.decode_inputs(requests, rows, self.layout)
        return self.dispatch_step("decode", inputs, list(requests), len(requests), rows)[0]

    def prefill(self, chunks) -> StepHandle:
        """Packed prompt chunks; rows whose chunk reaches the last known token sample the next one."""
        total = sum(c.num_tokens for c in chunks)
        num_tokens = pick_bucket(self.catalog.prefill_token_sizes, total)
        inputs, sampled = input_batch.prefill_inputs(chunks, num_tokens, self.catalog.prefill_rows, self.layout)
        handle, hidden = self.dispatch_step("prefill", inputs, sampled, total, num_tokens)
        handle.prompt_logprobs = self._score_prompts(chunks, hidden)
        return handle

    def _score_prompts(self, chunks, hidden) -> list[PromptLogprobs]:
        """Dispatch the prompt logprobs of the chunks whose requests ask for them."""
        parts = []
        for part in input_batch.prompt_logprob_rows(chunks, self.catalog.prompt_logprob_rows):
            row_index, target = jax.device_put((part.index[0], part.index[1]), self.replicated)
            ids, values = self.programs.run(self.catalog.prompt_program(self.params), self.params, hidden,
                                            row_index, target)
            ids.copy_to_host_async()
            values.copy_to_host_async()
            parts.append(PromptLogprobs(part.requests, part.positions, ids, values))
        return parts

    def set_token_bitmask(self, bitmask: TokenBitmask):
        """Write a step's structured-output masks into the device table, padded to a row bucket with all-ones rows
        at the sink row."""
        size = pick_bucket(self.catalog.bitmask_sizes, len(bitmask.rows))
        rows = np.full(size, self.layout.sink_row, np.int32)
        masks = np.full((size, bitmask.masks.shape[1]), -1, np.int32)
        rows[:len(bitmask.rows)], masks[:len(bitmask.rows)] = bitmask.rows, bitmask.masks
        self.state = self.programs.run(self.catalog.bitmask_program(size, self.state), self.state,
                                       *jax.device_put((rows, masks), self.replicated))

    # -- compression ---------------------------------------------------------------------------------------
    def add_compression_observer(self, observer):
        """``observer(dispatch: CompressionDispatch, run) -> seconds | None`` is called for each compression
        dispatch and must call ``run()`` once; the device seconds it returns, if any (a benchmark's timer syncs
        with the device to measure them), count in ``stats().compression_s``."""
        self.compression_observers.append(observer)

    def compress(self, compressions, wait: bool = False):
        """Dispatch the compaction of the due requests (``catalog.compression_dispatches``); ``wait``: block until
        each is done (synchronous mode) and count its device time."""
        for shape, part in self.catalog.compression_dispatches(compressions):
            program, packed = self.catalog.compress_program(part, shape, self.state)
            self.programs.prepare(program)  # a first-use compile is start-up, before any observer's clock

            def run(program=program, packed=packed):
                self.state = self.programs.run(program, self.state, jax.device_put(packed, self.replicated))

            observers = self.compression_observers + ([_time_waited] if wait else [])
            seconds = _observe(observers, CompressionDispatch(shape, part, lambda: self.state), run)
            if seconds is not None:
                self._compression_s = (self._compression_s or 0.0) + seconds
                if shape.wide:
                    self._wide_compression_s += seconds
            self._compression_dispatches += 1

    # -- swapping ------------------------------------------------------------------------------------------
    def _swap_index(self, pages, query_row: int):
        return jax.device_put((pages, np.int32(query_row)), self.replicated)

    def swap_out(self, pages: list[int], query_row: int) -> tuple:
        """Host copies of the pages' K/V (and scores) and of the query-cache row, ordered after every step
        dispatched so far; the host waits for them (swaps are rare), so the pages can be reused right away.
        Across processes every one gathers the whole copy (its heads live on other hosts' devices too)."""
        padded = input_batch.padded_pages(pages, pick_bucket(self.catalog.swap_page_sizes, len(pages)))
        gather, _ = self.catalog.swap_programs(len(padded), self.state)
        arrays = self.programs.run(gather, self.state, *self._swap_index(padded, query_row))
        k, v, scores, queries = multihost_utils.process_allgather(arrays, tiled=True)
        n = len(pages)
        return k[:, :n], v[:, :n], scores[:, :n] if scores.ndim else scores, queries

    def swap_in(self, pages: list[int], query_row: int, contents: tuple):
        """Write swapped-out contents into the request's new pages and query row (padding goes to the null page)."""
        size = pick_bucket(self.catalog.swap_page_sizes, len(pages))
        contents = input_batch.padded_swap(contents, size)
        _, scatter = self.catalog.swap_programs(size, self.state, contents)
        self.state = self.programs.run(scatter, self.state,
                                       *self._swap_index(input_batch.padded_pages(pages, size), query_row), *contents)

    # -- start-up ------------------------------------------------------------------------------------------
    def add_step_observer(self, observer):
        """``observer(dispatch: StepDispatch)`` after each decode or prefill dispatch (a benchmark replays one)."""
        self.step_observers.append(observer)

    def warmup(self, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile every program a workload can need (``ProgramCatalog.warmup``)."""
        return self.catalog.warmup(self.params, self.state, progress, stop, ready_early)

    def limits(self) -> tuple[int, int] | None:
        return self.catalog.limits()


def _observe(observers: list, dispatch: CompressionDispatch, run) -> float | None:
    """Run ``dispatch`` through the observers, each wrapping the next; the seconds the innermost one that measured
    returns."""
    measured = []

    def call(i: int):
        if i == len(observers):
            return run()
        seconds = observers[i](dispatch, lambda: call(i + 1))
        if seconds is not None:
            measured.append(seconds)

    call(0)
    return measured[0] if measured else None


def _time_waited(dispatch: CompressionDispatch, run) -> float:
    """Device seconds of a compression the host waits for anyway (synchronous mode)."""
    jax.block_until_ready(dispatch.state().k_pool)
    start = time.perf_counter()
    run()
    jax.block_until_ready(dispatch.state().k_pool)
    return time.perf_counter() - start
