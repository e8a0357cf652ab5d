"""Counts XLA backend compilations, so tests can prove that nothing compiles after warm-up."""

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def close(self):
        monitoring.unregister_event_duration_listener(self._on_event)
