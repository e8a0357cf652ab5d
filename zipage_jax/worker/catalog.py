"""Every program the worker runs, by (kind, shape bucket), and the one owner of start-up: which buckets exist, the
warm-up plan that compiles them (or loads them from the executable store), and, while a ready-early warm-up still
compiles in the background, the limits that keep every step inside the compiled buckets.

Buckets: decode at powers of two of rows up to ``max_num_seqs``; prefill at powers of two of tokens up to
``max_num_batched_tokens`` (one row count); compression at budget ``M`` by source width (the steady state ``M+1``,
then quadruplings) and powers of four of rows; swaps at powers of two of pages; one prompt-logprobs program;
structured-output mask writes at powers of four of rows.
"""

import dataclasses
import functools
import os
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from zipage_jax import parallel
from zipage_jax.config import EngineConfig
from zipage_jax.models.config import ModelConfig
from zipage_jax.worker import input_batch, packing, steps
from zipage_jax.worker.executable_store import ExecutableStore, engine_fingerprint
from zipage_jax.worker.kv_cache import MemoryPlan
from zipage_jax.worker.programs import Program, Programs

# Prompt positions scored per dispatch of the prompt-logprobs program: its [rows, vocab] f32 logits stay within
# the sampling scratch the memory plan reserves for a decode step.
PROMPT_LOGPROB_ROWS = 128


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
class WarmupBucket:
    """The programs of one shape bucket: ``kind`` ("decode", "prefill", ("compress", budget, width), ...) and
    ``size`` (rows, tokens or pages). A light load needs the smallest bucket of each kind (``light``)."""

    kind: Hashable
    size: int
    programs: list[Program]
    light: bool = False


@dataclasses.dataclass(frozen=True)
class CompressionShape:
    """One compression dispatch's bucket: budget ``M`` (destination pages a row), source ``width`` (pages) and
    ``rows``."""

    budget: int
    width: int
    rows: int

    @property
    def wide(self) -> bool:
        """Wider than the steady state's ``M + 1`` pages: a first compression of a long context."""
        return self.width > self.budget + 1


