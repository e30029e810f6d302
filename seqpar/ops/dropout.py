"""Dropout whose mask is regenerated from the counter-based RNG instead of being stored.

A 2-D view ``[rows, cols]`` of the input is dropped with ``keep = mask_byte(seed, row_offset + row, col) >= P``,
``P = round(p * 256)``, and kept values are scaled by ``float32(256 / (256 - P))`` (see :mod:`seqpar.random`);
nothing mask-sized is saved for backward.

Backends (the registry's op "dropout", :func:`select_backend`): cuda (csrc/dropout.cu) and triton
(triton_kernels/dropout.py) on fp32 / fp16 / bf16 tensors of fewer than 2**30 rows, and the torch
reference (about a hundred small ops per mask: on a GPU as many launches) for everything. "auto" tries
cuda, triton, torch; all three give the same mask and values, bit for bit.

A backend's ``forward(x, spec, bias=None, residual=None)`` is ``[residual +] where(keep, (x [+ bias]) *
scale, 0)`` with each step rounded to x's dtype as the separate torch ops round it (``bias`` [h],
``residual`` like x): plain dropout without the two, :func:`bias_dropout_add`'s forward in one kernel
pass with them. Its ``backward(grad, spec)`` is the plain mask applied to ``grad``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import registry
from .. import _ext
from .._custom_op import capturing_graph
from ..random import check_stream_seed, dropout_keep_mask, dropout_scale, dropout_threshold, resolve_seed


@dataclasses.dataclass(frozen=True)
class DropoutSpec:
    """Which dropout mask to apply: probability ``p``, stream ``seed`` and the global index of row 0.

    Every field is validated on construction: ``p`` by :func:`seqpar.random.dropout_threshold`
    (ValueError unless ``round(p * 256) < 256``), ``seed`` an int in [0, 2**62) (a Philox stream seed),
    ``row_offset`` an int in [0, 2**62) (rows count on from it in int64). The byte threshold ``P = round(p * 256) == 0`` means no dropout
    (seed and row_offset are then ignored).
    """

    p: float = 0.0
    seed: int = 0
    row_offset: int = 0

    def __post_init__(self) -> None:
        # Validates p; P is kept (not a field: equality, hashing and repr stay those of p, seed, row_offset)
        # because the ops read it several times per call.
        object.__setattr__(self, "_threshold", dropout_threshold(self.p))
        check_stream_seed(self.seed)
        _check_row_offset(self.row_offset)

    @property
    def threshold(self) -> int:
        """``P = round(p * 256)``: an element is kept iff its mask byte is >= P."""
        return self._threshold

    @property
    def active(self) -> bool:
        """Whether any element can be dropped (``P > 0``)."""
        return self._threshold > 0

    @property
    def scale(self) -> float:
        """``float32(256 / (256 - P))``, the factor of kept values. While torch.compile traces: the double
        ``256 / (256 - P)``, which fp32 / fp16 / bf16 tensors round to the same fp32 scalar (a float64
        tensor would see the unrounded double)."""
        if capturing_graph():
            # Not a read of the table: under dynamic=True Dynamo turns a float read inside an autograd
            # Function's forward into an input of the forward's subgraph and reuses it in the backward's,
            # which can't lift it. Arithmetic on the int threshold is a constant.
            return 256.0 / (256 - self._threshold)
        return dropout_scale(self.threshold)

    def keep_mask_2d(self, n_rows: int, n_cols: int, device) -> torch.Tensor:
        """Bool [n_rows, n_cols] keep-mask for rows ``row_offset .. row_offset + n_rows - 1``, on ``device``."""
        rows = torch.arange(n_rows, device=device) + self.row_offset
        return dropout_keep_mask(self.seed, rows, n_cols, self.threshold)


def _check_row_offset(row_offset) -> None:
    registry.check_offset("row_offset", row_offset)


#: The inactive spec (p = 0), immutable: shared by every call without active dropout.
NO_DROPOUT = DropoutSpec()


def dropout_active(p: float, training: bool) -> bool:
    """Whether dropout ``p`` drops anything in this call (training and ``round(p * 256) > 0``), with ``p``
    (:func:`seqpar.random.dropout_threshold`) and ``training`` (a bool: a string such as "False" would be
    truthy) validated. Draws nothing: ops pick their backend by it before a seed is drawn, so a call
    that is refused leaves torch's generator as it was."""
    threshold = dropout_threshold(p)
    if not isinstance(training, bool):
        raise ValueError(f"training must be a bool, got {training!r}")
    return training and threshold > 0


