"""What the row ops (a LayerNorm, RMSNorm or SwiGLU over the last dim h, and RoPE's launchers) share: the
``[rows, h]`` views their backends read, the checks of their arguments and the CUDA kernels' 16-byte
vector test."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import registry


def as_rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """``[rows, h]`` view of t (a copy only when its layout has none), with unit column stride: the layout
    every backend of a row op reads. Any row stride stays a view."""
    t2d = t if t.dim() == 2 else t.reshape(-1, h)
    return t2d if t2d.stride(-1) == 1 or t2d.shape[0] == 0 else t2d.contiguous()


def unflatten_rows(t2d: torch.Tensor, shape) -> torch.Tensor:
    """An autograd.Function's ``[rows, h]`` output as ``shape``, sharing its storage and version counter.
    Not a view to autograd (detached): a view created inside a custom Function could not be modified in
    place by the caller, and the op's outputs can (as before, when the view was taken outside)."""
    return t2d.view(*shape).detach()  # ints: cheaper to parse than a torch.Size


def vectorized(dtype: torch.dtype, h: int, tensors, strides=()) -> bool:
    """True when the kernels may use 16-byte accesses: aligned pointers, row starts on 16-byte boundaries."""
    vec = 16 // dtype.itemsize
    return (h % vec == 0 and all(s % vec == 0 for s in strides)
            and all(t.data_ptr() % 16 == 0 for t in tensors if t is not None))


def or_empty(grad_sum: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A kernel custom op's column sum: the launcher's None (not asked for) as an empty fp32 tensor on
    ``like``'s device, since a custom op can't return None."""
    return like.new_empty((0,), dtype=torch.float32) if grad_sum is None else grad_sum


def check_row_inputs(x, residual, weights: dict, eps, *, residual_optional: bool = False, on_device=()) -> int:
    """The checks every fused row op (a norm over the last dim h) runs on its arguments; returns h.

    ``x`` a floating [..., h] tensor of :data:`registry.DTYPES` with h > 0; ``residual`` (may be None when
    ``residual_optional``) of x's shape and dtype; each of ``weights`` ({name: tensor}) a floating [h]
    tensor; all of them and ``on_device`` on one device; ``eps`` as :func:`registry.check_eps` takes. A ValueError
    names the argument.
    """
    # Fast path (called on every op call): the common valid case in one pass. Whatever it doesn't accept
    # goes to _explain_row_inputs, the full checks, which raise the ValueError naming the argument (or
    # accept it after all: e.g. eps a float subclass).
    dense = torch.strided
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.dtype in registry.DTYPES and x.layout == dense and \
            type(eps) is float and registry.EPS_MIN <= eps < math.inf:
        shape, device = x.shape, x.device
        h = shape[-1]
        ok = h != 0 and ((residual is None and residual_optional) or (
            isinstance(residual, torch.Tensor) and residual.shape == shape and residual.dtype == x.dtype
            and residual.device == device and residual.layout == dense))
        for t in weights.values():
            ok = ok and isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == h and \
                t.is_floating_point() and t.device == device and t.layout == dense
        for t in on_device:
            ok = ok and isinstance(t, torch.Tensor) and t.device == device
        # (a DTensor is strided too: the full checks name it)
        ok = ok and not any(registry.is_dtensor(t) for t in (x, residual, *weights.values()))
        if ok:
            return h
    return _explain_row_inputs(x, residual, weights, eps, residual_optional, on_device)


#: Why x, residual and bias must share a dtype, and what to do (a linear's output under torch.autocast has
#: the autocast dtype, a residual stream kept in fp32 does not).
NOT_PROMOTED = ("(the fused ops promote nothing: cast one to the other's dtype; under "
                "torch.autocast a linear's output has the autocast dtype)")


def _explain_row_inputs(x, residual, weights: dict, eps, residual_optional: bool, on_device) -> int:
    """:func:`check_row_inputs`, one check at a time, each with its own ValueError."""
    named = {"x": x, **({} if residual is None and residual_optional else {"residual": residual}), **weights}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    registry.check_dense(**named)
    if x.dim() < 1 or x.dtype not in registry.DTYPES:
        raise ValueError(f"x must be a floating [..., h] tensor of {registry.DTYPES}, got {x.dtype} {tuple(x.shape)}")
    h = x.shape[-1]
    if h == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype} {NOT_PROMOTED}")
    for name, t in weights.items():
        if t.shape != (h,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating [{h}] tensor, got {tuple(t.shape)} {t.dtype}")
    devices = {t.device for t in (*named.values(), *on_device)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    registry.check_eps(eps)
    return h
