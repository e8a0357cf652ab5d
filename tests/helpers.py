"""Helpers shared by several test modules."""

import functools

from zipage_jax.weights import load_hf_weights


@functools.cache
def _checkpoint_params(path, cfg, dtype):
    return load_hf_weights(path, cfg, dtype)


def checkpoint_params(engine):
    """The layer-stacked weights of the engine's checkpoint, loaded on their own for the dense oracle (the engine
    itself holds the serving layout)."""
    return _checkpoint_params(engine.config.model, engine.model_cfg, engine.dtype)
