"""Modules: parallel linear layers, LayerNorm, the transformer layer and a small GPT model."""
from .layer import ParallelAttention, ParallelMLP, TransformerLayer
from .layernorm import LayerNorm
from .linear import ColumnParallelLinear, RowParallelLinear
from .model import GPTModel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "LayerNorm", "ParallelAttention", "ParallelMLP",
           "TransformerLayer", "GPTModel"]
