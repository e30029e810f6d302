"""Modules: parallel linear layers, LayerNorm / RMSNorm, the transformer layer and a small GPT model."""
from .fused_layer_norm import FusedBiasDropoutAddLayerNorm
from .layer import ParallelAttention, ParallelMLP, TransformerLayer
from .layernorm import LayerNorm, RMSNorm
from .linear import ColumnParallelLinear, RowParallelLinear
from .model import GPTModel

__all__ = ["FusedBiasDropoutAddLayerNorm", "ColumnParallelLinear", "RowParallelLinear", "LayerNorm", "RMSNorm", "ParallelAttention", "ParallelMLP",
           "TransformerLayer", "GPTModel"]
