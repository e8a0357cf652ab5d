"""Where the engine loop (``engine_core.EngineCore``) runs, as the server's `AsyncEngine` sees it: a thread of this
process (``ThreadCore``: an `LLMEngine` built here, as tests and notebooks hold one) or a process of its own
(``ProcessCore``, what ``python -m zipage_jax.serve`` starts: the loop and the HTTP server then each have a GIL).

Both offer ``start(on_event)`` (``on_event`` is called on a background thread, once per ``messages`` event),
``send(command)``, ``join(timeout)``, ``alive``, and what the HTTP layer reads of an engine: ``info``
(``messages.EngineInfo``) and ``tokenizer``.
"""

import concurrent.futures
import contextlib
import importlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading

from zipage_jax.engine.engine_core import EngineCore
from zipage_jax.engine.messages import Built, Command, EngineInfo, Exited, LaunchError, Stop
from zipage_jax.engine.tokenizer_store import load_serving_tokenizer

log = logging.getLogger(__name__)

LOOP_THREAD = "engine-loop"


class ThreadCore:
    """The loop on a thread of this process, over an engine built here."""

    def __init__(self, engine, warmup: bool = False, ready_early: bool = False):
        self.engine, self.warmup, self.ready_early = engine, warmup, ready_early
        self.info = engine_info(engine)
        self.tokenizer = engine.get_tokenizer()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop_warmup = concurrent.futures.Future()
        self._thread: threading.Thread | None = None

    def start(self, on_event):
        core = EngineCore(self.engine, on_event, self._commands, self._stop_warmup, self.warmup, self.ready_early)
        self._thread = threading.Thread(target=core.run, name=LOOP_THREAD, daemon=True)
        self._thread.start()

    def send(self, command: Command):
        if isinstance(command, Stop) and not self._stop_warmup.done():
            self._stop_warmup.set_result(None)
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None):
        if self._thread is not None:
            self._thread.join(timeout)


class ProcessCore:
    """The loop in a child process that builds the engine itself (``spawn``: a fresh interpreter, so jax's
    backend starts there and only there). ``launch`` returns once the engine is built, or raises what building
    it raised (``ValueError`` for what only the model and the device tell: the memory plan, the context)."""

    def __init__(self, process, commands, events, info: EngineInfo):
        self._process, self._commands_conn, self._events_conn = process, commands, events
        self.info = info
        self.tokenizer = None
        if info.tokenizer_path is not None:  # the engine's process stored its tokenizer's pipeline, if it could
            self.tokenizer = load_serving_tokenizer(info.tokenizer_path, info.config.compilation_cache_dir)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    @classmethod
    def launch(cls, model: str, options: dict, warmup: bool, log_level: str = "INFO",
               ready_early: bool = False) -> "ProcessCore":
        context = multiprocessing.get_context("spawn")
        commands_read, commands_write = context.Pipe(duplex=False)
        events_read, events_write = context.Pipe(duplex=False)
        process = context.Process(target=_child_main, name="engine-core", daemon=True,
                                  args=(commands_read, events_write, model, options, warmup, log_level,
                                        ready_early))
        with _sigint_blocked():  # the child inherits the block from its first instruction: Ctrl-C is the server's
            process.start()
        # transformers' import (a second of a warm start) overlaps the engine's build; the tokenizer loads once it is
        # over (a `from transformers import ...` that meets the import half done raises ImportError)
        importing = threading.Thread(target=importlib.import_module, args=("transformers",), daemon=True)
        importing.start()
        commands_read.close()
        events_write.close()
        try:
            message = events_read.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {process.exitcode})") from None
        match message:
            case Built(info):
                importing.join()
                return cls(process, commands_write, events_read, info)
            case LaunchError(text, bad_input):
                process.join(5)
                raise (ValueError if bad_input else RuntimeError)(text)

    def start(self, on_event):
        def receive():
            while True:
                try:
                    event = self._events_conn.recv()
                except (EOFError, OSError):
                    on_event(Exited())
                    return
                on_event(event)

        def deliver():  # commands leave from here: a long prompt must not block the event loop on a full pipe
            while True:
                command = self._outbox.get()
                try:
                    self._commands_conn.send(command)
                except (BrokenPipeError, OSError):
                    return
                if isinstance(command, Stop):
                    return

        self._threads = [threading.Thread(target=receive, name="engine-events", daemon=True),
                         threading.Thread(target=deliver, name="engine-commands", daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, command: Command):
        self._outbox.put(command)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def join(self, timeout: float | None = None):
        """Wait for the process to end; one still running after ``timeout`` is killed (XLA cannot interrupt a
        compile, and a shutdown must not wait for one)."""
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.1f s; killing it", timeout)
            self._process.kill()
            self._process.join()
        for thread in self._threads:
            thread.join(1.0)


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked while a child process starts: the child inherits the blocked mask through exec (a Ctrl-C
    during its imports, before it ignores SIGINT itself, never reaches it), and this process gets a Ctrl-C that
    came meanwhile once the block ends. The mask is the calling thread's only: a Ctrl-C that another thread of this
    process takes would still raise in the main thread, in the middle of handing the child its start-up data (the
    child then dies on a truncated pipe with a traceback), so the main thread's handler also waits until the end."""
    caught = []
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _child_main(commands, events, model: str, options: dict, warmup: bool, log_level: str, ready_early: bool):
    """The engine process: build the engine, report, then run the loop until ``stop`` (or until the server's
    process is gone: its end of the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))
    from zipage_jax.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_kwargs(model, **options)
    except Exception as error:
        bad_input = isinstance(error, ValueError)
        events.send(LaunchError(str(error) if bad_input else f"{type(error).__name__}: {error}", bad_input))
        return
    events.send(Built(engine_info(engine)))
    queued: queue.SimpleQueue = queue.SimpleQueue()
    stop_warmup = concurrent.futures.Future()

    def receive():
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):
                command = Stop()
            if isinstance(command, Stop) and not stop_warmup.done():
                stop_warmup.set_result(None)
            queued.put(command)
            if isinstance(command, Stop):
                return

    threading.Thread(target=receive, name="engine-commands", daemon=True).start()

    def emit(event):
        try:
            events.send(event)
        except (BrokenPipeError, OSError):  # the server's process is gone; the stop command follows
            pass

    EngineCore(engine, emit, queued, stop_warmup, warmup, ready_early).run()
    exit_if_compiling(engine)


def engine_info(engine) -> EngineInfo:
    return EngineInfo(engine.model_name, engine.max_model_len, engine.config, engine.tokenizer_path,
                      engine.model_path)


def exit_if_compiling(engine):
    """End the process now if a stopped warm-up left compiles running: XLA cannot interrupt them, and a normal
    exit would wait for every one."""
    if engine.compiling_unused:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
