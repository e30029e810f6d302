"""SwiGLU: ``silu(gate) * up`` on the concatenated output of the MLP's first projection.

Math (fp32, rounded once), on rows of ``gate_up = cat(gate, up)`` along the last dimension::

    y = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

``gate_up`` is each tensor-parallel rank's column-parallel output of a dense_h_to_4h whose rows are
"gate, then up", so both halves of a column pair live on one rank.

==============  ===========  =========================================
tensor          shape        dtype
==============  ===========  =========================================
gate_up         [..., 2n]    fp32 / fp16 / bf16
y               [..., n]     like gate_up
==============  ===========  =========================================

Saved for backward: gate_up only (an input: no new memory); silu is recomputed, never stored::

    sig = sigmoid(gate);  grad_gate = grad_y * up * sig * (1 + gate * (1 - sig));  grad_up = grad_y * silu(gate)

Backend interface (registered with :func:`seqpar.ops.registry.register`), on 2-D views with unit column
stride (any row stride)::

    forward(gate_up [rows, 2n]) -> y [rows, n]
    backward(grad_y [rows, n], gate_up) -> grad_gate_up [rows, 2n]

========  ========================================================  =====
backend   what runs                                                 n
========  ========================================================  =====
torch     fp32 reference (the test oracle, CPU fallback)            any
triton    ``triton_kernels/swiglu.py``: 2-D tiles                   any
cuda      ``csrc/swiglu.cu``: 16-byte vectors, grid-stride loop     any
========  ========================================================  =====

float64 inputs (for gradcheck) run on the torch backend, in float64. The kernel backends are
``torch.library`` custom ops (``seqpar::swiglu_{triton,cuda}_{fwd,bwd}``) with fake implementations, so
``torch.compile`` traces through them (eager calls run their launchers directly:
:func:`seqpar.ops.registry.kernel_op`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import registry
from .rows import as_rows, unflatten_rows, vectorized
from .. import _ext

#: The op's name in :mod:`seqpar.ops.registry`.
OP = "swiglu"


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(gate_up):
    gate, up = gate_up.to(registry.acc_dtype(gate_up.dtype)).chunk(2, dim=-1)
    return registry.cast(F.silu(gate) * up, gate_up.dtype)


def _torch_backward(grad_y, gate_up):
    acc = registry.acc_dtype(grad_y.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    dy = grad_y.to(acc)
    sig = torch.sigmoid(gate)
    grad_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = dy * F.silu(gate)
    return registry.cast(torch.cat([grad_gate, grad_up], dim=-1), grad_y.dtype)


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


def _fwd_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _bwd_fake(grad_y: torch.Tensor) -> torch.Tensor:
    return grad_y.new_empty((grad_y.shape[0], 2 * grad_y.shape[1]))


# ----------------------------------------------------------------------------- triton backend
@registry.kernel_op("seqpar::swiglu_triton_fwd")
def _triton_fwd_op(gate_up: torch.Tensor) -> torch.Tensor:
    from ..triton_kernels import swiglu as kernels

    with _ext.on_device(gate_up):
        return kernels.forward(gate_up)


@_triton_fwd_op.register_fake
def _(gate_up):
    return _fwd_fake(gate_up)


@registry.kernel_op("seqpar::swiglu_triton_bwd")
def _triton_bwd_op(grad_y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    from ..triton_kernels import swiglu as kernels

    with _ext.on_device(grad_y):
        return kernels.backward(grad_y, gate_up)


@_triton_bwd_op.register_fake
def _(grad_y, gate_up):
    return _bwd_fake(grad_y)


registry.register(registry.Backend(OP, "triton", _triton_fwd_op, _triton_bwd_op, registry.row_kernel_check))


# ----------------------------------------------------------------------------- cuda backend
def _row_stride(gate_up: torch.Tensor) -> int:
    """Row stride of [rows, 2n] (a single row's stride is arbitrary in torch: use the row length)."""
    return gate_up.stride(0) if gate_up.shape[0] > 1 else gate_up.shape[1]


@registry.kernel_op("seqpar::swiglu_cuda_fwd")
def _cuda_fwd_op(gate_up: torch.Tensor) -> torch.Tensor:
    ext = _ext.cuda_extension()
    y = _fwd_fake(gate_up)
    rows, n = y.shape
    ld = _row_stride(gate_up)
    with _ext.on_device(gate_up):
        ext.swiglu_fwd(gate_up.data_ptr(), y.data_ptr(), rows, n, ld, _ext.DTYPE_CODES[gate_up.dtype],
                       vectorized(gate_up.dtype, n, (gate_up, y), (ld,)), _ext.cuda_stream(gate_up.device))
    return y


@_cuda_fwd_op.register_fake
def _(gate_up):
    return _fwd_fake(gate_up)


@registry.kernel_op("seqpar::swiglu_cuda_bwd")
def _cuda_bwd_op(grad_y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    ext = _ext.cuda_extension()
    grad_y = grad_y.contiguous()
    grad = _bwd_fake(grad_y)
    rows, n = grad_y.shape
    ld = _row_stride(gate_up)
    with _ext.on_device(grad_y):
        ext.swiglu_bwd(grad_y.data_ptr(), gate_up.data_ptr(), grad.data_ptr(), rows, n, ld,
                       _ext.DTYPE_CODES[grad_y.dtype], vectorized(grad_y.dtype, n, (grad_y, gate_up, grad), (ld,)),
                       _ext.cuda_stream(grad_y.device))
    return grad


@_cuda_bwd_op.register_fake
def _(grad_y, gate_up):
    return _bwd_fake(grad_y)


registry.register(registry.Backend(OP, "cuda", _cuda_fwd_op, _cuda_bwd_op, registry.row_kernel_check))


# ----------------------------------------------------------------------------- autograd
class _SwiGLU(torch.autograd.Function):
    """On gate_up of any rank and layout: the ``[rows, 2n]`` view (or copy) is taken in here (grad mode
    off: no view or copy node in the autograd graph) and the gradient reshaped back."""

    @staticmethod
    def forward(ctx, gate_up, impl):
        shape = gate_up.shape
        rows = as_rows(gate_up, shape[-1])
        ctx.save_for_backward(rows)
        ctx.impl, ctx.shape = impl, shape
        y = impl.forward(rows)
        return y if len(shape) == 2 else unflatten_rows(y, (*shape[:-1], shape[-1] // 2))

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad_y):
        # A saved-tensor hook may unpack another layout of the same values (save_on_cpu and the like do
        # not, a hook of yours may): the kernels read unit column strides.
        rows = as_rows(ctx.saved_tensors[0], ctx.shape[-1])
        if len(ctx.shape) != 2:
            grad_y = grad_y.reshape(-1, ctx.shape[-1] // 2)
        grad = ctx.impl.backward(grad_y.contiguous(), rows)
        return (grad if len(ctx.shape) == 2 else grad.reshape(ctx.shape)), None


def swiglu(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``y = silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``, computed in fp32 (fp64 for
    fp64 input, which only the torch backend takes).

    ``gate_up`` is ``[..., 2n]`` (any layout: rows that can't be viewed as ``[rows, 2n]`` with unit column
    stride are copied first); returns ``[..., n]``. Only gate_up is saved for backward. ValueError for a
    gate_up that is not a floating tensor (fp32 / fp16 / bf16 / fp64), is sparse, or has an odd or zero
    last dimension, and for a backend that can't run it.

    Args:
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
    """
    if not isinstance(gate_up, torch.Tensor):
        raise ValueError(f"gate_up must be a tensor, got {type(gate_up).__name__}")
    registry.check_dense(gate_up=gate_up)
    if gate_up.dim() < 1 or gate_up.dtype not in registry.DTYPES:
        raise ValueError(f"gate_up must be a floating [..., 2n] tensor of {registry.DTYPES}, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    width = gate_up.shape[-1]
    if width == 0 or width % 2:
        raise ValueError(f"gate_up's last dimension must be even and positive (gate, then up), got {width}")
    impl = registry.select(OP, backend, gate_up.device, dtype=gate_up.dtype, rows=gate_up.numel() // width)
    return _SwiGLU.apply(gate_up, impl)
