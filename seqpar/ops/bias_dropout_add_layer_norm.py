"""Fused bias + dropout + residual-add + LayerNorm.

Math (rows of the last dimension h; statistics in fp32)::

    residual_out = residual + dropout_p(x + bias)          # bias may be None; mask of seqpar.random,
                                                           # effective p = round(p * 256) / 256
    y            = (residual_out - mean) * rstd * ln_weight + ln_bias
    mean, rstd   = mean(residual_out), 1 / sqrt(var(residual_out) + eps)

Every backend computes the statistics by the corrected two-pass algorithm (Chan, Golub and LeVeque)::

    m0    = sum(r) / h,  d = r - m0                     # r: a row of residual_out in fp32
    shift = sum(d) / h                                  # the rounding error of m0, to first order
    mean  = m0 + shift,  var = max(sum(d * d) / h - shift**2, 0)

The plain two-pass mean m0 is off by a few ulps of |mean| (delta), so a constant row (var 0) had d = delta
everywhere and x_hat = delta / sqrt(delta**2 + eps) where ``F.layer_norm`` gives 0: +-1 once delta**2 >> eps
(at eps = 1e-12, rows of values above about 10), 0.1 at eps = 1e-5 for values near 1000. With the shift
a constant row's mean is its value exactly, so y = ln_bias; and rows of a large offset plus a small spread
lose no accuracy to the mean's rounding. The cost is one more row sum beside the sum of squares.

==============  ===========  =========================================
tensor          shape        dtype
==============  ===========  =========================================
x, residual     [..., h]     fp32 / fp16 / bf16 / fp64 (the same)
bias            [h] or None  like x
ln_weight/bias  [h]          any floating dtype
y               [..., h]     like x
residual_out    [..., h]     like residual
==============  ===========  =========================================

Saved for backward: residual_out and per-row fp32 mean / rstd; the dropout mask is regenerated. float64
inputs (for gradcheck) run on the torch backend, in float64 throughout.

Backend interface (registered with :func:`seqpar.ops.registry.register`), on 2-D ``[rows, h]`` views::

    forward(x, bias, residual, ln_weight, ln_bias, eps, spec) -> (y, residual_out, mean, rstd)
    backward(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, spec, param_grads)
        -> (grad_x, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias)

``grad_residual_out`` is the gradient arriving at the residual_out output (zeros when unused).
``param_grads`` says which column sums to compute, (grad_ln_weight, grad_ln_bias, grad_bias); the others
are None: a frozen norm (or linear bias) costs the kernels no partial rows and no reduction.

========  ===================================================================================
backend   what runs (every backend takes any h)
========  ===================================================================================
torch     fp32 reference (fp64 for fp64 inputs; the test oracle, CPU fallback)
triton    ``triton_kernels/bias_dropout_add_layer_norm.py``: one program per row (or a few rows)
          forward, rows longer than 8192 in column chunks; backward with per-program fp32 partial
          column sums + a second reduction kernel (no atomics), rows longer than 4096 in column
          chunks of at most 4096 after a pass that computes their row sums
cuda      ``csrc/bias_dropout_add_layer_norm.cu``: 16-byte vectors, forward warp per row (h <= 1024
          for fp16 / bf16, 512 for fp32) or block per row, rows longer than one block's registers
          (h > 16384) in column chunks; backward warp or block per row up to h = 4096, wider rows
          after a row-sum pass in blocks of one column chunk each; same partial-sum scheme
========  ===================================================================================

The paper's largest models (530B: h = 20480, 1T: h = 25600) take the chunked forward kernels.

All three draw the same dropout mask for the same (seed, row_offset): residual_out is bitwise equal
across backends. The kernel backends are ``torch.library`` custom ops
(``seqpar::bias_dropout_add_layer_norm_{triton,cuda}_{fwd,bwd}``) with fake implementations, so
``torch.compile`` traces through them (eager calls run their launchers directly:
:func:`seqpar.ops.registry.kernel_op`); their backward returns an empty tensor for a column sum not
asked for (a custom op can't return None), which the backend turns into None.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import registry
from . import dropout as _dropout
from .dropout import DropoutSpec, apply_keep_mask, make_dropout_spec
from .rows import NOT_PROMOTED, as_rows, check_row_inputs, or_empty, unflatten_rows, vectorized
from .. import _ext

#: The op's name in :mod:`seqpar.ops.registry`.
OP = "bias_dropout_add_layer_norm"
#: The reference's dropout: the torch one too (an oracle independent of the mask kernels).
_TORCH_DROPOUT = registry.get(_dropout.OP, "torch")


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(x, bias, residual, ln_weight, ln_bias, eps: float, spec: DropoutSpec):
    acc = registry.acc_dtype(x.dtype)
    h = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    residual_out = registry.cast(residual.to(acc) + apply_keep_mask(h, spec, _TORCH_DROPOUT), residual.dtype)
    # statistics of the stored (rounded) residual keep backward consistent. cast, not .to: see registry.cast
    r = registry.cast(residual_out, acc)
    m0 = r.mean(dim=1, keepdim=True)
    d = r - m0
    shift = d.mean(dim=1, keepdim=True)  # corrected two-pass statistics (module docstring)
    mean = m0 + shift
    var = (d.square().mean(dim=1, keepdim=True) - shift.square()).clamp_min(0.0)
    rstd = torch.rsqrt(var + eps)
    y = (r - mean) * rstd * ln_weight.to(acc) + ln_bias.to(acc)
    mean, rstd = mean.squeeze(1), rstd.squeeze(1)
    return registry.cast(y, x.dtype), residual_out, mean, rstd


def _torch_backward(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd,
                    spec: DropoutSpec, param_grads: Sequence[bool]):
    acc = registry.acc_dtype(grad_y.dtype)
    x_hat = (residual_out.to(acc) - mean[:, None]) * rstd[:, None]
    gy = grad_y.to(acc)
    grad_ln_weight = (gy * x_hat).sum(dim=0) if param_grads[0] else None
    grad_ln_bias = gy.sum(dim=0) if param_grads[1] else None
    g = gy * ln_weight.to(acc)
    grad_r = rstd[:, None] * (g - g.mean(dim=1, keepdim=True) - x_hat * (g * x_hat).mean(dim=1, keepdim=True))
    grad_r = grad_r + grad_residual_out.to(acc)
    grad_h = apply_keep_mask(grad_r, spec, _TORCH_DROPOUT)
    grad_bias = grad_h.sum(dim=0) if param_grads[2] else None
    return grad_h, grad_bias, grad_r, grad_ln_weight, grad_ln_bias


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


def _fwd_fake(x: torch.Tensor, residual: torch.Tensor):
    rows, h = x.shape
    stats = x.new_empty((rows,), dtype=torch.float32)
    return x.new_empty((rows, h)), residual.new_empty((rows, h)), stats, torch.empty_like(stats)


def _bwd_fake(grad_y: torch.Tensor, param_grads: Sequence[bool]):
    """(grad_x, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias): the column sums fp32 [h], or empty
    where ``param_grads`` (ln_weight, ln_bias, bias) does not ask for them."""
    rows, h = grad_y.shape
    grad_w, grad_b, grad_bias = (grad_y.new_empty((h if want else 0,), dtype=torch.float32) for want in param_grads)
    return grad_y.new_empty((rows, h)), grad_bias, grad_y.new_empty((rows, h)), grad_w, grad_b


def _kernel_backend(name: str, fwd_op, bwd_op) -> registry.Backend:
    """A registry backend over a pair of kernel custom ops (which take the DropoutSpec's fields, and return
    an empty tensor for a column sum not asked for, as a custom op can't return None)."""

    def forward(x, bias, residual, ln_weight, ln_bias, eps: float, spec: DropoutSpec):
        return fwd_op(x, bias, residual, ln_weight, ln_bias, eps, spec.threshold, spec.seed, spec.row_offset)

    def backward(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, spec: DropoutSpec,
                 param_grads: Sequence[bool]):
        g_x, g_bias, g_res, g_w, g_b = bwd_op(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd,
                                              spec.threshold, spec.seed, spec.row_offset, list(param_grads))
        want_w, want_b, want_bias = param_grads
        return g_x, (g_bias if want_bias else None), g_res, (g_w if want_w else None), (g_b if want_b else None)

    return registry.Backend(OP, name, forward, backward, registry.row_kernel_check)


# ----------------------------------------------------------------------------- triton backend
@registry.kernel_op("seqpar::bias_dropout_add_layer_norm_triton_fwd")
def _triton_fwd_op(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, ln_weight: torch.Tensor,
                   ln_bias: torch.Tensor, eps: float, drop_threshold: int, seed: int, row_offset: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels import bias_dropout_add_layer_norm as kernels

    with _ext.on_device(x):
        return kernels.forward(x, bias, residual, ln_weight, ln_bias, eps, drop_threshold, seed, row_offset)


@_triton_fwd_op.register_fake
def _(x, bias, residual, ln_weight, ln_bias, eps, drop_threshold, seed, row_offset):
    return _fwd_fake(x, residual)


@registry.kernel_op("seqpar::bias_dropout_add_layer_norm_triton_bwd")
def _triton_bwd_op(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor,
                   ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, drop_threshold: int, seed: int,
                   row_offset: int, param_grads: List[bool]
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels import bias_dropout_add_layer_norm as kernels

    with _ext.on_device(grad_y):
        g_x, g_bias, g_res, g_w, g_b = kernels.backward(grad_y, grad_residual_out, residual_out, ln_weight, mean,
                                                        rstd, drop_threshold, seed, row_offset, param_grads)
    return g_x, or_empty(g_bias, grad_y), g_res, or_empty(g_w, grad_y), or_empty(g_b, grad_y)


@_triton_bwd_op.register_fake
def _(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, drop_threshold, seed, row_offset, param_grads):
    return _bwd_fake(grad_y, param_grads)


registry.register(_kernel_backend("triton", _triton_fwd_op, _triton_bwd_op))


# ----------------------------------------------------------------------------- cuda backend
def _cuda_params(ln_weight: torch.Tensor, ln_bias: torch.Tensor):
    """LayerNorm parameters in one dtype the kernels read (fp32 / fp16 / bf16), contiguous."""
    if ln_weight.dtype != ln_bias.dtype or ln_weight.dtype not in _ext.DTYPE_CODES:
        ln_weight, ln_bias = ln_weight.float(), ln_bias.float()  # [h]: negligible
    return ln_weight.contiguous(), ln_bias.contiguous()


@registry.kernel_op("seqpar::bias_dropout_add_layer_norm_cuda_fwd")
def _cuda_fwd_op(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, ln_weight: torch.Tensor,
                 ln_bias: torch.Tensor, eps: float, drop_threshold: int, seed: int, row_offset: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = _ext.cuda_extension()
    y, residual_out, mean, rstd = _fwd_fake(x, residual)
    rows, h = x.shape
    w, b = _cuda_params(ln_weight, ln_bias)
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias[j] at unit stride; a [h] view may be strided
    with _ext.on_device(x):
        ext.bias_dropout_add_layer_norm_fwd(
            x.data_ptr(), 0 if bias is None else bias.data_ptr(), residual.data_ptr(), w.data_ptr(), b.data_ptr(),
            y.data_ptr(), residual_out.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, h, x.stride(0),
            residual.stride(0), _ext.DTYPE_CODES[x.dtype], _ext.DTYPE_CODES[w.dtype],
            vectorized(x.dtype, h, (x, bias, residual, w, b, y, residual_out), (x.stride(0), residual.stride(0))),
            float(eps), int(drop_threshold), int(seed), int(row_offset), _ext.cuda_stream(x.device))
    return y, residual_out, mean, rstd


@_cuda_fwd_op.register_fake
def _(x, bias, residual, ln_weight, ln_bias, eps, drop_threshold, seed, row_offset):
    return _fwd_fake(x, residual)


@registry.kernel_op("seqpar::bias_dropout_add_layer_norm_cuda_bwd")
def _cuda_bwd_op(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor,
                 ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, drop_threshold: int, seed: int,
                 row_offset: int, param_grads: List[bool]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ext = _ext.cuda_extension()
    # The kernels address every [rows, h] operand at row stride h (residual_out too: a direct call may pass
    # a row-strided view; the op itself saves a fresh one)
    grad_y, grad_residual_out = grad_y.contiguous(), grad_residual_out.contiguous()
    residual_out = residual_out.contiguous()
    g_x, g_bias, g_res, g_w, g_b = _bwd_fake(grad_y, param_grads)
    rows, h = grad_y.shape
    n_sums = sum(bool(want) for want in param_grads)
    w = ln_weight.contiguous() if ln_weight.dtype in _ext.DTYPE_CODES else ln_weight.float()
    dtype = _ext.DTYPE_CODES[grad_y.dtype]
    with _ext.on_device(grad_y):
        vec = vectorized(grad_y.dtype, h, (grad_y, grad_residual_out, residual_out, w, g_x, g_res))
        n_partials = ext.bias_dropout_add_layer_norm_bwd_partials(rows, h, dtype, vec)
        # the partial rows of the sums asked for, in the extension's order: ln_weight, ln_bias, bias
        partials = torch.empty((n_sums, n_partials, h), dtype=torch.float32, device=grad_y.device)
        # sum(g), sum(g * x_hat) per row: the kernels of rows wider than 4096 compute them first (2 * rows floats,
        # small beside the partial rows, so allocated whatever h is)
        row_sums = torch.empty((2, rows), dtype=torch.float32, device=grad_y.device)
        ext.bias_dropout_add_layer_norm_bwd(
            grad_y.data_ptr(), grad_residual_out.data_ptr(), residual_out.data_ptr(), w.data_ptr(), mean.data_ptr(),
            rstd.data_ptr(), g_x.data_ptr(), g_res.data_ptr(), partials.data_ptr(), n_partials, row_sums.data_ptr(),
            _sum_ptr(g_w), _sum_ptr(g_b), _sum_ptr(g_bias), rows, h, dtype,
            _ext.DTYPE_CODES[w.dtype], vec,
            int(drop_threshold), int(seed), int(row_offset), _ext.cuda_stream(grad_y.device))
    return g_x, g_bias, g_res, g_w, g_b


def _sum_ptr(grad_sum: torch.Tensor) -> int:
    """The extension's output pointer of a column sum; 0 (not computed) for the empty one not asked for."""
    return grad_sum.data_ptr() if grad_sum.numel() else 0


@_cuda_bwd_op.register_fake
def _(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, drop_threshold, seed, row_offset, param_grads):
    return _bwd_fake(grad_y, param_grads)


registry.register(_kernel_backend("cuda", _cuda_fwd_op, _cuda_bwd_op))


# ----------------------------------------------------------------------------- autograd
class _BiasDropoutAddLayerNorm(torch.autograd.Function):
    """On x / residual of any rank and layout: the ``[rows, h]`` views (or copies) are taken in here (grad
    mode off: no view or copy nodes in the autograd graph) and the gradients reshaped back."""

    @staticmethod
    def forward(ctx, x, bias, residual, ln_weight, ln_bias, eps, spec, impl):
        shape = x.shape
        x, residual = as_rows(x, shape[-1]), as_rows(residual, shape[-1])
        y, residual_out, mean, rstd = impl.forward(x, bias, residual, ln_weight, ln_bias, eps, spec)
        ctx.save_for_backward(residual_out, ln_weight, mean, rstd)
        ctx.spec, ctx.impl, ctx.shape = spec, impl, shape
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype,
                      ln_weight.dtype, ln_bias.dtype)
        if len(shape) != 2:
            y, residual_out = unflatten_rows(y, shape), unflatten_rows(residual_out, shape)
        if not any(ctx.needs_input_grad[:3]):   # residual_out does not depend on the norm's parameters
            ctx.mark_non_differentiable(residual_out)
        ctx.set_materialize_grads(False)  # an unused output is None in backward, not a zeros tensor
        return y, residual_out

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad_y, grad_residual_out):
        residual_out, ln_weight, mean, rstd = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[1]   # (False without a bias)
        if grad_y is None and grad_residual_out is None:
            # Neither output's gradient defined (their consumers returned None): nothing flows back, as
            # through the torch composite; gradcheck's undefined-grad check calls this too.
            return (None,) * 8
        if grad_y is None:
            # Only residual_out is used: no norm backward (on a row with an inf or NaN it gave NaN gradients
            # from 0 * x_hat), and no gradient for the norm's parameters, as autograd gives an unused norm.
            grad_res = grad_residual_out
            grad_x = apply_keep_mask(grad_res, ctx.spec, _dropout.select_backend(grad_res, ctx.impl.name))
            grad_bias = (grad_x.reshape(-1, grad_x.shape[-1]).to(registry.acc_dtype(grad_x.dtype)).sum(dim=0)
                         if bias_grad else None)
            grads = (grad_x, grad_bias, grad_res, None, None)
        else:
            if grad_residual_out is None:
                grad_residual_out = torch.zeros_like(residual_out)
            if len(ctx.shape) != 2:
                rows = residual_out.shape
                grad_y, grad_residual_out = grad_y.reshape(rows), grad_residual_out.reshape(rows)
            # a frozen norm's (or bias's) column sums are not computed: its gradient is None, as autograd's
            param_grads = (ctx.needs_input_grad[3], ctx.needs_input_grad[4], bias_grad)
            grad_x, grad_bias, grad_res, grad_w, grad_b = ctx.impl.backward(
                grad_y.contiguous(), grad_residual_out.contiguous(), residual_out, ln_weight, mean, rstd,
                ctx.spec, param_grads)
            if len(ctx.shape) != 2:
                grad_x, grad_res = grad_x.reshape(ctx.shape), grad_res.reshape(ctx.shape)
            grads = (grad_x, grad_bias, grad_res, grad_w, grad_b)
        # a cast only where a backend returned another dtype (fp32 column sums of low-precision parameters)
        grads = tuple(None if g is None else registry.cast(g, dt) for g, dt in zip(grads, ctx.dtypes))
        return grads + (None, None, None)


def _check_inputs(x, bias, residual, ln_weight, ln_bias, eps) -> int:
    h = check_row_inputs(x, residual, {"ln_weight": ln_weight, "ln_bias": ln_bias}, eps,
                         on_device=() if bias is None else (bias,))
    registry.check_dense(bias=bias)
    if bias is not None and (bias.shape != (h,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{h}] of {x.dtype}, got {tuple(bias.shape)} {bias.dtype} {NOT_PROMOTED}")
    return h


def bias_dropout_add_layer_norm(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                                ln_weight: torch.Tensor, ln_bias: torch.Tensor, *, p: float = 0.0,
                                eps: float = 1e-5, training: bool = True, seed: Optional[int] = None,
                                backend: str = "auto", row_offset: int = 0
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = residual + dropout_p(x + bias)``; ``y = LayerNorm(residual_out)``.

    Returns ``(y, residual_out)``; gradients flow to x, bias, residual, ln_weight and ln_bias. Any layout
    of x / residual: rows that can't be viewed as ``[rows, h]`` with unit column stride are copied first
    (the dropout mask follows the logical row-major index, so it is the contiguous tensor's mask).

    Args:
        x, bias, residual, ln_weight, ln_bias: the tensors of the module docstring's table.
        p: dropout probability in [0, 1) (ignored when ``training`` is False). The effective probability
            is ``round(p * 256) / 256`` (:func:`seqpar.random.effective_dropout_p`): p = 0.1 drops 26/256
            of the elements, p <= 1/512 none (a warning); ``round(p * 256) >= 256`` is a ValueError. A dropped
            element of ``x + bias`` adds exactly 0, even an inf or NaN (:func:`seqpar.ops.dropout`).
        eps: added to the variance, ``rstd = 1 / sqrt(var + eps)`` (finite, at least 1.18e-38:
            :func:`seqpar.ops.registry.check_eps`).
        training: False turns dropout off whatever ``p`` (no seed drawn; a given one is still validated).
        seed: dropout stream seed (int in [0, 2**62)); None draws one from :func:`seqpar.manual_seed`'s
            generator.
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
        row_offset: global index of the first row (flattened leading dims) in the dropout RNG, so a
            sequence shard draws the same mask as the unsharded tensor would.
    """
    h = _check_inputs(x, bias, residual, ln_weight, ln_bias, eps)
    impl = registry.select(OP, backend, x.device, dtype=x.dtype, h=h, rows=x.numel() // h)
    spec = make_dropout_spec(p, training, seed, row_offset)   # draws a seed only for an accepted call
    return _BiasDropoutAddLayerNorm.apply(x, bias, residual, ln_weight, ln_bias, float(eps), spec, impl)