def make_dropout_spec(p: float, training: bool, seed, row_offset: int = 0) -> DropoutSpec:
    """Validate ``p``, ``training`` (:func:`dropout_active`) and ``row_offset``, and resolve the seed when
    dropout is active (None draws one). A given seed is validated even when dropout is off."""
    active = dropout_active(p, training)
    _check_row_offset(row_offset)
    if not active:
        if seed is not None:
            check_stream_seed(seed)
        return NO_DROPOUT
    return DropoutSpec(float(p), resolve_seed(seed), row_offset)


#: The op's name in :mod:`seqpar.ops.registry`.
OP = "dropout"


def apply_keep_mask(x: torch.Tensor, spec: DropoutSpec, impl: registry.Backend) -> torch.Tensor:
    """``where(keep, x * scale, 0)`` of ``x`` [..., h] viewed as rows of h, on backend ``impl`` of the op
    "dropout" (:func:`select_backend`; ``x`` unchanged when the spec is inactive): a dropped inf or NaN is
    0, as in the kernels (``x * keep * scale`` made it NaN: inf * 0). The result is a new tensor of
    ``x``'s shape, not a view of a [rows, h] one (autograd refuses in-place ops on a view an
    autograd.Function returns). Its own backward: the same mask applied to the gradient."""
    return impl.forward(x, spec) if spec.active else x


