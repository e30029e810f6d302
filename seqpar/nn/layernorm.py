"""LayerNorm whose parameters know the tensor-parallel group.

Under sequence parallelism each rank normalises only its sequence shard, so the replicated weight and
bias see a shard of the tokens: they enter the computation through f (identity forward, all-reduce
backward) and after backward every rank holds the full, identical gradient, with no separate
"finalize grads" step.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ..ops.bias_dropout_add_layer_norm import bias_dropout_add_layer_norm
from ..ops.dropout import DropoutSpec
from ..parallel.mappings import copy_to_tensor_region
from ..parallel.state import ProcessGroup


class LayerNorm(nn.Module):
    """``LayerNorm(x) * weight + bias`` over the last dim h, standalone or fused after bias-dropout-add."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        self.eps, self.tp_group, self.sequence_parallel, self.backend = eps, tp_group, sequence_parallel, backend
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) as the computation uses them (through f under SP)."""
        if not self.sequence_parallel:
            return self.weight, self.bias
        return copy_to_tensor_region(self.weight, self.tp_group), copy_to_tensor_region(self.bias, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.affine()
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def after_bias_dropout_add(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                               spec: DropoutSpec) -> Tuple[torch.Tensor, torch.Tensor]:
        """``residual_out = residual + dropout(x + bias)``; returns ``(LayerNorm(residual_out), residual_out)``."""
        weight, ln_bias = self.affine()
        return bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=spec.p, eps=self.eps,
                                           training=spec.active, seed=spec.seed if spec.active else None,
                                           backend=self.backend, row_offset=spec.row_offset)
