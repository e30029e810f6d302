"""Triton kernels for the fused residual add + RMSNorm (no autograd here).

Math on a ``[rows, h]`` view (statistics in fp32; see :mod:`seqpar.ops.rms_norm`)::

    residual_out = x + residual                     # rounded to x's dtype; no residual: residual_out = x
    rstd         = 1 / sqrt(mean(residual_out^2) + eps)
    y            = round(round(residual_out * rstd) * weight)     # HF LlamaRMSNorm's rounding

Backward, per row (n = residual_out * rstd, g = grad_y * weight)::

    grad_x = grad_residual = rstd * (g - n * mean(g * n)) + grad_residual_out    # grad_residual on request
    grad_weight            = sum_rows(grad_y * n)

A row of up to ``MAX_FUSED_HIDDEN`` (forward) / ``MAX_FUSED_HIDDEN_BWD`` (backward) columns is held in one
program's registers. A longer row (any h is accepted) is covered in chunks of ``CHUNK_COLUMNS``: the forward
makes a second pass over the chunks, reading back the residual_out it has just written; the backward first
computes the row sums mean(g * n) in a row-sum pass (``_bwd_row_sums_kernel``; it reads grad_y and
residual_out once more), then runs one program per (row range, column chunk) with no reduction in its row
loop, as the LayerNorm backward does. The column sums are reduced without atomics, like the LayerNorm
kernels: each backward program writes its columns of one fp32 partial row of a ``[n_partials, h]`` buffer
and :func:`triton_kernels.rows.reduce_partials` sums the partial rows.

==================  ===============  =============================================
tensor              shape            dtype
==================  ===============  =============================================
x, residual         [rows, h]        fp32 / fp16 / bf16 (the same); last dim contiguous
weight              [h]              any floating dtype (read as fp32)
y, residual_out     [rows, h]        like x (contiguous)
rstd                [rows]           fp32
grad_x              [rows, h]        like grad_y (contiguous)
grad_weight         [h]              fp32
==================  ===============  =============================================

Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import rows as R
from .rows import cast_rne

__all__ = ["forward", "backward", "MAX_FUSED_HIDDEN", "MAX_FUSED_HIDDEN_BWD", "CHUNK_COLUMNS",
           "BWD_ELEMENTS_PER_THREAD"]

# Longest row held in one program's registers (forward, backward: the backward holds more per column, and a
# whole row of 8192 took one 1024-thread program per SM, each row's loads, reduction and stores in series;
# wider rows take the row-sum pass, as in the LayerNorm backward); longer rows are covered in chunks of at
# most CHUNK_COLUMNS. Read at launch time (tests lower them to exercise the chunked kernels on small rows).
MAX_FUSED_HIDDEN = 16384
MAX_FUSED_HIDDEN_BWD = 4096
CHUNK_COLUMNS = 4096
# Elements per thread of a backward tile that is one row of 4096 columns (whole rows of h = 4096, the
# 4096-column chunks of h = 8192 / 12288 / 16384; R.chunk_columns cuts widths such as 5120 / 6144 into
# narrower chunks, tiles of several rows): 8, 16 warps. Measured on the H200 (508368d, bf16, 16384 rows,
# backward GPU time) against 4 (32 warps, shipped until then): 0.184 / 0.237 ms at h = 4096 (56 registers
# against 37: two 512-thread programs per SM instead of one 1024-thread one, so one program's row reduction
# overlaps the other's loads), 0.470 / 0.469 ms at h = 8192; the row loop pipelined over 2 stages
# (cp.async) at 4 took 0.190 / 0.478 ms and was removed. Tiles of several shorter rows keep 4 per thread:
# at 8 they take 72 registers (h = 1024 / 2048), one 512-thread program per SM, half the warps. Read at
# launch time.
BWD_ELEMENTS_PER_THREAD = 8


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _residual_chunk(X, RES, RES_OUT, x_off, res_off, out_off, mask, HAS_RES: tl.constexpr,
                    MANUAL_BF16: tl.constexpr):
    """residual_out of one tile, rounded to its storage dtype (stored when there is a residual), as fp32."""
    r = tl.load(X + x_off, mask=mask, other=0.0)
    if HAS_RES:
        a = r.to(tl.float32) + tl.load(RES + res_off, mask=mask, other=0.0).to(tl.float32)
        r = cast_rne(a, RES_OUT.dtype.element_ty, MANUAL_BF16)
        tl.store(RES_OUT + out_off, r, mask=mask)
    return r.to(tl.float32)


@triton.jit
def _scale_chunk(r, rstd, W, Y, cols, out_off, mask, col_mask, MANUAL_BF16: tl.constexpr):
    """y = round(round(r * rstd) * w) for one tile (HF: normalise in fp32, round, then scale)."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    n = cast_rne(r * rstd[:, None], Y.dtype.element_ty, MANUAL_BF16).to(tl.float32)
    tl.store(Y + out_off, cast_rne(n * w[None, :], Y.dtype.element_ty, MANUAL_BF16), mask=mask)