class ProgramCatalog:
    """The jitted functions bound to this engine's model, backend and mesh, and the programs of their buckets."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, plan: MemoryPlan, backend, mesh,
                 layout: input_batch.BatchLayout, progress=None):
        self.config, self.layout = config, layout
        self.pages_per_seq = plan.pages_per_seq
        self.max_compression_pages = plan.max_compression_pages
        self.replicated = parallel.replicated(mesh)  # where each step's packed integers go
        store = None
        if config.compilation_cache_dir:  # warm starts load the programs without tracing them
            store = ExecutableStore(os.path.join(config.compilation_cache_dir, "executables"),
                                    engine_fingerprint(config, model_cfg, backend.name, mesh), mesh.devices.flat)
        self.programs = Programs(progress, store)
        self.decode_sizes = bucket_sizes(min(8, config.max_num_seqs), config.max_num_seqs)
        self.prefill_token_sizes = bucket_sizes(min(max(16, config.max_num_batched_tokens // 16),
                                                    config.max_num_batched_tokens), config.max_num_batched_tokens)
        self.prefill_rows = config.max_num_prefill_seqs  # one row count: its arrays are small next to the tokens
        self.swap_page_sizes = bucket_sizes(1, self.pages_per_seq)
        self.prompt_logprob_rows = min(PROMPT_LOGPROB_ROWS, config.max_num_batched_tokens)
        self.hidden_shape = (config.max_num_batched_tokens, model_cfg.hidden_size)
        self._step = jax.jit(functools.partial(steps.step, model_cfg=model_cfg, backend=backend,
                                               store_queries=config.stores_window_queries,
                                               hidden_rows=config.max_num_batched_tokens,
                                               hidden_sharding=self.replicated),
                             static_argnames=("spec",), donate_argnames=("state",))
        self._prompt_logprobs = jax.jit(functools.partial(steps.prompt_logprobs, model_cfg=model_cfg))
        self._compress = jax.jit(functools.partial(steps.compress_step, cfg=config.scoring,
                                                   sm_scale=model_cfg.head_dim ** -0.5, backend=backend, mesh=mesh,
                                                   max_pages=plan.max_compression_pages),
                                 static_argnames=("spec",), donate_argnames=("state",))
        self._swapped = dict(history=config.tracks_history, queries=config.stores_window_queries)  # what a swap moves
        self._swap_gather = jax.jit(functools.partial(steps.swap_gather, **self._swapped))
        self._swap_scatter = jax.jit(functools.partial(steps.swap_scatter, **self._swapped),
                                     donate_argnames=("state",))
        self.bitmask_sizes = bucket_sizes(min(16, config.max_num_seqs), config.max_num_seqs, factor=4)
        self._set_token_bitmask = jax.jit(steps.set_token_bitmask, donate_argnames=("state",))
        self._pending: list[WarmupBucket] | None = None  # while a ready-early warm-up compiles (``limits``)

    def _packed(self, packed):
        return jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=self.replicated)

    # -- programs ------------------------------------------------------------------------------------------
    def step_program(self, inputs: dict, kind: str, bucket: int, params, state) -> tuple[Program, object]:
        """The step program for ``inputs`` padded to ``bucket`` (rows of a decode, tokens of a prefill), and its
        packed inputs."""
        packed, spec = packing.pack(inputs)
        sampling = inputs["sampling"]
        mode = "penalized" if sampling.penalized else "sampled" if sampling.sampled else "greedy"
        mode += ", biased" if sampling.biased else ""
        unit = "rows" if kind == "decode" else "tokens"
        program = Program(key=("step", spec), name=f"{kind} {bucket} {unit}, {mode}", jitted=self._step,
                          args=(params, state, self._packed(packed)), static=dict(spec=spec),
                          options=steps.compiler_options(bucket))
        return program, packed

    def prompt_program(self, params) -> Program:
        hidden = jax.ShapeDtypeStruct(self.hidden_shape, params.embed.dtype, sharding=self.replicated)
        index = jax.ShapeDtypeStruct((self.prompt_logprob_rows,), jnp.int32, sharding=self.replicated)
        return Program(key=("prompt_logprobs",), name=f"prompt logprobs {self.prompt_logprob_rows} rows",
                       jitted=self._prompt_logprobs, args=(params, hidden, index, index),
                       options=steps.compiler_options(self.prompt_logprob_rows))

    def compress_program(self, compressions, shape: CompressionShape, state) -> tuple[Program, object]:
        packed, spec = packing.pack(input_batch.compression_batch(compressions, shape.budget, shape.rows,
                                                                  shape.width))
        program = Program(key=("compress", spec), name=f"compress {shape.rows} rows x {shape.width} pages",
                          jitted=self._compress, args=(state, self._packed(packed)), static=dict(spec=spec),
                          options=steps.COMPILER_OPTIONS)
        return program, packed

    def swap_programs(self, size: int, state, contents: tuple | None = None) -> tuple[Program, Program]:
        """The gather (swap-out) and scatter (swap-in) of ``size`` pages; ``contents``: the host arrays the scatter
        writes (default: their shapes, as the gather makes them)."""
        index = (jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated),
                 jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated))
        gather = Program(("swap_out", size), f"swap out {size} pages", self._swap_gather, (state,) + index,
                         options=steps.COMPILER_OPTIONS)
        if contents is None:
            shapes = steps.swapped_shapes(state, size, **self._swapped)
        else:
            shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in contents)
        scatter = Program(("swap_in", size), f"swap in {size} pages", self._swap_scatter, (state,) + index + shapes,
                          options=steps.COMPILER_OPTIONS)
        return gather, scatter

    def bitmask_program(self, rows: int, state) -> Program:
        """The write of ``rows`` structured-output masks into the bitmask table."""
        table = state.token_bitmask
        index = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self.replicated)
        masks = jax.ShapeDtypeStruct((rows, table.shape[1]), jnp.int32, sharding=self.replicated)
        return Program(("token_bitmask", rows), f"structured-output masks {rows} rows", self._set_token_bitmask,
                       (state, index, masks), options=steps.COMPILER_OPTIONS)

    # -- buckets -------------------------------------------------------------------------------------------
    def compression_widths(self, budget: int) -> list[int]:
        """Source-table widths (pages) of compressions at budget M: the steady state M+1, then quadruplings up to
        a request's most pages (a last quadrupling within 2x of that merges into it). Wider, first compressions
        (long prompts) are rare and their kernels read only the live blocks, so coarse widths cost little at run
        time, and each width saved is a program less to trace and compile."""
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

    def compression_dispatches(self, compressions) -> list[tuple[CompressionShape, list]]:
        """The due compressions grouped by budget M and padded source width, in dispatches within
        ``max_compression_pages`` padded pages (the scratch reserved at start-up): the steady-state width ``M+1``
        batches rows in powers of four, wider (first) compressions go one by one."""
        groups = {}
        for c in compressions:
            budget = len(c.dst_pages)
            width = pick_bucket(self.compression_widths(budget), len(c.src_pages))
            groups.setdefault((budget, width), []).append(c)
        dispatches = []
        for (budget, width), group in groups.items():
            most = self.compression_rows(width) if width == budget + 1 else 1
            most = self._compression_rows_ready(budget, width, most)
            for start in range(0, len(group), most):
                part = group[start:start + most]
                dispatches.append((CompressionShape(budget, width, pick_bucket(bucket_sizes(1, most, 4), len(part))),
                                   part))
        return dispatches

    # -- start-up ------------------------------------------------------------------------------------------
    def warmup_buckets(self, params, state) -> list[WarmupBucket]:
        """Every program a workload without penalties can need, by bucket, the ones a light load needs first: the
        prompt-logprobs program, greedy and sampled decode per batch bucket, prefill per token bucket, the
        structured-output mask writes per row bucket, and with
        compression the steady-state compression at every row bucket, the wider first compressions of long prompts
        at one row, and the swaps of a steady-state request. Penalties (repetition, presence, frequency) widen the
        sampling history, a logit bias adds its entries, and a per-request ``kv_budget_pages`` other than the engine's changes the compression
        shapes: those compile on first use."""
        layout = self.layout
        buckets = [WarmupBucket("prompt_logprobs", 0, [self.prompt_program(params)])]
        for rows in self.decode_sizes:
            buckets.append(WarmupBucket("decode", rows, [
                self.step_program(input_batch.decode_inputs([], rows, layout, sampled), "decode", rows, params,
                                  state)[0] for sampled in (False, True)]))
        for num_tokens in self.prefill_token_sizes:
            inputs, _ = input_batch.prefill_inputs([], num_tokens, self.prefill_rows, layout)
            buckets.append(WarmupBucket("prefill", num_tokens,
                                        [self.step_program(inputs, "prefill", num_tokens, params, state)[0]]))
        for rows in self.bitmask_sizes:
            buckets.append(WarmupBucket("token_bitmask", rows, [self.bitmask_program(rows, state)]))
        shapes = self._warmup_compressions()
        for shape in shapes:
            buckets.append(WarmupBucket(("compress", shape.budget, shape.width), shape.rows,
                                        [self.compress_program([], shape, state)[0]]))
        if shapes:
            size = pick_bucket(self.swap_page_sizes, self.config.kv_budget_pages + 1)
            buckets.append(WarmupBucket("swap", size, list(self.swap_programs(size, state))))
        # a light load needs the smallest bucket of each kind (every compression width at one row); the rest
        # follow level by level (the second size of every kind, then the third, ...), so all kinds grow together
        sizes = {}
        for bucket in buckets:
            sizes.setdefault(bucket.kind, []).append(bucket.size)
        level = {id(b): sorted(sizes[b.kind]).index(b.size) for b in buckets}
        for bucket in buckets:
            bucket.light = level[id(bucket)] == 0
        return sorted(buckets, key=lambda b: level[id(b)])

    def _warmup_compressions(self) -> list[CompressionShape]:
        budget = self.config.kv_budget_pages
        if not self.config.compression or budget + 1 > self.pages_per_seq:
            return []
        shapes = []
        for width in self.compression_widths(budget):
            sizes = bucket_sizes(1, self.compression_rows(width), 4) if width == budget + 1 else [1]
            shapes.extend(CompressionShape(budget, width, rows) for rows in sizes)
        return shapes

    def warmup(self, params, state, progress=None, stop=None, ready_early: bool = False) -> dict:
        """Compile (or load from the executable store) every warm-up program, in parallel; returns their number,
        the wall seconds it took and where they went (see ``Programs``). ``stop``: a future that ends it early once
        done (``Programs.compile_all``).

        ``ready_early``: return once the light-load programs (the smallest bucket of each kind) are ready and
        compile the rest in the background; meanwhile ``limits()`` keeps the steps within the compiled buckets,
        so no step waits on a compile. The report then counts the first part; ``background`` the rest. Across
        processes every one must pick the same programs at every step, so there it compiles everything first."""
        ready_early = ready_early and jax.process_count() == 1
        buckets = self.warmup_buckets(params, state)
        first = [b for b in buckets if b.light] if ready_early else buckets
        rest = [b for b in buckets if not b.light] if ready_early else []
        p = self.programs
        before = (p.load_s, p.lower_s, p.compile_s, p.store.loaded if p.store else 0)
        wall = p.compile_all([program for b in first for program in b.programs], progress, stop)
        report = dict(programs=sum(len(b.programs) for b in first), compile_s=wall, load_s=p.load_s - before[0],
                      lower_s=p.lower_s - before[1], compile_sum_s=p.compile_s - before[2],
                      loaded=(p.store.loaded if p.store else 0) - before[3])
        if rest:
            self._pending = buckets
            p.compile_in_background([program for b in rest for program in b.programs], progress, stop,
                                    done=self._background_done)
            report["background"] = sum(len(b.programs) for b in rest)
        return report

    def _background_done(self):
        self._pending = None

    def limits(self) -> tuple[int, int] | None:
        """While a ready-early warm-up still compiles: the most decode rows and prefill tokens one step may take
        with every program it can pick compiled (the largest bucket whose smaller ones are all ready); None once
        everything is, or without such a warm-up."""
        buckets = self._pending
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
        buckets = self._pending
        if buckets is None or not any(b.kind == ("compress", budget, width) for b in buckets):
            return most
        return min(most, self._compiled_prefix(buckets, ("compress", budget, width)) or 1)
