"""zipage_jax: JAX + Pallas inference engine with Compressed PagedAttention."""

from zipage_jax.config import EngineConfig
from zipage_jax.engine import LLM, LLMEngine
from zipage_jax.outputs import CompletionOutput, RequestOutput
from zipage_jax.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
