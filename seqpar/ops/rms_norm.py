"""Fused residual add + RMSNorm, rounded like HF Llama's ``LlamaRMSNorm``.

Math (rows of the last dimension h; statistics in fp32)::

    residual_out = x + residual                    # rounded to x's dtype; residual None: residual_out = x
    rstd         = rsqrt(mean(residual_out**2) + eps)
    y            = round(round(residual_out * rstd) * weight)

The inner rounding is LlamaRMSNorm's (normalise in fp32, cast to the input dtype, then multiply by the
weight): in fp32 the torch reference equals ``LlamaRMSNorm(residual_out)`` bit for bit, and so it does in
fp16 / bf16 when the weight has the input's dtype (a weight of another dtype is read as fp32 and y still
has x's dtype, where HF would promote). The statistics are those of the stored (rounded) residual_out.

==============  ===========  =========================================
tensor          shape        dtype
==============  ===========  =========================================
x, residual     [..., h]     fp32 / fp16 / bf16 (the same); residual may be None
weight          [h]          any floating dtype
y               [..., h]     like x
residual_out    [..., h]     like x (x itself when residual is None)
==============  ===========  =========================================

Saved for backward: residual_out and the per-row fp32 rstd (and the weight, a parameter). float64 inputs
(for gradcheck) run on the torch backend, in float64 throughout. Backward::

    n = residual_out * rstd,  g = grad_y * weight
    grad_x = grad_residual = rstd * (g - n * mean(g * n)) + grad_residual_out
    grad_weight = sum_rows(grad_y * n)

grad_x and grad_residual have the same values; they are two tensors (the kernels write both) only when x
and residual both need a gradient: one tensor given to both could end up as the .grad of both leaves,
aliased through the view nodes between them and this op.

Backend interface (registered with :func:`seqpar.ops.registry.register`), on 2-D ``[rows, h]`` views with
unit column stride (any row stride)::

    forward(x, residual or None, weight, eps) -> (y, residual_out, rstd)        # residual None: residual_out is x
    backward(grad_y, grad_residual_out or None, residual_out, weight, rstd, residual_grad, weight_grad)
        -> (grad_x, grad_residual or None, grad_weight fp32 or None)

``grad_residual_out`` None means no gradient reached residual_out; ``residual_grad`` asks for the second
copy grad_residual; ``weight_grad`` for grad_weight (a frozen weight's backward writes no partial rows and
reduces nothing).

========  ================================================================  ==========
backend   what runs                                                         h
========  ================================================================  ==========
torch     fp32 reference (the test oracle, CPU fallback)                    any
triton    ``triton_kernels/rms_norm.py``: a row (or a few) per program,     any
          chunked beyond 16384 (forward) / 4096 (backward) columns, the
          backward's chunks after a pass that computes the row sums;
          per-program fp32 partial column sums + a second reduction
          kernel (no atomics)
cuda      ``csrc/rms_norm.cu``: 16-byte vectors, warp per row (small h) or   any
          block per row, chunked rows beyond the registers (backward:
          beyond 4096 columns, a row-sum pass then blocks of one column
          chunk each); same partial-sum scheme
========  ================================================================  ==========

The kernel backends are ``torch.library`` custom ops (``seqpar::add_rms_norm_{triton,cuda}_{fwd,bwd}``)
with fake implementations, so ``torch.compile`` traces through them (eager calls run their launchers
directly: :func:`seqpar.ops.registry.kernel_op`). A custom op can't return an input
or None, so without a residual their forward returns an empty residual_out and the backend substitutes x.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import registry
from .rows import as_rows, check_row_inputs, or_empty, unflatten_rows, vectorized
from .. import _ext

#: The op's name in :mod:`seqpar.ops.registry`.
OP = "add_rms_norm"


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(x, residual, weight, eps: float):
    acc = registry.acc_dtype(x.dtype)
    residual_out = x if residual is None else registry.cast(x.to(acc) + residual.to(acc), x.dtype)
    r = registry.cast(residual_out, acc)  # not .to: see registry.cast
    rstd = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)  # LlamaRMSNorm's ops, in its order
    y = registry.cast(weight.to(acc) * (r * rstd).to(x.dtype).to(acc), x.dtype)
    return y, residual_out, rstd.squeeze(-1)


def _torch_backward(grad_y, grad_residual_out, residual_out, weight, rstd, residual_grad: bool, weight_grad: bool):
    acc = registry.acc_dtype(grad_y.dtype)
    n = residual_out.to(acc) * rstd[:, None]
    gy = grad_y.to(acc)
    grad_weight = (gy * n).sum(dim=0) if weight_grad else None
    g = gy * weight.to(acc)
    grad = rstd[:, None] * (g - n * (g * n).mean(dim=1, keepdim=True))
    if grad_residual_out is not None:
        grad = grad + grad_residual_out.to(acc)
    grad_x = grad.to(grad_y.dtype)
    return grad_x, (grad_x.clone() if residual_grad else None), grad_weight


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


def _fwd_fake(x: torch.Tensor, has_residual: bool):
    rows, h = x.shape
    residual_out = x.new_empty((rows, h) if has_residual else (0,))
    return x.new_empty((rows, h)), residual_out, x.new_empty((rows,), dtype=torch.float32)


def _bwd_fake(grad_y: torch.Tensor, residual_grad: bool, weight_grad: bool):
    rows, h = grad_y.shape
    return (grad_y.new_empty((rows, h)), grad_y.new_empty((rows, h) if residual_grad else (0,)),
            grad_y.new_empty((h if weight_grad else 0,), dtype=torch.float32))


def _kernel_backend(name: str, fwd_op, bwd_op) -> registry.Backend:
    """A registry backend over a pair of kernel custom ops (which return empty tensors for the outputs
    that are absent: a custom op can't return None or an input)."""

    def forward(x, residual, weight, eps: float):
        y, residual_out, rstd = fwd_op(x, residual, weight, eps)
        return y, (x if residual is None else residual_out), rstd

    def backward(grad_y, grad_residual_out, residual_out, weight, rstd, residual_grad: bool, weight_grad: bool):
        grad_x, grad_res, grad_w = bwd_op(grad_y, grad_residual_out, residual_out, weight, rstd, residual_grad,
                                          weight_grad)
        return grad_x, (grad_res if residual_grad else None), (grad_w if weight_grad else None)

    return registry.Backend(OP, name, forward, backward, registry.row_kernel_check)


# ----------------------------------------------------------------------------- triton backend
@registry.kernel_op("seqpar::add_rms_norm_triton_fwd")
def _triton_fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels import rms_norm as kernels

    with _ext.on_device(x):
        y, residual_out, rstd = kernels.forward(x, residual, weight, eps)
    return y, (x.new_empty((0,)) if residual_out is None else residual_out), rstd


@_triton_fwd_op.register_fake
def _(x, residual, weight, eps):
    return _fwd_fake(x, residual is not None)


@registry.kernel_op("seqpar::add_rms_norm_triton_bwd")
def _triton_bwd_op(grad_y: torch.Tensor, grad_residual_out: Optional[torch.Tensor], residual_out: torch.Tensor,
                   weight: torch.Tensor, rstd: torch.Tensor, residual_grad: bool, weight_grad: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels import rms_norm as kernels

    with _ext.on_device(grad_y):
        grad_x, grad_res, grad_w = kernels.backward(grad_y, grad_residual_out, residual_out, weight, rstd,
                                                    residual_grad, weight_grad)
    return grad_x, (grad_y.new_empty((0,)) if grad_res is None else grad_res), or_empty(grad_w, grad_y)


@_triton_bwd_op.register_fake
def _(grad_y, grad_residual_out, residual_out, weight, rstd, residual_grad, weight_grad):
    return _bwd_fake(grad_y, residual_grad, weight_grad)


registry.register(_kernel_backend("triton", _triton_fwd_op, _triton_bwd_op))


# ----------------------------------------------------------------------------- cuda backend
def _cuda_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in a dtype the kernels read (fp32 / fp16 / bf16), contiguous."""
    return weight.contiguous() if weight.dtype in _ext.DTYPE_CODES else weight.float()  # [h]: negligible


@registry.kernel_op("seqpar::add_rms_norm_cuda_fwd")
def _cuda_fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = _ext.cuda_extension()
    y, residual_out, rstd = _fwd_fake(x, residual is not None)
    rows, h = x.shape
    w = _cuda_weight(weight)
    res_out = None if residual is None else residual_out
    strides = (x.stride(0),) + (() if residual is None else (residual.stride(0),))
    with _ext.on_device(x):
        ext.add_rms_norm_fwd(
            x.data_ptr(), 0 if residual is None else residual.data_ptr(), w.data_ptr(), y.data_ptr(),
            0 if res_out is None else res_out.data_ptr(), rstd.data_ptr(), rows, h, x.stride(0),
            0 if residual is None else residual.stride(0), _ext.DTYPE_CODES[x.dtype], _ext.DTYPE_CODES[w.dtype],
            vectorized(x.dtype, h, (x, residual, w, y, res_out), strides), float(eps), _ext.cuda_stream(x.device))
    return y, residual_out, rstd


@_cuda_fwd_op.register_fake
def _(x, residual, weight, eps):
    return _fwd_fake(x, residual is not None)


@registry.kernel_op("seqpar::add_rms_norm_cuda_bwd")
def _cuda_bwd_op(grad_y: torch.Tensor, grad_residual_out: Optional[torch.Tensor], residual_out: torch.Tensor,
                 weight: torch.Tensor, rstd: torch.Tensor, residual_grad: bool, weight_grad: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = _ext.cuda_extension()
    grad_y = grad_y.contiguous()
    if grad_residual_out is not None:
        grad_residual_out = grad_residual_out.contiguous()
    if residual_out.stride(-1) != 1:
        residual_out = residual_out.contiguous()
    grad_x, grad_res, grad_w = _bwd_fake(grad_y, residual_grad, weight_grad)
    rows, h = grad_y.shape
    w = _cuda_weight(weight)
    dtype = _ext.DTYPE_CODES[grad_y.dtype]
    vec = vectorized(grad_y.dtype, h, (grad_y, grad_residual_out, residual_out, w, grad_x, grad_res),
                     (residual_out.stride(0),))
    with _ext.on_device(grad_y):
        n_partials = ext.add_rms_norm_bwd_partials(rows, h, dtype, vec)  # one wave of the kernel's blocks
        partials = torch.empty((n_partials if weight_grad else 0, h), dtype=torch.float32, device=grad_y.device)
        # sum(g * n) per row: the kernels of rows too long for one block's registers compute it first (rows
        # floats, small beside the partial rows, so allocated whatever h is)
        row_sums = torch.empty((rows,), dtype=torch.float32, device=grad_y.device)
        ext.add_rms_norm_bwd(
            grad_y.data_ptr(), 0 if grad_residual_out is None else grad_residual_out.data_ptr(),
            residual_out.data_ptr(), residual_out.stride(0), w.data_ptr(), rstd.data_ptr(), grad_x.data_ptr(),
            grad_res.data_ptr() if residual_grad else 0, partials.data_ptr(), n_partials, row_sums.data_ptr(),
            grad_w.data_ptr() if weight_grad else 0, rows, h, dtype, _ext.DTYPE_CODES[w.dtype], vec,
            _ext.cuda_stream(grad_y.device))
    return grad_x, grad_res, grad_w


@_cuda_bwd_op.register_fake
def _(grad_y, grad_residual_out, residual_out, weight, rstd, residual_grad, weight_grad):
    return _bwd_fake(grad_y, residual_grad, weight_grad)


registry.register(_kernel_backend("cuda", _cuda_fwd_op, _cuda_bwd_op))


# ----------------------------------------------------------------------------- autograd
class _AddRMSNorm(torch.autograd.Function):
    """On x / residual of any rank and layout: the ``[rows, h]`` views (or copies) are taken in here
    (grad mode off: no view or copy nodes in the autograd graph) and the gradients reshaped back."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, impl):
        shape = x.shape
        h = shape[-1]
        x_rows = as_rows(x, h)
        y, residual_out, rstd = impl.forward(x_rows, None if residual is None else as_rows(residual, h), weight, eps)
        # No residual: residual_out is x's rows. Where they are a view of x, x itself is saved (its rows are taken
        # again in backward): the view, made here with grad mode off, turned an in-place change of x after the
        # forward into autograd's "view created in no_grad mode" error instead of its version error naming x.
        ctx.rows_of_x = residual is None and residual_out is x_rows and x_rows is not x
        ctx.save_for_backward(x if ctx.rows_of_x else residual_out, weight, rstd)
        ctx.impl, ctx.has_residual, ctx.shape = impl, residual is not None, shape
        ctx.set_materialize_grads(False)  # an unused residual_out costs no zeros tensor to read
        if len(shape) != 2:
            # no residual: residual_out is x itself. Not the [rows, h] view of x viewed back: export can't
            # prove that view's stride guard for a dynamic batch dim (b * min(h, h b) == h b)
            y = unflatten_rows(y, shape)
            residual_out = x.detach() if residual is None else unflatten_rows(residual_out, shape)
        if not any(ctx.needs_input_grad[:2]):   # residual_out does not depend on the weight
            ctx.mark_non_differentiable(residual_out)
        return y, residual_out

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad_y, grad_residual_out):
        residual_out, weight, rstd = ctx.saved_tensors
        if ctx.rows_of_x:
            residual_out = as_rows(residual_out, ctx.shape[-1])
        x_grad, res_grad = ctx.needs_input_grad[0], ctx.has_residual and ctx.needs_input_grad[1]
        if grad_y is None:
            # Only residual_out is used: no norm backward (on a row with an inf or NaN it gave NaN gradients
            # from 0 * x_hat), and no gradient for the weight, as autograd gives an unused norm.
            return (grad_residual_out if x_grad else None), (grad_residual_out if res_grad else None), None, None, None
        if len(ctx.shape) != 2:
            grad_y = grad_y.reshape(residual_out.shape)
        if grad_residual_out is not None and len(ctx.shape) != 2:
            grad_residual_out = grad_residual_out.reshape(residual_out.shape)
        # a frozen weight's column sum is not computed: its gradient is None, as autograd's
        grad_x, grad_res, grad_weight = ctx.impl.backward(grad_y.contiguous(), grad_residual_out, residual_out,
                                                          weight, rstd, x_grad and res_grad, ctx.needs_input_grad[2])
        if not x_grad:  # the one tensor goes to whichever input needs it
            grad_x, grad_res = None, (grad_x if res_grad else None)
        if len(ctx.shape) != 2:
            grad_x = None if grad_x is None else grad_x.reshape(ctx.shape)
            grad_res = None if grad_res is None else grad_res.reshape(ctx.shape)
        grad_weight = None if grad_weight is None else registry.cast(grad_weight, weight.dtype)
        return grad_x, grad_res, grad_weight, None, None


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, *, eps: float = 1e-6,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = x + residual``; ``y = RMSNorm(residual_out) * weight`` (HF LlamaRMSNorm rounding).

    Returns ``(y, residual_out)``; with ``residual=None``, residual_out is x's values (no copy). Gradients
    flow to x, residual and weight. Any layout of x / residual: rows that can't be viewed as ``[rows, h]``
    with unit column stride are copied first. ValueError (naming the value) for x or residual not a
    floating [..., h] tensor, a residual of another shape, dtype or device than x, a weight not a floating
    [h] tensor on x's device (any floating dtype: read as fp32), an eps that is not finite or below fp32's
    smallest normal number (:func:`seqpar.ops.registry.check_eps`), or a backend that can't run it.

    Args:
        eps: added to the mean square (finite, at least 1.18e-38).
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
    """
    h = check_row_inputs(x, residual, {"weight": weight}, eps, residual_optional=True)
    impl = registry.select(OP, backend, x.device, dtype=x.dtype, rows=x.numel() // h)
    return _AddRMSNorm.apply(x, residual, weight, float(eps), impl)
