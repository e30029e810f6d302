"""``FusedBiasDropoutAddLayerNorm``: the module form of :func:`seqpar.ops.bias_dropout_add_layer_norm`.

It owns the LayerNorm parameters (``weight`` [h], ``bias`` [h]; state-dict keys as ``torch.nn.LayerNorm``)
and, per call, takes the output of the preceding linear layer, that layer's (not yet added) bias and the
residual stream::

    residual_out = residual + dropout_p(x + bias)        # bias may be None
    y            = LayerNorm(residual_out) * weight + ln_bias

Dropout is active only in training mode. Under sequence parallelism pass the global index of the shard's
first row (flattened leading dims, sequence-major: ``seq_global * b + batch``) as ``row_offset`` so the
shard draws the same mask as the unsharded tensor (design.md 4). The LayerNorm parameters are
replicated but see only a sequence shard: their gradients must be summed across the tensor-parallel
group (the layer does that, not this module).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.bias_dropout_add_layer_norm import bias_dropout_add_layer_norm
from ..ops.registry import validate_backend

__all__ = ["FusedBiasDropoutAddLayerNorm"]


class FusedBiasDropoutAddLayerNorm(torch.nn.Module):
    """Bias + dropout + residual add, then LayerNorm, in one fused op.

    Args:
        hidden_size: h, the normalised (last) dimension.
        eps: LayerNorm epsilon (> 0).
        p: dropout probability in [0, 1), applied in training mode.
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
        device, dtype: of the LayerNorm parameters.

    ==============  ===========  ==========================
    forward         shape        dtype
    ==============  ===========  ==========================
    x, residual     [..., h]     fp32 / fp16 / bf16 (same)
    bias            [h] or None  like x
    y, residual_out [..., h]     like x
    ==============  ===========  ==========================
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, p: float = 0.0, backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise ValueError(f"eps must be a positive float, got {eps!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1), got {p!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.p = float(p)
        self.backend = validate_backend(backend)
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight = 1, bias = 0 (like torch.nn.LayerNorm)."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, *,
                seed: Optional[int] = None, row_offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y, residual_out)``; ``seed`` None draws one from :func:`seqpar.manual_seed`'s stream."""
        if x.dim() >= 1 and x.shape[-1] != self.hidden_size:
            raise ValueError(f"x last dimension {x.shape[-1]} != hidden_size {self.hidden_size}")
        return bias_dropout_add_layer_norm(x, bias, residual, self.weight, self.bias, p=self.p, eps=self.eps,
                                           training=self.training, seed=seed, backend=self.backend,
                                           row_offset=row_offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, p={self.p}, backend={self.backend!r}"
