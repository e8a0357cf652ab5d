"""The engine's compiled programs: one per (step function, static shape bucket), compiled ahead of their use.

Warm-up hands every bucket to ``compile_all``, which lowers them one by one (tracing holds the GIL) and
compiles them on a thread pool (XLA releases the GIL while it compiles), reporting progress as each finishes.
A bucket met later compiles on first use. Calling a ``jax.stages.Compiled`` costs the same as a jitted call.
"""

import concurrent.futures
import dataclasses
import os
import time
import types
from collections.abc import Callable, Hashable, Mapping

import jax


@dataclasses.dataclass
class Program:
    """A jitted function bound to its static arguments, and the arguments to lower it with (arrays or
    ``jax.ShapeDtypeStruct``s of the shapes it will be called with)."""

    key: Hashable
    name: str  # for progress messages
    jitted: Callable
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)
    options: dict | None = None  # XLA compiler options


class Programs:
    def __init__(self, progress: Callable[[int, int, str, float], None] | None = None):
        self.progress = progress or (lambda done, total, name, seconds: None)  # after each compile
        self._compiled: dict = {}
        self._left_running: set[concurrent.futures.Future] = set()  # compiles a stopped compile_all left behind
        self.compile_wall_s = 0.0  # wall time spent compiling, warm-up and first uses together

    @property
    def compiling_unused(self) -> bool:
        """Whether compiles a stopped ``compile_all`` left behind still run (a process exiting now would wait for
        them: XLA cannot interrupt a compile)."""
        return any(not future.done() for future in self._left_running)

    @property
    def compiled(self) -> Mapping[Hashable, jax.stages.Compiled]:
        """The programs compiled so far, by key (read-only: what a benchmark or test inspects)."""
        return types.MappingProxyType(self._compiled)

    def run(self, program: Program, *args):
        """Call ``program`` on ``args`` (compiling it first if no warm-up did)."""
        compiled = self._compiled.get(program.key)
        if compiled is None:
            self.compile_all([program])
            compiled = self._compiled[program.key]
        return compiled(*args)

    def compile_all(self, programs: list[Program], progress=None, stop: concurrent.futures.Future | None = None):
        """Compile the programs not compiled yet, in parallel, calling ``progress`` (default: the one given at
        construction) after each; returns the wall seconds it took.

        ``stop``, once done, ends the compiling at once (``CompileStopped``): the programs not started are dropped
        and those compiling finish in the background, unused (XLA cannot be interrupted); all compile on first
        use. The server stops its warm-up so when it is asked to shut down."""
        progress = progress or self.progress
        todo = list({p.key: p for p in programs if p.key not in self._compiled}.values())
        if not todo:
            return 0.0
        start = time.perf_counter()
        stopping = {stop} if stop is not None else set()
        lowered = []
        for program in todo:  # tracing holds the GIL: one at a time
            if stop is not None and stop.done():
                raise CompileStopped(f"stopped before compiling {len(todo)} programs")
            lowered.append((program, program.jitted.lower(*jax.tree.map(_abstract, program.args), **program.static)))

        def compile_one(item):
            program, low = item
            t = time.perf_counter()
            return program, low.compile(compiler_options=program.options), time.perf_counter() - t

        pool = concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1))
        waiting, stopped = {pool.submit(compile_one, item) for item in lowered}, False
        try:
            while waiting:
                done, _ = concurrent.futures.wait(waiting | stopping, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done & waiting:
                    waiting.discard(future)
                    program, compiled, seconds = future.result()
                    self._compiled[program.key] = compiled
                    progress(len(todo) - len(waiting), len(todo), program.name, seconds)
                if waiting and stop is not None and stop.done():
                    stopped = True
                    self._left_running.update(waiting)
                    raise CompileStopped(f"stopped with {len(waiting)} of {len(todo)} programs not compiled")
        finally:
            pool.shutdown(wait=not stopped, cancel_futures=stopped)
            self.compile_wall_s += time.perf_counter() - start
        return time.perf_counter() - start


class CompileStopped(Exception):
    """``compile_all`` was asked to stop; what it did not compile compiles on first use."""


def _abstract(x):
    """Arrays become their shape, dtype and sharding (an array donated since may not be read)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
