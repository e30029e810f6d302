"""Triton kernel for rows-dropout with a regenerated mask (no autograd here): the Triton twin of
csrc/dropout.cu and of the torch reference in :func:`seqpar.ops.dropout.apply_keep_mask`, optionally with
a bias before the mask and a residual after it (:func:`seqpar.ops.bias_dropout_add` in one pass).

On ``x`` viewed as ``[rows, h]`` (P = round(p * 256) in [1, 256); see :mod:`seqpar.random`)::

    keep[r, c] = mask_byte(seed, row_offset + r, c) >= P     # triton_kernels/philox.py's keep_mask
    a[r, c]    = round(x + bias[c])                          # with a bias; else a = x
    d[r, c]    = round(where(keep, a * scale, 0))            # scale = float32(256 / (256 - P))
    out[r, c]  = round(residual + d)                         # with a residual; else out = d

in fp32, each ``round`` to x's dtype (RNE; none in fp32): where the torch reference
``residual + dropout(x + bias)`` rounds its three separate results, so the values are bit for bit the
reference's and the CUDA kernel's (no FMA contraction of ``a * scale + residual``). A dropped element
adds exactly 0, even an inf or NaN ``x + bias`` (a select, not a multiply by the mask). The backward of
dropout is the plain kernel on the gradient. Without bias and residual (constexpr flags) the kernel is
the plain dropout kernel, compiled as before.

==============  ===============  ==============================================
tensor          shape            dtype
==============  ===============  ==============================================
x               [..., h]         fp32 / fp16 / bf16; contiguous (rows of h)
bias            [h] or None      like x; contiguous
residual        like x, or None  like x; contiguous
out             like x           like x (contiguous)
==============  ===============  ==============================================

Program (i, j) covers rows ``i * BLOCK_M ..`` and columns ``j * BLOCK_N ..`` (BLOCK_N >= 16, a power of
two: whole 16-column groups, one Philox call each, drawn in the tile's own layout).
Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..random import dropout_scale
from . import rows as R
from .philox import keep_mask
from .rows import cast_rne

__all__ = ["dropout_rows", "DTYPES", "BLOCK_COLUMNS", "TILE_ELEMENTS"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widest column block, and the elements of one tile on a GPU: a memory-bound elementwise pass, 16 values
# per thread at 8 warps (two or four 16-byte accesses each), as the SwiGLU kernels.
BLOCK_COLUMNS = 1024
TILE_ELEMENTS = 4096
NUM_WARPS = 8
MAX_SEED = 2**62   # the bound of seed and row_offset, as seqpar.ops.dropout.DropoutSpec checks them


@triton.jit(do_not_specialize=["threshold", "seed", "row_offset"])
def _dropout_kernel(X, BIAS, RES, OUT, n_rows, h, threshold, scale, seed, row_offset, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, MANUAL_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # rows * h can pass 2**31
    col_start = tl.program_id(1) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < h)[None, :]
    offs = rows[:, None] * h + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        # x + bias rounded to the dtype, as the torch reference's separate add stores it
        b = tl.load(BIAS + cols, mask=cols < h, other=0.0).to(tl.float32)
        x = cast_rne(x + b[None, :], OUT.dtype.element_ty, MANUAL_BF16).to(tl.float32)
    # Global rows, whole 16-column groups from col_start (a multiple of 16): seqpar.random's mask, drawn in
    # the tile's layout, where a group's 16-byte vectors sit with 2 (fp16 / bf16) or 4 (fp32) threads that
    # each draw it. SHARED_GROUPS (one draw per group, its word moved through shared memory) cut the mask's
    # integer instructions from 10 to 7.75 per element on sm_90a (bf16), but with three barriers and only 5%
    # fewer instructions in all: not taken.
    keep = keep_mask(seed, rows + row_offset, col_start, threshold, BLOCK_M, BLOCK_N, False, False)
    out = cast_rne(tl.where(keep, x * scale, 0.0), OUT.dtype.element_ty, MANUAL_BF16)
    if HAS_RESIDUAL:
        # the dropped value rounded, then residual + it rounded again: the torch reference's two roundings
        # (the launch turns FMA contraction off, so x * scale + residual is not one fused rounding in fp32)
        res = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        out = cast_rne(res + out.to(tl.float32), OUT.dtype.element_ty, MANUAL_BF16)
    tl.store(OUT + offs, out, mask=mask)


def _config(n_rows: int, h: int, has_residual: bool):
    """(BLOCK_M, BLOCK_N, launch options)."""
    block_n = max(16, triton.next_power_of_2(h))          # the mask comes in whole 16-column groups
    if R.interpreting():  # few, fat programs: the interpreter's cost is per program
        return R.rows_per_block(n_rows, block_n, 1 << 15), block_n, {}
    block_n = min(block_n, BLOCK_COLUMNS)
    launch = {"num_warps": NUM_WARPS}
    if has_residual:
        # No FMA contraction: residual + the dropped value must round twice, as the torch reference does
        # (bitwise equal across backends; the kernel is memory bound). Plain dropout has no add to contract
        # and keeps its options (the same binary as before the fused variant).
        launch["enable_fp_fusion"] = False
    return R.rows_per_block(n_rows, block_n, TILE_ELEMENTS), block_n, launch


def dropout_rows(x: torch.Tensor, seed: int, row_offset: int, threshold: int,
                 bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[residual +] where(keep, (x [+ bias]) * scale, 0)`` of a contiguous ``x`` [..., h] viewed as rows of
    h, with the mask of global rows ``row_offset ..`` of stream ``seed`` at byte threshold ``threshold``
    (P in [1, 256)); each step rounded to x's dtype as the torch reference rounds it. ``bias`` [h] and
    ``residual`` (x's shape) are optional, contiguous, of x's dtype and device. Returns a new contiguous
    tensor of x's shape and dtype; ValueError for anything else."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or x.dim() < 1 or not x.is_contiguous():
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a contiguous fp32 / fp16 / bf16 [..., h] tensor, got {got}")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold < 256:
        raise ValueError(f"dropout threshold P must be an int in [1, 256), got {threshold!r}")
    for name, value in (("seed", seed), ("row_offset", row_offset)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
            raise ValueError(f"{name} must be an int in [0, 2**62), got {value!r}")
    for name, t, shape in (("bias", bias, x.shape[-1:]), ("residual", residual, x.shape)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == x.dtype
                                  and t.device == x.device and t.is_contiguous()):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a contiguous {list(shape)} tensor of x's {x.dtype} on {x.device}, "
                             f"got {got}")
    out = R.empty(x.shape, x.dtype, x.device)
    h = x.shape[-1]
    n_rows = x.numel() // h if h else 0
    if n_rows == 0:
        return out
    block_m, block_n, launch = _config(n_rows, h, residual is not None)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(h, block_n))
    if grid[1] > 65535:   # CUDA's grid y limit
        raise ValueError(f"h = {h} is too wide: at most {65535 * block_n} columns")
    _dropout_kernel[grid](x, x if bias is None else bias, x if residual is None else residual, out, n_rows, h,
                          threshold, dropout_scale(threshold), seed, row_offset, HAS_BIAS=bias is not None,
                          HAS_RESIDUAL=residual is not None, MANUAL_BF16=R.interpreting(), BLOCK_M=block_m,
                          BLOCK_N=block_n, **launch)
    return out
