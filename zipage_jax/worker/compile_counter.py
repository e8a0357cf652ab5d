"""Counts XLA backend compilations, so tests can prove that nothing compiles after warm-up."""

import functools
import weakref

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts every backend compile in the process from its creation until ``close()`` (or until it is garbage
    collected: jax's listener holds only a weak reference to it, so a dropped engine leaves no listener behind)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        listener = functools.partial(_on_event, weakref.ref(self))
        monitoring.register_event_duration_secs_listener(listener)
        self._unregister = weakref.finalize(self, monitoring.unregister_event_duration_listener, listener)

    def close(self):
        """Stop counting and remove the listener (idempotent)."""
        self._unregister()


def _on_event(counter_ref, event: str, duration: float, **_):
    counter = counter_ref()
    if counter is not None and event == BACKEND_COMPILE_EVENT:
        counter.count += 1
        counter.seconds += duration
