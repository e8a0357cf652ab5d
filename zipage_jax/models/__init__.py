"""Functional llama-family models: config, layer-stacked params, dense and paged forward passes."""

from .config import Llama3RopeScaling, ModelConfig
from .params import LayerParams, Params, ServingLayer, ServingParams, to_serving
from .transformer import PagedBatch, forward_dense, forward_paged

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
