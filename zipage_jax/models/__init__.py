"""Functional llama-family models: config, layer-stacked params, dense and paged forward passes."""

from zipage_jax.models.config import Llama3RopeScaling, ModelConfig
from zipage_jax.models.params import LayerParams, Params, ServingLayer, ServingParams, to_serving
from zipage_jax.models.transformer import PagedBatch, forward_dense, forward_paged

__all__ = [
    "Llama3RopeScaling",
    "ModelConfig",
    "LayerParams",
    "Params",
    "ServingLayer",
    "ServingParams",
    "to_serving",
    "PagedBatch",
    "forward_dense",
    "forward_paged",
]