def select_backend(x: torch.Tensor, backend: str = "auto") -> registry.Backend:
    """The backend of the op "dropout" for ``x`` [..., h] (:mod:`seqpar.ops.registry`'s order; ValueError
    with the reason for an explicit backend that can't run it)."""
    h = x.shape[-1]
    return registry.select(OP, backend, x.device, dtype=x.dtype, rows=x.numel() // h if h else 0)


def _torch_apply(x: torch.Tensor, spec: DropoutSpec, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    # Three separate results, each rounded to the dtype: the roundings the kernels reproduce.
    if bias is not None:
        x = x + bias
    h = x.shape[-1]
    keep = spec.keep_mask_2d(x.numel() // h if h else 0, h, x.device).view(x.shape)
    out = torch.where(keep, x * spec.scale, 0.0)
    return out if residual is None else residual + out


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _kernel_backend(name: str, kernel_op) -> registry.Backend:
    """A registry backend over a mask kernel's custom op: forward with bias_dropout_add's optional bias and
    residual fused in, backward the same call on the gradient alone (the plain mask)."""
    def apply(x: torch.Tensor, spec: DropoutSpec, bias: Optional[torch.Tensor] = None,
              residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return kernel_op(x.contiguous(), spec.seed, spec.row_offset, spec.threshold, _contiguous(bias),
                         _contiguous(residual))

    return registry.Backend(OP, name, apply, apply, registry.row_kernel_check)


@registry.kernel_op("seqpar::dropout_cuda")
def _cuda_dropout(x: torch.Tensor, seed: int, row_offset: int, threshold: int, bias: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """csrc/dropout.cu on a contiguous CUDA ``x`` [..., h] (rows of h): ``[residual +] where(keep, (x [+ bias])
    * scale, 0)`` (``bias`` [h], ``residual`` like x, contiguous, or None), rounded as the torch reference
    rounds. A custom op (:func:`seqpar.ops.registry.kernel_op`), so torch.compile traces it as one node: the
    bare extension call on ``data_ptr()`` was a graph break in every layer with dropout (and an error under
    fullgraph=True)."""
    out = torch.empty_like(x)
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    with _ext.on_device(x):
        _ext.cuda_extension().dropout_rows(x.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                           0 if residual is None else residual.data_ptr(), out.data_ptr(), rows, h,
                                           _ext.DTYPE_CODES[x.dtype], seed, row_offset, threshold,
                                           _ext.cuda_stream(x.device))
    return out


@_cuda_dropout.register_fake
def _(x, seed, row_offset, threshold, bias=None, residual=None):
    return torch.empty_like(x)


@registry.kernel_op("seqpar::dropout_triton")
def _triton_dropout(x: torch.Tensor, seed: int, row_offset: int, threshold: int,
                    bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """triton_kernels/dropout.py on a contiguous fp32 / fp16 / bf16 ``x`` [..., h] (rows of h):
    ``[residual +] where(keep, (x [+ bias]) * scale, 0)``, the mask and values of the CUDA kernel and the
    torch reference. A custom op like :func:`_cuda_dropout`."""
    from ..triton_kernels.dropout import dropout_rows

    with _ext.on_device(x):
        return dropout_rows(x, seed, row_offset, threshold, bias, residual)


@_triton_dropout.register_fake
def _(x, seed, row_offset, threshold, bias=None, residual=None):
    return torch.empty_like(x)


registry.register(registry.Backend(OP, "torch", _torch_apply, _torch_apply))
registry.register(_kernel_backend("triton", _triton_dropout))
registry.register(_kernel_backend("cuda", _cuda_dropout))


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec: DropoutSpec, impl: registry.Backend):
        ctx.spec, ctx.impl = spec, impl
        return impl.forward(x, spec)

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad):
        return ctx.impl.backward(grad, ctx.spec), None, None


class _BiasDropoutAdd(torch.autograd.Function):
    """``residual + dropout(x + bias)`` in one forward call of the backend (one kernel pass on triton /
    cuda); saves nothing. Backward: autograd's gradients of the three unfused ops, bit for bit."""

    @staticmethod
    def forward(ctx, x, bias, residual, spec: DropoutSpec, impl: registry.Backend):
        ctx.spec, ctx.impl = spec, impl
        return impl.forward(x, spec, bias, residual)

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad):
        needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
        grad_x = grad_bias = None
        if needs_x or needs_bias:
            grad_x = ctx.impl.backward(grad, ctx.spec)
            if needs_bias:
                # what autograd's broadcast add reduces the bias gradient with (at::sum_to, in grad's dtype)
                grad_bias = grad_x.sum_to_size(grad_x.shape[-1:])
        return grad_x if needs_x else None, grad_bias, grad if needs_residual else None, None, None


def _check_dropout_args(x, spec) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating [..., h] tensor, got {got}")
    registry.check_dense(x=x)
    if not isinstance(spec, DropoutSpec):
        raise ValueError(f"spec must be a seqpar.ops.DropoutSpec, got {type(spec).__name__}")


def dropout(x: torch.Tensor, spec: DropoutSpec, *, backend: str = "auto") -> torch.Tensor:
    """Dropout of ``x`` [..., h] viewed as rows of h; the mask is regenerated in backward.

    ``x`` a floating tensor with at least one dimension; ``spec`` a :class:`DropoutSpec` (ValueError
    otherwise, naming the argument). An inactive spec returns ``x`` itself. A dropped element is 0 even
    where ``x`` is inf or NaN, in every backend and in the gradient (``F.dropout`` multiplies by the
    mask, so there a dropped inf or NaN becomes NaN); a non-finite kept element passes through.

    Args:
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`; the kernels take
            fp32 / fp16 / bf16 and fewer than 2**30 rows).
    """
    _check_dropout_args(x, spec)
    if not (spec.active and x.numel()):
        return x
    return _Dropout.apply(x, spec, select_backend(x, backend))


def bias_dropout_add(x: torch.Tensor, bias, residual: torch.Tensor, spec: DropoutSpec, *,
                     backend: str = "auto") -> torch.Tensor:
    """``residual + dropout(x + bias)`` with a regenerated mask (no LayerNorm; see the fused op).

    On ``[rows, h]`` views, each step rounded to the dtype as three separate torch ops round it::

        out = round(residual + round(where(keep, round(x + bias) * scale, 0)))

        grad_residual = grad_out
        grad_x        = where(keep, grad_out * scale, 0)         # the mask regenerated
        grad_bias     = grad_x summed over the rows (sum_to_size, in grad's dtype)

    ============  ===============================================================
    x, residual   [..., h], one floating dtype and device, the same shape
    bias          [h] of x's dtype and device, or None
    spec          the mask: a :class:`DropoutSpec`, as in :func:`dropout`
    returns       [..., h]
    ============  ===============================================================

    With an active spec the forward is one call of the op "dropout"'s backend with the bias and residual
    (on triton / cuda one kernel pass: reads x, bias, residual, writes out) and nothing is saved; the
    values and gradients are bit for bit those of ``residual + dropout(x + bias)`` computed unfused, in
    every backend. An inactive spec or an empty tensor is ``residual + (x + bias)`` in plain torch ops.

    Nothing is broadcast or promoted: a shape, dtype or device that differs is a ValueError naming the
    argument. A dropped element of ``x + bias`` adds exactly 0, even an inf or NaN (see :func:`dropout`,
    which also says what ``backend`` takes).
    """
    _check_dropout_args(x, spec)
    registry.check_dense(residual=residual, bias=bias)
    for name, t, shape in (("residual", residual, x.shape), ("bias", bias, x.shape[-1:])):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != x.dtype or t.device != x.device:
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {list(shape)} tensor of x's {x.dtype} on {x.device}, got {got}")
    if not (spec.active and x.numel()):
        return residual + (x if bias is None else x + bias)
    return _BiasDropoutAdd.apply(x, bias, residual, spec, select_backend(x, backend))
