"""The engine's compiled programs: one per (step function, static shape bucket), compiled ahead of their use.

Warm-up hands every bucket to ``compile_all``, which lowers them one by one (tracing holds the GIL) and
compiles them on a thread pool (XLA releases the GIL while it compiles), reporting progress as each finishes.
A bucket met later compiles on first use. Calling a ``jax.stages.Compiled`` costs the same as a jitted call.
"""

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Hashable

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
        self.compile_wall_s = 0.0  # wall time spent compiling, warm-up and first uses together
        self.call_s = 0.0  # wall time inside compiled calls: their dispatch, and any wait the runtime imposes there

    def compiled(self, key):
        return self._compiled[key]

    def keys(self) -> list:
        """The keys of the programs compiled so far."""
        return list(self._compiled)

    def run(self, program: Program, *args):
        """Call ``program`` on ``args`` (compiling it first if no warm-up did)."""
        compiled = self._compiled.get(program.key)
        if compiled is None:
            self.compile_all([program])
            compiled = self._compiled[program.key]
        start = time.perf_counter()
        out = compiled(*args)
        self.call_s += time.perf_counter() - start
        return out

    def compile_all(self, programs: list[Program], progress=None):
        """Compile the programs not compiled yet, in parallel, calling ``progress`` (default: the one given at
        construction) after each; returns the wall seconds it took."""
        progress = progress or self.progress
        todo = list({p.key: p for p in programs if p.key not in self._compiled}.values())
        if not todo:
            return 0.0
        start = time.perf_counter()
        lowered = [(p, p.jitted.lower(*jax.tree.map(_abstract, p.args), **p.static)) for p in todo]

        def compile_one(item):
            program, low = item
            t = time.perf_counter()
            return program, low.compile(compiler_options=program.options), time.perf_counter() - t

        with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
            futures = [pool.submit(compile_one, item) for item in lowered]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                program, compiled, seconds = future.result()
                self._compiled[program.key] = compiled
                progress(done, len(todo), program.name, seconds)
        wall = time.perf_counter() - start
        self.compile_wall_s += wall
        return wall


def _abstract(x):
    """Arrays become their shape, dtype and sharding (an array donated since may not be read)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
