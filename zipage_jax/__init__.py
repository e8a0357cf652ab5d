"""zipage_jax: JAX + Pallas inference engine with Compressed PagedAttention."""

import logging


class _NoTorchAdvice(logging.Filter):
    """The engine needs only transformers' tokenizers and configs, so its advice to install PyTorch is noise."""

    def filter(self, record):
        return not record.getMessage().startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchAdvice())

from zipage_jax.config import EngineConfig  # noqa: E402
from zipage_jax.engine import LLM, LLMEngine  # noqa: E402
from zipage_jax.outputs import CompletionOutput, RequestOutput  # noqa: E402
from zipage_jax.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
