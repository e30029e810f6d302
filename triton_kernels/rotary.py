"""Triton kernel for rotary position embeddings ("rotate half", HF Llama's default; no autograd here).

For a head ``x = [x1 | x2]`` (halves of d) at sequence row i (see :mod:`seqpar.ops.rotary`)::

    angle_j   = float(position_offset + i) * inv_freq_j                      j < d / 2, fp32
    out[:d/2] = x1 * cos(angle) - x2 * sin(angle)
    out[d/2:] = x2 * cos(angle) + x1 * sin(angle)

The backward is the same rotation by -angle (``inverse=True``: sin -> -sin). Evaluated in fp32 in HF's
order (no FMA contraction), rounded once.

==============  ================  ================================================================
tensor          shape             layout
==============  ================  ================================================================
x (q or k)      [s, b, H, d]      any element strides, unit stride along d (views of a fused QKV)
out             [s, b, H, d]      any strides, unit along d; may be x itself (in place)
inv_freq        [d / 2]           fp32
==============  ================  ================================================================

A program covers one sequence row and BLOCK_R of its b * H heads: cos / sin of the row's angles are
computed once per program. Only core ``tl`` ops are used (runs under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rows as R
from .rows import cast_rne

__all__ = ["rotate"]


@triton.jit(do_not_specialize=["position_offset"])
def _rope_kernel(X, OUT, INV_FREQ, n_rows, heads, half, position_offset,
                 stride_xs, stride_xb, stride_xh, stride_os, stride_ob, stride_oh,
                 SIGN: tl.constexpr, MANUAL_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # sequence row
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < half
    inv_freq = tl.load(INV_FREQ + cols, mask=col_mask, other=0.0)
    angle = (i + position_offset).to(tl.float32) * inv_freq  # HF: position_ids.float() * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle) * SIGN

    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (batch, head) index
    row_mask = rows < n_rows
    bi = (rows // heads).to(tl.int64)
    hi = (rows % heads).to(tl.int64)
    x_off = (i * stride_xs + bi * stride_xb + hi * stride_xh)[:, None] + cols[None, :]
    o_off = (i * stride_os + bi * stride_ob + hi * stride_oh)[:, None] + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(OUT + o_off, cast_rne(o1, OUT.dtype.element_ty, MANUAL_BF16), mask=mask)
    tl.store(OUT + o_off + half, cast_rne(o2, OUT.dtype.element_ty, MANUAL_BF16), mask=mask)


# CUDA's limit on a grid's second axis (gridDim.y), which counts the programs' blocks of BLOCK_R rows.
MAX_ROW_BLOCKS = 65535


def _config(n_rows: int, half: int):
    block_d = triton.next_power_of_2(half)
    if R.interpreting():  # one program per sequence row: the interpreter's cost is per program
        return triton.next_power_of_2(max(n_rows, 1)), block_d, {}
    # 1024 elements of each half per 4-warp program: 48 registers, where [64, 64] tiles take 212.
    block_r = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 1024 // block_d))
    # No FMA contraction: x1 * cos - x2 * sin rounds like HF's (q * cos) + (rotate_half(q) * sin).
    return block_r, block_d, {"num_warps": 4, "enable_fp_fusion": False}


def rotate(x: torch.Tensor, out: torch.Tensor, inv_freq: torch.Tensor, position_offset: int,
           inverse: bool = False) -> torch.Tensor:
    """Write the rotation of ``x`` ``[s, b, H, d]`` into ``out`` (same shape; may be ``x``) and return out.

    ``inv_freq`` is the fp32 ``[d / 2]`` frequency vector on x's device; ``inverse`` rotates by -angle.
    """
    s, b, heads, d = x.shape
    n_rows, half = b * heads, d // 2
    if x.numel() == 0:
        return out
    block_r, block_d, launch = _config(n_rows, half)
    # The grid's second axis (row blocks) holds at most MAX_ROW_BLOCKS: a larger b takes several launches.
    step = b if triton.cdiv(n_rows, block_r) <= MAX_ROW_BLOCKS else (MAX_ROW_BLOCKS * block_r) // heads
    if step < 1:
        raise ValueError(f"rotary_embedding: {heads} heads is too many for one launch of the Triton kernel")
    for b0 in range(0, b, step):
        x_part, out_part = x[:, b0:b0 + step], out[:, b0:b0 + step]
        rows = x_part.shape[1] * heads
        _rope_kernel[(s, triton.cdiv(rows, block_r))](
            x_part, out_part, inv_freq, rows, heads, half, int(position_offset),
            x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
            SIGN=-1.0 if inverse else 1.0, MANUAL_BF16=R.interpreting(), BLOCK_R=block_r, BLOCK_D=block_d, **launch)
    return out