@triton.jit
def _fwd_kernel(X, RES, W, Y, RES_OUT, RSTD, n_rows, h, stride_x, stride_res, eps,
                HAS_RES: tl.constexpr, MANUAL_BF16: tl.constexpr, CHUNKED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalises BLOCK_M rows: whole (BLOCK_N >= h) or in chunks of BLOCK_N columns.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)  # rows * stride can pass 2**31 for large activations
    x_row = rows64[:, None] * stride_x
    res_row = rows64[:, None] * stride_res
    out_row = rows64[:, None] * h
    if not CHUNKED:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < h
        mask = row_mask[:, None] & col_mask[None, :]
        r = _residual_chunk(X, RES, RES_OUT, x_row + cols[None, :], res_row + cols[None, :],
                            out_row + cols[None, :], mask, HAS_RES, MANUAL_BF16)
        rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=1) / h + eps)
        _scale_chunk(r, rstd, W, Y, cols, out_row + cols[None, :], mask, col_mask, MANUAL_BF16)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, h, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < h)[None, :]
            r = _residual_chunk(X, RES, RES_OUT, x_row + cols[None, :], res_row + cols[None, :],
                                out_row + cols[None, :], mask, HAS_RES, MANUAL_BF16)
            ss += tl.sum(r * r, axis=1)
        rstd = 1.0 / tl.sqrt(ss / h + eps)
        for start in range(0, h, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < h
            mask = row_mask[:, None] & col_mask[None, :]
            # Read back what this program stored (the same tile shape and addresses, so the same threads).
            if HAS_RES:
                r = tl.load(RES_OUT + out_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                r = tl.load(X + x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _scale_chunk(r, rstd, W, Y, cols, out_row + cols[None, :], mask, col_mask, MANUAL_BF16)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _normed_chunk(RO, GY, ro_row, g_row, cols, mask, rstd):
    """n = residual_out * rstd and grad_y of one tile, fp32 (zeros outside the mask)."""
    n = tl.load(RO + ro_row + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    gy = tl.load(GY + g_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return n, gy


@triton.jit
def _bwd_row_sums_kernel(GY, RO, W, RSTD, ROW_SUMS, n_rows, h, stride_ro,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The row sums of chunked rows: ROW_SUMS[r] = sum(g * n) ([n_rows] fp32). Program pid: rows
    # pid * BLOCK_M ..., its columns in chunks of BLOCK_N with an elementwise running sum, one reduction
    # per row at the end.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, h, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < h
        n, gy = _normed_chunk(RO, GY, rows64[:, None] * stride_ro, rows64[:, None] * h, cols,
                              row_mask[:, None] & col_mask[None, :], rstd)
        acc += gy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] * n
    tl.store(ROW_SUMS + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _bwd_kernel(GY, GRO, RO, W, RSTD, ROW_SUMS, GX, GRES, PART_W, n_rows, h, stride_ro, rows_per_program,
                HAS_GRO: tl.constexpr, HAS_GRES: tl.constexpr, GRAD_W: tl.constexpr, MANUAL_BF16: tl.constexpr,
                CHUNKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (pid, chunk) owns rows [pid * rows_per_program, ...) and columns [chunk * BLOCK_N, ...) of
    # them, and writes those columns of row `pid` of the partial buffer (GRAD_W: not for a frozen weight). A whole row reduces its row sum
    # sum(g * n) here; a chunked row reads it from ROW_SUMS (_bwd_row_sums_kernel): no reduction, so no
    # barrier, in the row loop.
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < h
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        ro_row = rows64[:, None] * stride_ro
        g_row = rows64[:, None] * h
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if CHUNKED:
            dot = tl.load(ROW_SUMS + rows, mask=row_mask, other=0.0)
        n, gy = _normed_chunk(RO, GY, ro_row, g_row, cols, mask, rstd)
        if HAS_GRO:  # issued with the row's other loads, before the row sum's block-wide reduction
            gro = tl.load(GRO + g_row + cols[None, :], mask=mask, other=0.0)
        g = gy * w[None, :]
        if not CHUNKED:
            dot = tl.sum(g * n, axis=1)
        if GRAD_W:
            acc_w += gy * n
        gx = rstd[:, None] * (g - n * (dot / h)[:, None])
        if HAS_GRO:
            gx += gro.to(tl.float32)
        gx = cast_rne(gx, GX.dtype.element_ty, MANUAL_BF16)
        tl.store(GX + g_row + cols[None, :], gx, mask=mask)
        if HAS_GRES:  # the same values in a second tensor
            tl.store(GRES + g_row + cols[None, :], gx, mask=mask)
    if GRAD_W:
        tl.store(PART_W + pid.to(tl.int64) * h + cols, tl.sum(acc_w, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- launch policy
def _block_n(h: int, max_fused: int) -> Tuple[int, bool]:
    """(columns per tile, chunked)."""
    if h <= max_fused:
        return triton.next_power_of_2(h), False
    return CHUNK_COLUMNS, True


def _fwd_config(n_rows: int, h: int):
    block_n, chunked = _block_n(h, MAX_FUSED_HIDDEN)
    if R.interpreting():
        # Fewer, fatter programs: the interpreter's cost is per program, numpy vectorises the tile.
        return R.rows_per_block(n_rows, block_n, 1 << 15), block_n, chunked, {}
    block_m = 1 if chunked else R.rows_per_block(n_rows, block_n, 4096)
    # No FMA contraction: residual_out rounds like the torch reference (x + residual, then round).
    return block_m, block_n, chunked, {"num_warps": R.num_warps(block_m * block_n, 32), "enable_fp_fusion": False}


def _bwd_config(n_rows: int, h: int):
    """(BLOCK_M, BLOCK_N, chunked, launch options) of one backward program's tile.

    Tiles of 4096 elements: one row at BWD_ELEMENTS_PER_THREAD (8: 16 warps; 39-64 registers at h = 4096 ..
    16384, bf16, Triton 3.9, so two or three programs per SM), several rows at 4 per thread (32 warps, 54-56
    registers at h = 1024 / 2048, one program)."""
    chunked = h > min(MAX_FUSED_HIDDEN, MAX_FUSED_HIDDEN_BWD)
    # even chunks: no chunk program left with mostly masked columns
    block_n = R.chunk_columns(h, CHUNK_COLUMNS) if chunked else triton.next_power_of_2(h)
    if R.interpreting():
        return R.rows_per_block(n_rows, block_n, 1 << 14), block_n, chunked, {}
    block_m = R.rows_per_block(n_rows, block_n, 4096)
    per_thread = BWD_ELEMENTS_PER_THREAD if block_m == 1 else 4
    return block_m, block_n, chunked, {"num_warps": R.num_warps(block_m * block_n, 32, per_thread=per_thread)}


# ----------------------------------------------------------------------------- launchers
def forward(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Launch the forward on 2-D ``[rows, h]`` inputs with unit column stride (any row strides).

    Returns ``(y, residual_out, rstd)``; y and residual_out are new contiguous tensors, residual_out is
    None without a residual (it is x then).
    """
    n_rows, h = x.shape
    y = R.empty((n_rows, h), x.dtype, x.device)
    residual_out = None if residual is None else R.empty((n_rows, h), x.dtype, x.device)
    rstd = R.empty((n_rows,), torch.float32, x.device)
    if n_rows == 0:
        return y, residual_out, rstd
    block_m, block_n, chunked, launch = _fwd_config(n_rows, h)
    _fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x, x if residual is None else residual, weight.contiguous(), y,
        y if residual_out is None else residual_out, rstd,
        n_rows, h, x.stride(0), 0 if residual is None else residual.stride(0), float(eps),
        HAS_RES=residual is not None, MANUAL_BF16=R.interpreting(), CHUNKED=chunked,
        BLOCK_M=block_m, BLOCK_N=block_n, **launch)
    return y, residual_out, rstd


def backward(grad_y: torch.Tensor, grad_residual_out: Optional[torch.Tensor], residual_out: torch.Tensor,
             weight: torch.Tensor, rstd: torch.Tensor, residual_grad: bool, weight_grad: bool
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch the backward on 2-D ``[rows, h]`` gradients (made contiguous); residual_out may have any row
    stride. ``grad_residual_out`` None: no gradient reached residual_out.

    Returns ``(grad_x, grad_residual, grad_weight)``: grad_x in grad_y's dtype; grad_residual, its values
    in a second tensor, only when ``residual_grad`` (else None); grad_weight fp32, only when
    ``weight_grad`` (else None: a frozen weight's backward writes no partial rows and reduces nothing).
    """
    grad_y = grad_y.contiguous()
    if grad_residual_out is not None:
        grad_residual_out = grad_residual_out.contiguous()
    if residual_out.stride(-1) != 1:
        residual_out = residual_out.contiguous()
    n_rows, h = grad_y.shape
    device = grad_y.device
    grad_x = R.empty((n_rows, h), grad_y.dtype, device)
    grad_res = R.empty((n_rows, h), grad_y.dtype, device) if residual_grad else None
    slots, n_sums = R.partial_slots((weight_grad,))
    if n_rows == 0:
        return (grad_x, grad_res, *R.zero_sums((weight_grad,), h, device))
    block_m, block_n, chunked, launch = _bwd_config(n_rows, h)
    n_chunks = triton.cdiv(h, block_n)
    launch.update(HAS_GRO=grad_residual_out is not None, HAS_GRES=grad_res is not None, GRAD_W=weight_grad,
                  MANUAL_BF16=R.interpreting(), CHUNKED=chunked, BLOCK_M=block_m, BLOCK_N=block_n)
    weight = weight.contiguous()

    row_sums = rstd                                        # (unused with whole rows)
    if chunked:
        row_sums = R.empty((n_rows,), torch.float32, device)
        sums_block_m, sums_launch = R.row_sums_config(n_rows, block_n)
        _bwd_row_sums_kernel[(triton.cdiv(n_rows, sums_block_m),)](
            grad_y, residual_out, weight, rstd, row_sums, n_rows, h, residual_out.stride(0),
            BLOCK_M=sums_block_m, BLOCK_N=block_n, **sums_launch)

    def args(partials, rows_per_program):
        return (grad_y, grad_y if grad_residual_out is None else grad_residual_out, residual_out, weight, rstd,
                row_sums, grad_x, grad_x if grad_res is None else grad_res, partials, n_rows, h,
                residual_out.stride(0), rows_per_program)

    max_programs = R.wave_programs(_bwd_kernel, args(rstd, 2 * block_m), launch, device, n_chunks)
    programs, rows_per_program = R.split_rows(n_rows, block_m, max_programs)
    partials = R.empty((n_sums, programs, h), torch.float32, device) if n_sums else rstd  # (unused without)
    _bwd_kernel[(programs, n_chunks)](*args(partials, rows_per_program), **launch)
    (grad_w,) = R.column_sums(partials, slots)
    return grad_x, grad_res, grad_w
