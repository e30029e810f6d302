"""Dropout whose mask is regenerated from the counter-based RNG instead of being stored.

A 2-D view ``[rows, cols]`` of the input is dropped with ``keep = mask_byte(seed, row_offset + row, col) >= P``,
``P = round(p * 256)``, and kept values are scaled by ``float32(256 / (256 - P))`` (see :mod:`seqpar.random`);
nothing mask-sized is saved for backward.
"""
from __future__ import annotations

import dataclasses

import torch

from . import registry
from .. import _ext
from ..random import dropout_keep_mask, dropout_scale, dropout_threshold, resolve_seed


@dataclasses.dataclass(frozen=True)
class DropoutSpec:
    """Which dropout mask to apply: probability ``p``, stream ``seed`` and the global index of row 0.

    ``p`` is validated on construction (:func:`seqpar.random.dropout_threshold`: ValueError unless
    ``round(p * 256) < 256``); its byte threshold ``P = round(p * 256) == 0`` means no dropout (seed and
    row_offset are then ignored).
    """

    p: float = 0.0
    seed: int = 0
    row_offset: int = 0

    def __post_init__(self) -> None:
        # Validates p; P is kept (not a field: equality, hashing and repr stay those of p, seed, row_offset)
        # because the ops read it several times per call.
        object.__setattr__(self, "_threshold", dropout_threshold(self.p))

    @property
    def threshold(self) -> int:
        """``P = round(p * 256)``: an element is kept iff its mask byte is >= P."""
        return self._threshold

    @property
    def active(self) -> bool:
        return self._threshold > 0

    @property
    def scale(self) -> float:
        """``float32(256 / (256 - P))``, the factor of kept values."""
        return dropout_scale(self.threshold)

    def keep_mask_2d(self, n_rows: int, n_cols: int, device) -> torch.Tensor:
        """Bool [n_rows, n_cols] keep-mask for rows ``row_offset .. row_offset + n_rows - 1``."""
        rows = torch.arange(n_rows, device=device) + self.row_offset
        return dropout_keep_mask(self.seed, rows, n_cols, self.threshold)


_NO_DROPOUT = DropoutSpec()  # immutable: shared by every call without active dropout


def make_dropout_spec(p: float, training: bool, seed, row_offset: int = 0) -> DropoutSpec:
    """Validate ``p`` (ValueError outside [0, 1) or when ``round(p * 256) >= 256``) and resolve the seed
    when dropout is active (``round(p * 256) > 0`` and training)."""
    threshold = dropout_threshold(p)
    if not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"row_offset must be a non-negative int, got {row_offset!r}")
    if not training or threshold == 0:
        return _NO_DROPOUT
    return DropoutSpec(float(p), resolve_seed(seed), row_offset)


def apply_keep_mask(x2d: torch.Tensor, spec: DropoutSpec) -> torch.Tensor:
    """``x2d * keep * scale`` (``x2d`` unchanged when the spec is inactive).

    CUDA tensors use the kernel of csrc/dropout.cu when seqpar._C is built (the same mask, computed in
    registers, one Philox call per 16 columns); everything else uses the torch reference.
    """
    if not spec.active:
        return x2d
    if x2d.is_cuda and x2d.dtype in _ext.DTYPE_CODES and _ext.cuda_extension_error() is None:
        x2d = x2d.contiguous()
        out = torch.empty_like(x2d)
        with _ext.on_device(x2d):
            _ext.cuda_extension().dropout_rows(x2d.data_ptr(), out.data_ptr(), x2d.shape[0], x2d.shape[1],
                                               _ext.DTYPE_CODES[x2d.dtype], spec.seed, spec.row_offset,
                                               spec.threshold, _ext.cuda_stream(x2d.device))
        return out
    keep = spec.keep_mask_2d(x2d.shape[0], x2d.shape[1], x2d.device)
    return x2d * keep * spec.scale


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec: DropoutSpec):
        ctx.spec = spec
        h = x.shape[-1]
        return apply_keep_mask(x.reshape(-1, h), spec).view(x.shape)

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad):
        h = grad.shape[-1]
        return apply_keep_mask(grad.reshape(-1, h), ctx.spec).view(grad.shape), None


def dropout(x: torch.Tensor, spec: DropoutSpec) -> torch.Tensor:
    """Dropout of ``x`` [..., h] viewed as rows of h; the mask is regenerated in backward."""
    return _Dropout.apply(x, spec) if spec.active else x


def bias_dropout_add(x: torch.Tensor, bias, residual: torch.Tensor, spec: DropoutSpec) -> torch.Tensor:
    """``residual + dropout(x + bias)`` with a regenerated mask (no LayerNorm; see the fused op)."""
    h = x if bias is None else x + bias
    return residual + dropout(h, spec)
