"""Pieces shared by the row-wise Triton kernels (LayerNorm, RMSNorm, SwiGLU, RoPE): rounding under the
interpreter, the launch heuristics, the allocator every launcher uses, and the deterministic column
reduction of a backward pass.

Column sums without atomics: each backward program of a row kernel accumulates its rows into one fp32
partial row per summed quantity, written to ``partials[q, program, :]`` of an ``[n_buffers, n_partials, h]``
buffer; :func:`reduce_partials` then sums the partial rows of every buffer (``_reduce_partials_kernel``:
one program per column block, which sums that block of each of the ``N_BUFFERS`` buffers).

Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import functools
import os
from typing import List

import torch
import triton
import triton.language as tl

__all__ = ["cast_rne", "interpreting", "sm_count", "rows_per_block", "num_warps", "empty", "reduce_partials"]


@triton.jit
def cast_rne(v, dtype: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """``v.to(dtype)`` with round-to-nearest-even.

    The CPU interpreter truncates fp32 -> bf16 (and its "rtne" mode rounds ties away), so there the bf16
    rounding is done on the bits; on a GPU the native conversion already rounds to nearest even.
    """
    if MANUAL_BF16 and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors; launch policies pick few, fat programs)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def rows_per_block(n_rows: int, block_n: int, elements: int) -> int:
    """Rows per tile so a tile holds about ``elements`` values (power of two, at most n_rows rounded up)."""
    block_m = max(1, elements // block_n)
    return min(block_m, triton.next_power_of_2(max(n_rows, 1)))


def num_warps(tile_elements: int, cap: int) -> int:
    """About 8 fp32 values per thread per live tensor for the tile; clamped to [4, cap]."""
    return max(4, min(cap, triton.next_power_of_2(max(tile_elements // 256, 1))))


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the row-kernel launchers allocate (outputs and partial sums); tests poison it with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _sum_partial_rows(PART, OUT, cols, col_mask, n_partials, h, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PART + parts.to(tl.int64)[:, None] * h + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _reduce_partials_kernel(PARTS, OUT0, OUT1, OUT2, n_partials, h, N_BUFFERS: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Column block `pid` of each of the N_BUFFERS (1 to 3) partial buffers PARTS[q] ([n_partials, h]):
    # OUTq[cols] = sum over the partial rows.
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < h
    buffer = tl.cast(n_partials, tl.int64) * h
    _sum_partial_rows(PARTS, OUT0, cols, col_mask, n_partials, h, BLOCK_P, BLOCK_N)
    if N_BUFFERS > 1:
        _sum_partial_rows(PARTS + buffer, OUT1, cols, col_mask, n_partials, h, BLOCK_P, BLOCK_N)
    if N_BUFFERS > 2:
        _sum_partial_rows(PARTS + 2 * buffer, OUT2, cols, col_mask, n_partials, h, BLOCK_P, BLOCK_N)


def reduce_partials(partials: torch.Tensor) -> List[torch.Tensor]:
    """The column sums (fp32 [h] each, separate tensors) of contiguous fp32 partial rows
    ``[n_buffers, n_partials, h]``, n_buffers in 1 .. 3."""
    n_buffers, n_partials, h = partials.shape
    if not 1 <= n_buffers <= 3 or not partials.is_contiguous():
        raise ValueError(f"partials must be a contiguous [1..3, n_partials, h] buffer, got {tuple(partials.shape)}")
    outs = [empty((h,), torch.float32, partials.device) for _ in range(n_buffers)]
    if interpreting():  # one program: a few [n_partials, h] numpy sums
        block_n, block_p = triton.next_power_of_2(h), triton.next_power_of_2(n_partials)
    else:
        block_n, block_p = min(triton.next_power_of_2(h), 128), min(triton.next_power_of_2(n_partials), 32)
    padded = outs + [outs[0]] * (3 - n_buffers)          # unused pointer arguments
    _reduce_partials_kernel[(triton.cdiv(h, block_n),)](partials, *padded, n_partials, h, N_BUFFERS=n_buffers,
                                                        BLOCK_P=block_p, BLOCK_N=block_n)
    return outs
