"""Modules: parallel linear layers, LayerNorm / RMSNorm, the transformer layer and a small GPT model;
sharded state dicts of them (model and optimizer) for torch.distributed.checkpoint; gradient clipping by
the unsharded model's norm and fp16 loss scaling whose overflow check covers every rank."""
from .fused_layer_norm import FusedBiasDropoutAddLayerNorm
from .grad import TensorParallelGradScaler, clip_grad_norm_
from .layer import ParallelAttention, ParallelMLP, TransformerLayer
from .layernorm import LayerNorm, RMSNorm
from .linear import ColumnParallelLinear, RowParallelLinear
from .model import GPTModel
from .state_dict import (ShardLayout, load_sharded_optimizer_state_dict, sharded_optimizer_state_dict,
                         sharded_state_dict)

__all__ = ["FusedBiasDropoutAddLayerNorm", "ColumnParallelLinear", "RowParallelLinear", "LayerNorm", "RMSNorm", "ParallelAttention", "ParallelMLP",
           "TransformerLayer", "GPTModel", "ShardLayout", "sharded_state_dict", "sharded_optimizer_state_dict",
           "load_sharded_optimizer_state_dict", "clip_grad_norm_", "TensorParallelGradScaler"]
