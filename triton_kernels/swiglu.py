"""Triton kernels for SwiGLU (no autograd here).

On rows of ``gate_up = [gate | up]`` (2n columns; see :mod:`seqpar.ops.swiglu`), in fp32::

    y     = silu(gate) * up,  silu(g) = g / (1 + exp(-g))                         rounded once
    dgate = dy * up * sig * (1 + g * (1 - sig)),  sig = 1 / (1 + exp(-g))
    dup   = dy * silu(g)                                                          silu recomputed

==============  ===============  ===================================================
tensor          shape            layout
==============  ===============  ===================================================
gate_up         [rows, 2n]       fp32 / fp16 / bf16; unit column stride, any row stride
y               [rows, n]        like gate_up (contiguous)
grad_y          [rows, n]        contiguous
grad_gate_up    [rows, 2n]       like grad_y (contiguous): [dgate | dup]
==============  ===============  ===================================================

Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rows as R
from .rows import cast_rne

__all__ = ["forward", "backward"]


@triton.jit
def _tile(n_rows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _fwd_kernel(GU, Y, n_rows, n, stride_gu, MANUAL_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n, BLOCK_M, BLOCK_N)
    g = tl.load(GU + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + rows * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rows * n + cols, cast_rne(y, Y.dtype.element_ty, MANUAL_BF16), mask=mask)


@triton.jit
def _bwd_kernel(GY, GU, GGU, n_rows, n, stride_gu, MANUAL_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(n_rows, n, BLOCK_M, BLOCK_N)
    g = tl.load(GU + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + rows * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(GY + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    denom = 1.0 + tl.exp(-g)
    sig = 1.0 / denom
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    dup = dy * (g / denom)
    out = GGU + rows * (2 * n) + cols
    tl.store(out, cast_rne(dgate, GGU.dtype.element_ty, MANUAL_BF16), mask=mask)
    tl.store(out + n, cast_rne(dup, GGU.dtype.element_ty, MANUAL_BF16), mask=mask)


def _config(n_rows: int, n: int):
    if R.interpreting():  # few, fat programs: the interpreter's cost is per program
        block_n = triton.next_power_of_2(n)
        block_m = min(triton.next_power_of_2(max(n_rows, 1)), max(1, (1 << 15) // block_n))
        return block_m, block_n, {}
    block_n = min(triton.next_power_of_2(n), 1024)
    block_m = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 4096 // block_n))
    return block_m, block_n, {"num_warps": 8}


def _grid(n_rows: int, n: int, block_m: int, block_n: int):
    return (triton.cdiv(n_rows, block_m), triton.cdiv(n, block_n))


def forward(gate_up: torch.Tensor) -> torch.Tensor:
    """``y [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:]`` (a new contiguous tensor)."""
    n_rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = R.empty((n_rows, n), gate_up.dtype, gate_up.device)
    if n_rows == 0:
        return y
    block_m, block_n, launch = _config(n_rows, n)
    _fwd_kernel[_grid(n_rows, n, block_m, block_n)](
        gate_up, y, n_rows, n, gate_up.stride(0), MANUAL_BF16=R.interpreting(), BLOCK_M=block_m, BLOCK_N=block_n,
        **launch)
    return y


def backward(grad_y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``[dgate | dup]`` ``[rows, 2n]`` in grad_y's dtype (a new contiguous tensor)."""
    grad_y = grad_y.contiguous()
    n_rows, n = grad_y.shape
    grad = R.empty((n_rows, 2 * n), grad_y.dtype, grad_y.device)
    if n_rows == 0:
        return grad
    block_m, block_n, launch = _config(n_rows, n)
    _bwd_kernel[_grid(n_rows, n, block_m, block_n)](
        grad_y, gate_up, grad, n_rows, n, gate_up.stride(0), MANUAL_BF16=R.interpreting(), BLOCK_M=block_m,
        BLOCK_N=block_n, **launch)
    return grad
