"""Triton kernels for the fused bias + dropout + residual-add + LayerNorm (no autograd here).

Math on a ``[rows, h]`` view (statistics in fp32; see :mod:`seqpar.ops.bias_dropout_add_layer_norm`)::

    keep[r, c]      = mask_byte(seed, row_offset + r, c) >= P        # seqpar.random's mask, P = round(p * 256)
    residual_out    = residual + where(keep, (x + bias) * scale, 0)  # scale = float32(256 / (256 - P))
    x_hat           = (residual_out - mean) * rstd                    # of the *rounded* residual_out
    y               = x_hat * ln_weight + ln_bias

Backward, per row (g = grad_y * ln_weight)::

    grad_residual   = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + grad_residual_out
    grad_x          = where(keep, grad_residual * scale, 0)
    grad_ln_weight  = sum_rows(grad_y * x_hat),  grad_ln_bias = sum_rows(grad_y),  grad_bias = sum_rows(grad_x)

The column sums are reduced without atomics (the CPU interpreter runs programs one after another):
each backward program accumulates its rows into an fp32 partial row of ``[n_partials, h]`` buffers,
and a second small kernel sums the partial rows.

==================  ===============  =============================================
tensor              shape            dtype
==================  ===============  =============================================
x, residual         [rows, h]        fp32 / fp16 / bf16 (the same); last dim contiguous
bias                [h] or None      like x
ln_weight, ln_bias  [h]              any floating dtype (read as fp32)
y, residual_out     [rows, h]        like x (contiguous)
mean, rstd          [rows]           fp32
grad_x, grad_res    [rows, h]        like grad_y
grad_ln_*, g_bias   [h]              fp32
==================  ===============  =============================================

Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..random import dropout_scale
from .philox import keep_mask

__all__ = ["forward", "backward", "MAX_HIDDEN"]

# One row must fit in one block of the forward kernel: the whole row stays in registers.
MAX_HIDDEN = 16384


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _cast(v, dtype: tl.constexpr, MANUAL_BF16: tl.constexpr):
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


@triton.jit(do_not_specialize=["threshold", "seed", "row_offset"])
def _fwd_kernel(X, BIAS, RES, W, B, Y, RES_OUT, MEAN, RSTD,
                n_rows, h, stride_x, stride_res,
                eps, threshold, scale, seed, row_offset,
                HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MANUAL_BF16: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalises BLOCK_M whole rows (BLOCK_M = 1 for wide rows on a GPU).
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < h
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)  # rows * stride can pass 2**31 for large activations

    a = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        # Global rows, whole 16-column groups (BLOCK_N >= 16): bit for bit seqpar.random.dropout_keep_mask.
        keep = keep_mask(seed, rows64 + row_offset, 0, threshold, BLOCK_M, BLOCK_N, False, False)
        a = tl.where(keep, a * scale, 0.0)
    res = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r_store = _cast(res + a, RES_OUT.dtype.element_ty, MANUAL_BF16)
    tl.store(RES_OUT + rows64[:, None] * h + cols[None, :], r_store, mask=mask)

    # Statistics of the stored (rounded) residual_out, which is what backward sees.
    r = r_store.to(tl.float32)
    mean = tl.sum(r, axis=1) / h
    d = tl.where(mask, r - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / h
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows64[:, None] * h + cols[None, :], _cast(y, Y.dtype.element_ty, MANUAL_BF16), mask=mask)


@triton.jit
def _row_sums(GY, RO, W, offs_row, cols, mask, w, mean, rstd):
    """x_hat, g = grad_y * w, and the row sums sum(g), sum(g * x_hat) of one [BLOCK_M, BLOCK_N] chunk."""
    r = tl.load(RO + offs_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_hat = tl.where(mask, (r - mean[:, None]) * rstd[:, None], 0.0)
    gy = tl.load(GY + offs_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = gy * w[None, :]
    return x_hat, gy, g, tl.sum(g, axis=1), tl.sum(g * x_hat, axis=1)


@triton.jit(do_not_specialize=["threshold", "seed", "row_offset"])
def _bwd_kernel(GY, GRO, RO, W, MEAN, RSTD, GX, GRES, PART_W, PART_B, PART_BIAS,
                n_rows, h, rows_per_program, threshold, scale, seed, row_offset,
                HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MANUAL_BF16: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_CHUNKS: tl.constexpr):
    # Program (pid, chunk) owns rows [pid * rows_per_program, ...) and columns [chunk * BLOCK_N, ...) of
    # them, and writes those columns of row `pid` of the partial buffers. Its registers hold BLOCK_N
    # columns (three fp32 running sums each): rows wider than that are split over N_CHUNKS programs, each
    # of which streams the row's other chunks for the row sums (read again from L2: the chunk programs of
    # one row range run side by side).
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < h
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)

    acc_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_bias = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        offs_row = rows.to(tl.int64)[:, None] * h
        offs = offs_row + cols[None, :]
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        x_hat, gy, g, sum_g, sum_gx = _row_sums(GY, RO, W, offs_row, cols, mask, w, mean, rstd)
        if N_CHUNKS > 1:  # the other chunks of the rows, for the row sums only
            sum_g = tl.zeros([BLOCK_M], dtype=tl.float32)
            sum_gx = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c in tl.static_range(N_CHUNKS):
                c_cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
                c_mask = row_mask[:, None] & (c_cols < h)[None, :]
                c_w = tl.load(W + c_cols, mask=c_cols < h, other=0.0).to(tl.float32)
                _, _, _, c_g, c_gx = _row_sums(GY, RO, W, offs_row, c_cols, c_mask, c_w, mean, rstd)
                sum_g += c_g
                sum_gx += c_gx
        acc_w += gy * x_hat
        acc_b += gy

        c_gx = sum_gx / h
        c_g = sum_g / h
        gro = tl.load(GRO + offs, mask=mask, other=0.0).to(tl.float32)
        g_res = rstd[:, None] * (g - c_g[:, None] - x_hat * c_gx[:, None]) + gro
        g_res = tl.where(mask, g_res, 0.0)
        tl.store(GRES + offs, _cast(g_res, GRES.dtype.element_ty, MANUAL_BF16), mask=mask)
        if HAS_DROPOUT:
            keep = keep_mask(seed, rows.to(tl.int64) + row_offset, chunk * BLOCK_N, threshold, BLOCK_M, BLOCK_N,
                             False, False)
            g_x = tl.where(keep, g_res * scale, 0.0)
        else:
            g_x = g_res
        tl.store(GX + offs, _cast(g_x, GX.dtype.element_ty, MANUAL_BF16), mask=mask)
        if HAS_BIAS:
            acc_bias += g_x

    part = pid.to(tl.int64) * h + cols
    tl.store(PART_W + part, tl.sum(acc_w, axis=0), mask=col_mask)
    tl.store(PART_B + part, tl.sum(acc_b, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(PART_BIAS + part, tl.sum(acc_bias, axis=0), mask=col_mask)


@triton.jit
def _reduce_partials_kernel(PART_W, PART_B, PART_BIAS, DW, DB, DBIAS, n_partials, h,
                            HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Column block `pid`: sum the n_partials partial rows of each of the three buffers.
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < h
    acc_w = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_bias = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        offs = parts.to(tl.int64)[:, None] * h + cols[None, :]
        acc_w += tl.load(PART_W + offs, mask=mask, other=0.0)
        acc_b += tl.load(PART_B + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc_bias += tl.load(PART_BIAS + offs, mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc_w, axis=0), mask=col_mask)
    tl.store(DB + cols, tl.sum(acc_b, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DBIAS + cols, tl.sum(acc_bias, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- launch policy
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_n(h: int) -> int:
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"hidden size h={h} is outside the Triton kernel's range [1, {MAX_HIDDEN}]")
    return max(16, triton.next_power_of_2(h))  # the dropout mask comes in whole 16-column groups


def _rows_per_block(n_rows: int, block_n: int, elements: int) -> int:
    """Rows per tile so a tile holds about ``elements`` values (power of two, at most n_rows rounded up)."""
    block_m = max(1, elements // block_n)
    return min(block_m, triton.next_power_of_2(max(n_rows, 1)))


def _num_warps(tile_elements: int, cap: int) -> int:
    # About 8 fp32 values per thread per live tensor for the tile; clamp to [4, cap].
    return max(4, min(cap, triton.next_power_of_2(max(tile_elements // 256, 1))))


def _fwd_config(n_rows: int, h: int):
    block_n = _block_n(h)
    if _interpreting():
        # Fewer, fatter programs: the interpreter's cost is per program, numpy vectorises the tile.
        block_m = _rows_per_block(n_rows, block_n, 1 << 15)
        return block_m, block_n, {}
    block_m = _rows_per_block(n_rows, block_n, 4096)
    # No FMA contraction: residual + dropped must round exactly like the torch reference (bitwise
    # identical residual_out across backends); the kernel is memory bound, so this costs nothing.
    return block_m, block_n, {"num_warps": _num_warps(block_m * block_n, 16), "enable_fp_fusion": False}


# Columns of one backward program: 8 per thread at 16 warps, so its three fp32 running sums (24 registers)
# and the working set fit the 128 registers a 512-thread program may use. With a whole 8192- or
# 16384-wide row per program (32 warps: at most 64 registers) ptxas spilled 130-1500 bytes per thread.
BWD_BLOCK_N = 4096


def _bwd_config(n_rows: int, h: int, device: torch.device):
    """(BLOCK_M, BLOCK_N, N_CHUNKS, programs per chunk, rows per program, launch options)."""
    row_n = _block_n(h)
    block_n = min(row_n, BWD_BLOCK_N)
    if _interpreting():  # few fat programs: the interpreter's cost is per program
        block_m = _rows_per_block(n_rows, block_n, 1 << 14)
        max_programs, launch = 4, {}
    else:
        block_m = _rows_per_block(n_rows, block_n, 2048)
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        max_programs = max(1, 4 * sms // (row_n // block_n))
        launch = {"num_warps": _num_warps(block_m * block_n, 16)}
    tiles = triton.cdiv(max(n_rows, 1), block_m)
    programs = min(tiles, max_programs)
    rows_per_program = triton.cdiv(tiles, programs) * block_m
    programs = triton.cdiv(max(n_rows, 1), rows_per_program)
    return block_m, block_n, row_n // block_n, programs, rows_per_program, launch


# ----------------------------------------------------------------------------- launchers
def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the launchers allocate (outputs and partial sums); tests poison it with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def _drop_args(drop_threshold: int, seed: int, row_offset: int):
    """Kernel arguments (threshold, scale, seed, row_offset) and whether dropout is on."""
    if not isinstance(drop_threshold, int) or not 0 <= drop_threshold < 256:
        raise ValueError(f"dropout threshold P must be an int in [0, 256), got {drop_threshold!r}")
    if drop_threshold == 0:
        return (0, 1.0, 0, 0), False
    return (drop_threshold, dropout_scale(drop_threshold), int(seed), int(row_offset)), True


def forward(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, ln_weight: torch.Tensor,
            ln_bias: torch.Tensor, eps: float, drop_threshold: int, seed: int, row_offset: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on 2-D ``[rows, h]`` inputs with unit column stride.

    ``drop_threshold`` is the dropout byte threshold P = round(p * 256) (:mod:`seqpar.random`); 0
    disables dropout (then ``seed`` / ``row_offset`` are ignored). Returns
    ``(y, residual_out, mean, rstd)``; y and residual_out are new contiguous tensors.
    """
    n_rows, h = x.shape
    y = _empty((n_rows, h), x.dtype, x.device)
    residual_out = _empty((n_rows, h), residual.dtype, x.device)
    mean = _empty((n_rows,), torch.float32, x.device)
    rstd = _empty((n_rows,), torch.float32, x.device)
    if n_rows == 0:
        return y, residual_out, mean, rstd
    block_m, block_n, launch = _fwd_config(n_rows, h)
    drop_args, has_dropout = _drop_args(drop_threshold, seed, row_offset)
    _fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x, x if bias is None else bias, residual, ln_weight.contiguous(), ln_bias.contiguous(),
        y, residual_out, mean, rstd,
        n_rows, h, x.stride(0), residual.stride(0), float(eps), *drop_args,
        HAS_BIAS=bias is not None, HAS_DROPOUT=has_dropout, MANUAL_BF16=_interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, **launch)
    return y, residual_out, mean, rstd


def backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor,
             ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, drop_threshold: int, seed: int,
             row_offset: int, has_bias: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward on 2-D ``[rows, h]`` gradients (made contiguous).

    Returns ``(grad_x, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias)``: grad_x and
    grad_residual in grad_y's dtype; the three column sums in fp32 (grad_bias is zeros when
    ``has_bias`` is False).
    """
    grad_y, grad_residual_out = grad_y.contiguous(), grad_residual_out.contiguous()
    residual_out = residual_out.contiguous()
    n_rows, h = grad_y.shape
    device = grad_y.device
    grad_x = _empty((n_rows, h), grad_y.dtype, device)
    grad_res = _empty((n_rows, h), grad_y.dtype, device)
    grad_w = _empty((h,), torch.float32, device)
    grad_b = _empty((h,), torch.float32, device)
    grad_bias = _empty((h,), torch.float32, device)
    if n_rows == 0:
        return grad_x, grad_bias.zero_(), grad_res, grad_w.zero_(), grad_b.zero_()
    if not has_bias:
        grad_bias.zero_()
    block_m, block_n, n_chunks, programs, rows_per_program, launch = _bwd_config(n_rows, h, device)
    partials = _empty((3 if has_bias else 2, programs, h), torch.float32, device)
    part_bias = partials[2] if has_bias else partials[1]
    drop_args, has_dropout = _drop_args(drop_threshold, seed, row_offset)
    _bwd_kernel[(programs, n_chunks)](
        grad_y, grad_residual_out, residual_out, ln_weight.contiguous(), mean, rstd, grad_x, grad_res,
        partials[0], partials[1], part_bias,
        n_rows, h, rows_per_program, *drop_args,
        HAS_BIAS=has_bias, HAS_DROPOUT=has_dropout, MANUAL_BF16=_interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, N_CHUNKS=n_chunks, **launch)
    if _interpreting():  # one program: a few [programs, h] numpy sums
        red_n, red_p = block_n * n_chunks, triton.next_power_of_2(programs)
    else:
        red_n, red_p = min(block_n, 128), min(triton.next_power_of_2(programs), 32)
    _reduce_partials_kernel[(triton.cdiv(h, red_n),)](
        partials[0], partials[1], part_bias, grad_w, grad_b, grad_bias, programs, h,
        HAS_BIAS=has_bias, BLOCK_P=red_p, BLOCK_N=red_n)
    return grad_x, grad_bias, grad_res, grad_w, grad_b
