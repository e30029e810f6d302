"""Fused bias + dropout + residual-add + LayerNorm.

Math (rows of the last dimension h; statistics in fp32)::

    residual_out = residual + dropout_p(x + bias)          # bias may be None
    y            = (residual_out - mean) * rstd * ln_weight + ln_bias
    mean, rstd   = mean(residual_out), 1 / sqrt(var(residual_out) + eps)

==============  ===========  =========================================
tensor          shape        dtype
==============  ===========  =========================================
x, residual     [..., h]     fp32 / fp16 / bf16 (the same)
bias            [h] or None  like x
ln_weight/bias  [h]          any floating dtype
y               [..., h]     like x
residual_out    [..., h]     like residual
==============  ===========  =========================================

Saved for backward: residual_out and per-row fp32 mean / rstd; the dropout mask is regenerated.

Backend interface (registered with :func:`seqpar.ops.registry.register`), on 2-D ``[rows, h]`` views::

    forward(x, bias, residual, ln_weight, ln_bias, eps, spec) -> (y, residual_out, mean, rstd)
    backward(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, spec, has_bias)
        -> (grad_x, grad_bias or None, grad_residual, grad_ln_weight, grad_ln_bias)

``grad_residual_out`` is the gradient arriving at the residual_out output (zeros when unused).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import registry
from .dropout import DropoutSpec, apply_keep_mask, make_dropout_spec

OP = "bias_dropout_add_layer_norm"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(x, bias, residual, ln_weight, ln_bias, eps: float, spec: DropoutSpec):
    h = x.float() if bias is None else x.float() + bias.float()
    residual_out = (residual.float() + apply_keep_mask(h, spec)).to(residual.dtype)
    r = residual_out.float()  # statistics of the stored (rounded) residual keep backward consistent
    mean = r.mean(dim=1)
    rstd = torch.rsqrt((r - mean[:, None]).square().mean(dim=1) + eps)
    y = (r - mean[:, None]) * rstd[:, None] * ln_weight.float() + ln_bias.float()
    return y.to(x.dtype), residual_out, mean, rstd


def _torch_backward(grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd,
                    spec: DropoutSpec, has_bias: bool):
    x_hat = (residual_out.float() - mean[:, None]) * rstd[:, None]
    gy = grad_y.float()
    grad_ln_weight = (gy * x_hat).sum(dim=0)
    grad_ln_bias = gy.sum(dim=0)
    g = gy * ln_weight.float()
    grad_r = rstd[:, None] * (g - g.mean(dim=1, keepdim=True) - x_hat * (g * x_hat).mean(dim=1, keepdim=True))
    grad_r = grad_r + grad_residual_out.float()
    grad_h = apply_keep_mask(grad_r, spec)
    grad_bias = grad_h.sum(dim=0) if has_bias else None
    return grad_h, grad_bias, grad_r, grad_ln_weight, grad_ln_bias


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


# ----------------------------------------------------------------------------- autograd
class _BiasDropoutAddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, ln_weight, ln_bias, eps, spec, impl):
        y, residual_out, mean, rstd = impl.forward(x, bias, residual, ln_weight, ln_bias, eps, spec)
        ctx.save_for_backward(residual_out, ln_weight, mean, rstd)
        ctx.spec, ctx.impl = spec, impl
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype,
                      ln_weight.dtype, ln_bias.dtype)
        return y, residual_out

    @staticmethod
    def backward(ctx, grad_y, grad_residual_out):
        residual_out, ln_weight, mean, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(residual_out)
        if grad_residual_out is None:
            grad_residual_out = torch.zeros_like(residual_out)
        grads = ctx.impl.backward(grad_y.contiguous(), grad_residual_out.contiguous(), residual_out,
                                  ln_weight, mean, rstd, ctx.spec, ctx.dtypes[1] is not None)
        grads = tuple(None if g is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes))
        return grads + (None, None, None)


def _check_inputs(x, bias, residual, ln_weight, ln_bias) -> int:
    for name, t in (("x", x), ("residual", residual), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a floating [..., h] tensor of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    h = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
    if bias is not None and (bias.shape != (h,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{h}] of {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.shape != (h,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating [{h}] tensor, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("x", x), ("residual", residual)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    devices = {t.device for t in (x, residual, ln_weight, ln_bias) + (() if bias is None else (bias,))}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return h


def bias_dropout_add_layer_norm(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                                ln_weight: torch.Tensor, ln_bias: torch.Tensor, *, p: float = 0.0,
                                eps: float = 1e-5, training: bool = True, seed: Optional[int] = None,
                                backend: str = "auto", row_offset: int = 0
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = residual + dropout_p(x + bias)``; ``y = LayerNorm(residual_out)``.

    Returns ``(y, residual_out)``; gradients flow to x, bias, residual, ln_weight and ln_bias.

    Args:
        p: dropout probability in [0, 1) (ignored when ``training`` is False).
        seed: dropout stream seed (int in [0, 2**62)); None draws one from :func:`seqpar.manual_seed`'s
            generator.
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
        row_offset: global index of the first row (flattened leading dims) in the dropout RNG, so a
            sequence shard draws the same mask as the unsharded tensor would (design.md 4).
    """
    h = _check_inputs(x, bias, residual, ln_weight, ln_bias)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    spec = make_dropout_spec(p, training, seed, row_offset)
    impl = registry.select(OP, backend, x.device, x=x, h=h)
    shape = x.shape
    y, residual_out = _BiasDropoutAddLayerNorm.apply(
        x.reshape(-1, h), bias, residual.reshape(-1, h), ln_weight, ln_bias, float(eps), spec, impl)
    return y.view(shape), residual_out.view(shape)
