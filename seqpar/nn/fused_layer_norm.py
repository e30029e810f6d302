"""``FusedBiasDropoutAddLayerNorm``: the module form of :func:`seqpar.ops.bias_dropout_add_layer_norm`.

It owns the LayerNorm parameters (``weight`` [h], ``bias`` [h]; state-dict keys as ``torch.nn.LayerNorm``)
and, per call, takes the output of the preceding linear layer, that layer's (not yet added) bias and the
residual stream::

    residual_out = residual + dropout_p(x + bias)        # bias may be None
    y            = LayerNorm(residual_out) * weight + ln_bias

Dropout is active only in training mode. Under sequence parallelism (``tp_group`` +
``sequence_parallel=True``, which also sum the replicated LayerNorm parameters' gradients over the group,
:class:`seqpar.nn.LayerNorm`, which this module extends) each rank's input is its contiguous sequence shard
of the [s, ...] tensor, so by default the shard's first row is ``rank * rows`` (rows: the shard's
flattened leading dims), and the shard draws the same mask as the unsharded tensor (:mod:`seqpar.random`).
Pass ``row_offset`` (the global index of the shard's first row, sequence-major: ``seq_global * b +
batch``) for another layout; without sequence parallelism it is 0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.dropout import make_dropout_spec
from ..parallel.state import group_size, shard_first_row
from .layernorm import LayerNorm

__all__ = ["FusedBiasDropoutAddLayerNorm"]


class FusedBiasDropoutAddLayerNorm(LayerNorm):
    """Bias + dropout + residual add, then LayerNorm, in one fused op.

    Args:
        hidden_size: h, the normalised (last) dimension.
        eps: LayerNorm epsilon (finite, at least fp32's smallest normal number 1.18e-38).
        p: dropout probability in [0, 1), applied in training mode; the effective probability is
            ``round(p * 256) / 256`` (:func:`seqpar.random.effective_dropout_p`), and
            ``round(p * 256) >= 256`` is a ValueError (p <= 1/512 drops nothing: a warning).
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
        device, dtype: of the LayerNorm parameters.
        tp_group, sequence_parallel: as :class:`seqpar.nn.LayerNorm`.

    ==============  ===========  ==========================
    forward         shape        dtype
    ==============  ===========  ==========================
    x, residual     [..., h]     fp32 / fp16 / bf16 (same)
    bias            [h] or None  like x
    y, residual_out [..., h]     like x
    ==============  ===========  ==========================
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, p: float = 0.0, backend: str = "auto",
                 device=None, dtype=None, *, tp_group=None, sequence_parallel: bool = False) -> None:
        super().__init__(hidden_size, eps, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         backend=backend, device=device, dtype=dtype)
        make_dropout_spec(p, False, None)  # validates p
        self.p = float(p)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, *,
                seed: Optional[int] = None, row_offset: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``residual_out = residual + dropout(x + bias)``, ``y = LayerNorm(residual_out)``; returns ``(y,
        residual_out)``. ``x``: the preceding linear's output without its ``bias`` [h] (None: no bias); ``residual``
        [..., h]: the residual stream, as x (the class's shape table). ``seed`` None draws one from torch's default
        CPU generator mixed with :func:`seqpar.manual_seed`'s seed, so ``torch.utils.checkpoint`` around the call
        replays it. ``row_offset`` None: this rank's sequence shard's first row under sequence parallelism (``rank *
        rows`` of ``x``), else 0 (the module docstring). (0 under sequence parallelism gave every rank's shard the
        same mask.)"""
        if row_offset is None:
            row_offset = 0
            if self.sequence_parallel and group_size(self.tp_group) > 1:
                self._check_hidden(x)   # before x.shape is read (a 0-d x)
                row_offset = shard_first_row(x, self.tp_group, True)
        spec = make_dropout_spec(self.p, self.training, seed, row_offset)
        return self.after_bias_dropout_add(x, bias, residual, spec)

    def extra_repr(self) -> str:
        """LayerNorm's repr fields and the dropout probability ``p``."""
        return f"{super().extra_repr()}, p={self.p}"
