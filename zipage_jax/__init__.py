"""zipage_jax: JAX + Pallas inference engine with Compressed PagedAttention.

The public names load on first use (PEP 562), so the command lines parse their options, and ``--help`` answers,
without importing jax.
"""

import importlib
import logging


class _NoTorchAdvice(logging.Filter):
    """The engine needs only transformers' tokenizers and configs, so its advice to install PyTorch is noise."""

    def filter(self, record):
        return not record.getMessage().startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchAdvice())

_EXPORTS = {
    "LLM": "zipage_jax.engine.llm",
    "LLMEngine": "zipage_jax.engine.llm_engine",
    "EngineConfig": "zipage_jax.config",
    "SamplingParams": "zipage_jax.sampling_params",
    "StructuredOutputsParams": "zipage_jax.structured_output.params",
    "RequestOutput": "zipage_jax.engine.outputs",
    "CompletionOutput": "zipage_jax.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zipage_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
