"""The engine's compiled programs: one per (step function, static shape bucket), compiled ahead of their use.

Warm-up hands every bucket to ``compile_all``, which first loads what the executable store keeps (no tracing, on a
thread pool),
then lowers the rest one by one (tracing holds the GIL), each compile starting on a thread pool as soon as its
program is lowered (XLA releases the GIL while it compiles), reporting progress as each finishes, and keeps them
in the store. A bucket met later compiles on first use. Calling a ``jax.stages.Compiled`` costs the same as a
jitted call.

``compile_in_background`` does the same on a thread of its own, leaving one core to the engine loop, so that a
server can answer while the programs a heavier load needs still compile (``ProgramCatalog.warmup(ready_early=True)``).
"""

import atexit
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Hashable, Mapping

import jax
from jax import monitoring

log = logging.getLogger(__name__)


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
    def __init__(self, progress: Callable[[int, int, str, float], None] | None = None, store=None):
        self.progress = progress or (lambda done, total, name, seconds: None)  # after each compile
        self.store = store  # an ExecutableStore, or None
        self._compiled: dict = {}
        self._left_running: set[concurrent.futures.Future] = set()  # compiles a stopped compile_all left behind
        # Executables loaded from the store must be released before the runtime shuts down: freed during
        # interpreter teardown, jaxlib's CPU client sometimes aborts the process ("terminate called without an
        # active exception") after a run that succeeded.
        atexit.register(_release, weakref.ref(self))
        self.compile_wall_s = 0.0  # wall time spent compiling, warm-up and first uses together
        # where that time went: loading stored executables, tracing and lowering (serial, holds the GIL), and
        # compiling (summed over the parallel compiles, so it may exceed the wall time)
        self.load_s = self.lower_s = self.compile_s = 0.0
        self.call_s = 0.0  # wall time inside compiled calls: their dispatch, and any wait the runtime imposes there
        self.compiled_on_use = 0  # programs a call had to compile first (a step waited on them)
        self._background: threading.Thread | None = None

    @property
    def compiling_unused(self) -> bool:
        """Whether compiles a stopped ``compile_all`` left behind still run (a process exiting now would wait for
        them: XLA cannot interrupt a compile)."""
        return self.compiling_in_background or any(not future.done() for future in self._left_running)

    @property
    def compiling_in_background(self) -> bool:
        """Whether a ``compile_in_background`` is still at work."""
        return self._background is not None and self._background.is_alive()

    @property
    def compiled(self) -> Mapping[Hashable, jax.stages.Compiled]:
        """The programs compiled so far, by key (read-only: what a benchmark or test inspects)."""
        return types.MappingProxyType(self._compiled)

    def prepare(self, program: Program) -> jax.stages.Compiled:
        """``program`` compiled: by warm-up, or now (a step then waits on it: ``compiled_on_use``)."""
        compiled = self._compiled.get(program.key)
        if compiled is None:
            self.compile_all([program])
            compiled = self._compiled[program.key]
            self.compiled_on_use += 1
        return compiled

    def run(self, program: Program, *args):
        """Call ``program`` on ``args`` (compiling it first if no warm-up did)."""
        compiled = self.prepare(program)
        start = time.perf_counter()
        out = compiled(*args)
        self.call_s += time.perf_counter() - start
        return out

    def compile_all(self, programs: list[Program], progress=None, stop: concurrent.futures.Future | None = None):
        """Compile the programs not compiled yet (those the store keeps are loaded instead), in parallel, calling
        ``progress`` (default: the one given at construction) after each compile; returns the wall seconds it took.

        ``stop``, once done, ends the compiling at once (``CompileStopped``): the programs not started are dropped
        and those compiling finish in the background, unused (XLA cannot be interrupted); all compile on first
        use. The server stops its warm-up so when it is asked to shut down."""
        start = time.perf_counter()
        try:
            return self._compile_all(programs, progress, stop, os.cpu_count() or 1)
        finally:
            self.compile_wall_s += time.perf_counter() - start

    def compile_in_background(self, programs: list[Program], progress=None,
                              stop: concurrent.futures.Future | None = None, done: Callable[[], None] | None = None):
        """``compile_all`` on a thread of its own, one core short of the machine (the engine loop keeps one), in
        the order given; ``done()`` is called after. Its seconds are not ``compile_wall_s``: no step waits on
        them. The arguments are made abstract first: the arrays among them may be donated before they lower."""
        programs = [dataclasses.replace(p, args=jax.tree.map(_abstract, p.args)) for p in programs]
        workers = max(1, (os.cpu_count() or 1) - 1)

        def work():
            try:
                self._compile_all(programs, progress, stop, workers)
            except CompileStopped as stopped:
                log.info("background compiling stopped (%s)", stopped)
            except Exception:  # a program left out compiles on first use; serving goes on
                log.exception("background compiling failed")
            finally:
                if done is not None:
                    done()

        self._background = threading.Thread(target=work, name="compile-background", daemon=True)
        self._background.start()

    def join_background(self):
        """Wait until a ``compile_in_background`` has finished (benchmarks and tests; a server never waits)."""
        if self._background is not None:
            self._background.join()

    def _compile_all(self, programs: list[Program], progress, stop, workers: int) -> float:
        progress = progress or self.progress
        todo = list({p.key: p for p in programs if p.key not in self._compiled}.values())
        if not todo:
            return 0.0
        start = time.perf_counter()
        if self.store is not None:  # in parallel: each load reads a file and loads its executable's kernels
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(todo), workers))) as loader:
                for program, compiled in zip(todo, loader.map(self.store.load, todo)):
                    if compiled is not None:
                        self._compiled[program.key] = compiled
            todo = [p for p in todo if p.key not in self._compiled]
            self.load_s += time.perf_counter() - start
        stopping = {stop} if stop is not None else set()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, min(len(todo), workers)))
        waiting, stopped, finished = set(), False, 0

        def collect(done):
            nonlocal finished
            for future in done & waiting:
                waiting.discard(future)
                program, compiled, seconds, from_jax_cache = future.result()
                self._compiled[program.key] = compiled
                self.compile_s += seconds
                if self.store is not None and not from_jax_cache:
                    self.store.save(program, compiled)
                finished += 1
                progress(finished, len(todo), program.name, seconds)

        def check_stop():
            nonlocal stopped
            if stop is not None and stop.done() and (waiting or len(submitted) < len(todo)):
                stopped = True
                self._left_running.update(waiting)
                raise CompileStopped(f"stopped with {len(todo) - finished} of {len(todo)} programs not compiled")

        submitted = []
        try:
            for program in todo:  # each compile starts as soon as its program is lowered
                check_stop()
                t = time.perf_counter()
                low = program.jitted.lower(*jax.tree.map(_abstract, program.args), **program.static)
                self.lower_s += time.perf_counter() - t
                waiting.add(pool.submit(_compile, program, low))
                submitted.append(program)
                collect({f for f in waiting if f.done()})
            while waiting:
                done, _ = concurrent.futures.wait(waiting | stopping, return_when=concurrent.futures.FIRST_COMPLETED)
                collect(done)
                check_stop()
        finally:
            pool.shutdown(wait=not stopped, cancel_futures=stopped)
        return time.perf_counter() - start


class CompileStopped(Exception):
    """``compile_all`` was asked to stop; what it did not compile compiles on first use."""


def _compile(program: Program, lowered):
    """Compile on a pool thread: (program, executable, seconds, whether jax's persistent cache supplied it)."""
    t = time.perf_counter()
    _JAX_CACHE_HIT.value = False
    compiled = lowered.compile(compiler_options=program.options)
    return program, compiled, time.perf_counter() - t, _JAX_CACHE_HIT.value


# An executable that jax's own persistent cache handed back does not survive a second serialization (on the CPU
# its kernels are missing in the next process), so the store keeps only real compiles; the engine leaves jax's
# cache off while the store is on, and this catches a cache a user turned on.
_JAX_CACHE_HIT = threading.local()


def _note_cache_hit(event: str, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _JAX_CACHE_HIT.value = True


monitoring.register_event_listener(_note_cache_hit)


def _release(programs_ref):
    programs = programs_ref()
    if programs is not None:
        programs._compiled.clear()


def _abstract(x):
    """Arrays become their shape, dtype and sharding (an array donated since may not be read)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
