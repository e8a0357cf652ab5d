"""The compile counter behind `num_compiles` (and the zero-compiles-after-warm-up tests): it counts the process's
backend compiles while open, stops when closed, and leaves no jax listener behind once closed or dropped."""

import gc

import jax
import jax.numpy as jnp
from jax._src import monitoring

from seeds import fresh_seed
from zipage_jax.worker.compile_counter import CompileCounter


def compile_new_program():
    """A program no cache holds: a constant drawn for this call is part of it."""
    scale = float(fresh_seed() % 1000 + 2)
    jax.jit(lambda x: x * scale + 1.0)(jnp.ones(3)).block_until_ready()


def test_counts_while_open_and_stops_when_closed_or_dropped():
    listeners = len(monitoring.get_event_duration_listeners())
    counter = CompileCounter()
    assert len(monitoring.get_event_duration_listeners()) == listeners + 1
    compile_new_program()
    counted = counter.count
    assert counted >= 1 and counter.seconds > 0
    counter.close()
    counter.close()  # closing twice is harmless
    assert len(monitoring.get_event_duration_listeners()) == listeners
    compile_new_program()
    assert counter.count == counted

    dropped = CompileCounter()  # an engine that is never closed, then garbage
    assert len(monitoring.get_event_duration_listeners()) == listeners + 1
    del dropped
    gc.collect()
    assert len(monitoring.get_event_duration_listeners()) == listeners
