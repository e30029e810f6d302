"""Triton kernels for the fused bias + dropout + residual-add + LayerNorm (no autograd here).

Math on a ``[rows, h]`` view (statistics in fp32; see :mod:`seqpar.ops.bias_dropout_add_layer_norm`)::

    keep[r, c]      = mask_byte(seed, row_offset + r, c) >= P        # seqpar.random's mask, P = round(p * 256)
    residual_out    = residual + where(keep, (x + bias) * scale, 0)  # scale = float32(256 / (256 - P))
    x_hat           = (residual_out - mean) * rstd                    # of the *rounded* residual_out
                                                                      # (corrected two-pass mean / var)
    y               = x_hat * ln_weight + ln_bias

Backward, per row (g = grad_y * ln_weight)::

    grad_residual   = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + grad_residual_out
    grad_x          = where(keep, grad_residual * scale, 0)
    grad_ln_weight  = sum_rows(grad_y * x_hat),  grad_ln_bias = sum_rows(grad_y),  grad_bias = sum_rows(grad_x)

Any h: a row of up to ``MAX_FUSED_HIDDEN`` columns is one register tile of the forward; a longer row is
covered in chunks of ``CHUNK_COLUMNS`` with three passes (residual_out and its sum; the sums of
d = residual_out - mean and d * d; y), the later passes reading back the residual_out the program has just
written (from L2). Where h is a multiple of the tile width no column mask is built (``FULL_TILES``). The
backward always works on column chunks of at most ``BWD_BLOCK_N``: one program per (row range, chunk). A
row of one chunk gives its row sums (mean(g), mean(g * x_hat)) by reductions inside that program; a longer
row has them computed first by a row-sum pass (``_bwd_row_sums_kernel``, [2, rows] fp32), which reads
grad_y and residual_out once more but leaves the chunk programs without a reduction in their row loop.

The column sums are reduced without atomics (the CPU interpreter runs programs one after another):
each backward program accumulates its rows into fp32 partial rows of ``[n_buffers, n_partials, h]``,
summed by :func:`triton_kernels.rows.reduce_partials`.

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

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..random import dropout_scale
from . import rows as R
from .philox import keep_mask
from .rows import cast_rne

__all__ = ["forward", "backward", "MAX_FUSED_HIDDEN", "CHUNK_COLUMNS", "BWD_BLOCK_N"]

# Longest row the forward holds in one register tile; longer rows are covered in chunks of CHUNK_COLUMNS
# (three passes, the later two reading residual_out back from L2). Measured on an H200 (commit 0200fea,
# bf16, GPU time), h = 12288 in chunks against one whole-row tile (16384 wide, a quarter masked, one
# 1024-thread program per SM): forward 0.420 / 0.492 ms (p = 0) and 0.472 / 0.702 ms (p = 0.1) at 16384
# rows, 0.034 / 0.038 and 0.037 / 0.048 ms at 1024 rows; the backward is the same kernel either way. So
# the whole-row tile stops at 8192 columns (it was 16384). Read at launch time (tests lower them to
# exercise the chunked path).
MAX_FUSED_HIDDEN = 8192
CHUNK_COLUMNS = 4096


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _in_row(cols, h, FULL_TILES: tl.constexpr):
    """cols < h; with FULL_TILES (h a multiple of the tile width) a constant-true mask, which the compiler
    folds away: unpredicated loads and stores, no selects."""
    if FULL_TILES:
        return tl.full(cols.shape, 1, tl.int1)
    else:
        return cols < h


@triton.jit
def _residual_chunk(X, BIAS, RES, RES_OUT, rows64, cols, row_mask, h, stride_x, stride_res, threshold, scale,
                    seed, row_offset, col_start, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    MANUAL_BF16: tl.constexpr, FULL_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """residual_out = residual + dropout(x + bias) of one [BLOCK_M, BLOCK_N] tile (columns ``cols``, which
    start at ``col_start``), stored rounded; returned as fp32 (zeros outside the tile's mask)."""
    col_mask = _in_row(cols, h, FULL_TILES)
    mask = row_mask[:, None] & col_mask[None, :]
    a = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        # Global rows, whole 16-column groups (BLOCK_N >= 16): bit for bit seqpar.random.dropout_keep_mask.
        keep = keep_mask(seed, rows64 + row_offset, col_start, threshold, BLOCK_M, BLOCK_N, False, False)
        a = tl.where(keep, a * scale, 0.0)
    res = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r_store = cast_rne(res + a, RES_OUT.dtype.element_ty, MANUAL_BF16)
    tl.store(RES_OUT + rows64[:, None] * h + cols[None, :], r_store, mask=mask)
    return r_store.to(tl.float32)


@triton.jit
def _normalize_chunk(d, rstd, W, B, Y, rows64, cols, row_mask, h, MANUAL_BF16: tl.constexpr,
                     FULL_TILES: tl.constexpr):
    """y = d * rstd * w + b of one tile (d = residual_out - mean), stored."""
    col_mask = _in_row(cols, h, FULL_TILES)
    mask = row_mask[:, None] & col_mask[None, :]
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows64[:, None] * h + cols[None, :], cast_rne(y, Y.dtype.element_ty, MANUAL_BF16), mask=mask)


@triton.jit
def _corrected_statistics(sum_d, sum_dd, h, eps):
    """(shift, rstd) of rows from the sums of d = r - m0 and of d * d (m0: the plain mean): the corrected
    two-pass algorithm of seqpar.ops.bias_dropout_add_layer_norm; mean = m0 + shift (exact for a constant
    row). The clamp keeps a NaN variance (inf - inf on rows of values ~1e27 and more) NaN, as the torch
    reference and F.layer_norm do: a max (maxnum) made it 0 and the row a finite ~1e33 that hid the
    blow-up from a NaN check."""
    shift = sum_d / h
    var = sum_dd / h - shift * shift
    return shift, 1.0 / tl.sqrt(tl.where(var < 0.0, 0.0, var) + eps)


@triton.jit(do_not_specialize=["threshold", "seed", "row_offset"])
def _fwd_kernel(X, BIAS, RES, W, B, Y, RES_OUT, MEAN, RSTD,
                n_rows, h, stride_x, stride_res,
                eps, threshold, scale, seed, row_offset,
                HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MANUAL_BF16: tl.constexpr,
                CHUNKED: tl.constexpr, FULL_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program normalises BLOCK_M rows (BLOCK_M = 1 for wide rows on a GPU): whole (BLOCK_N >= h) or in
    # chunks of BLOCK_N columns. The statistics are of the stored (rounded) residual_out, which is what
    # backward sees. FULL_TILES: h is a multiple of BLOCK_N, no column is masked.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)  # rows * stride can pass 2**31 for large activations
    if not CHUNKED:
        cols = tl.arange(0, BLOCK_N)
        r = _residual_chunk(X, BIAS, RES, RES_OUT, rows64, cols, row_mask, h, stride_x, stride_res, threshold,
                            scale, seed, row_offset, 0, HAS_BIAS, HAS_DROPOUT, MANUAL_BF16, FULL_TILES, BLOCK_M,
                            BLOCK_N)
        m0 = tl.sum(r, axis=1) / h
        d = tl.where(_in_row(cols, h, FULL_TILES)[None, :], r - m0[:, None], 0.0)  # columns past h: 0
        sum_dd = tl.sum(d * d, axis=1)  # first: 32 registers, not 38 (Triton 3.6, fp16 4 x 1024 without dropout)
        shift, rstd = _corrected_statistics(tl.sum(d, axis=1), sum_dd, h, eps)
        mean = m0 + shift
        # d - (mean - m0) is r - mean with the same single rounding (both differences are exact where r, m0 and
        # mean are close), but keeps d, not r, live across the reductions: r - mean held both, 40 registers
        # where the plain two-pass forward took 32 (4 x 1024 tile, 16 warps). Not d - shift: a GPU's fp32
        # division is approximate, so shift may be an ulp off m0's error, which mean = m0 + shift absorbs.
        _normalize_chunk(d - (mean - m0)[:, None], rstd, W, B, Y, rows64, cols, row_mask, h, MANUAL_BF16,
                         FULL_TILES)
    else:
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, h, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            r = _residual_chunk(X, BIAS, RES, RES_OUT, rows64, cols, row_mask, h, stride_x, stride_res,
                                threshold, scale, seed, row_offset, start, HAS_BIAS, HAS_DROPOUT, MANUAL_BF16,
                                FULL_TILES, BLOCK_M, BLOCK_N)
            total += tl.sum(r, axis=1)
        m0 = total / h
        # Read back what this program stored (the same tile shape and addresses, so the same threads).
        sum_d = tl.zeros([BLOCK_M], dtype=tl.float32)
        sum_dd = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, h, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = _in_row(cols, h, FULL_TILES)
            r = tl.load(RES_OUT + rows64[:, None] * h + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                        other=0.0).to(tl.float32)
            d = tl.where(col_mask[None, :], r - m0[:, None], 0.0)
            sum_d += tl.sum(d, axis=1)
            sum_dd += tl.sum(d * d, axis=1)
        shift, rstd = _corrected_statistics(sum_d, sum_dd, h, eps)
        mean = m0 + shift
        for start in range(0, h, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & _in_row(cols, h, FULL_TILES)[None, :]
            r = tl.load(RES_OUT + rows64[:, None] * h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _normalize_chunk(r - mean[:, None], rstd, W, B, Y, rows64, cols, row_mask, h, MANUAL_BF16, FULL_TILES)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _row_terms(GY, RO, offs_row, cols, mask, w, mean, rstd):
    """x_hat, grad_y and g = grad_y * w of one [BLOCK_M, BLOCK_N] tile in fp32 (zeros outside ``mask``)."""
    r = tl.load(RO + offs_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_hat = tl.where(mask, (r - mean[:, None]) * rstd[:, None], 0.0)
    gy = tl.load(GY + offs_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x_hat, gy, gy * w[None, :]


@triton.jit
def _bwd_row_sums_kernel(GY, RO, W, MEAN, RSTD, ROW_SUMS, n_rows, h,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The row sums of rows wider than one backward program's columns: ROW_SUMS[0, r] = sum(g),
    # ROW_SUMS[1, r] = sum(g * x_hat) ([2, n_rows] fp32). Program pid: rows pid * BLOCK_M ..., its columns
    # in chunks of BLOCK_N with elementwise running sums, and one reduction per row at the end.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    offs_row = rows.to(tl.int64)[:, None] * h
    mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_gx = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, h, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < h
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        x_hat, _, g = _row_terms(GY, RO, offs_row, cols, row_mask[:, None] & col_mask[None, :], w, mean, rstd)
        acc_g += g
        acc_gx += g * x_hat
    tl.store(ROW_SUMS + rows, tl.sum(acc_g, axis=1), mask=row_mask)
    tl.store(ROW_SUMS + n_rows + rows, tl.sum(acc_gx, axis=1), mask=row_mask)


@triton.jit(do_not_specialize=["threshold", "seed", "row_offset"])
def _bwd_kernel(GY, GRO, RO, W, MEAN, RSTD, ROW_SUMS, GX, GRES, PARTS,
                n_rows, h, rows_per_program, threshold, scale, seed, row_offset,
                SLOT_W: tl.constexpr, SLOT_B: tl.constexpr, SLOT_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                MANUAL_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_CHUNKS: tl.constexpr):
    # Program (pid, chunk) owns rows [pid * rows_per_program, ...) and columns [chunk * BLOCK_N, ...) of
    # them, and writes those columns of row `pid` of the partial buffers PARTS [0 to 3, programs, h]: the
    # column sums grad_ln_weight, grad_ln_bias, grad_bias at buffers SLOT_W, SLOT_B, SLOT_BIAS (-1: a sum
    # not computed, e.g. a frozen norm's). Its registers hold BLOCK_N columns (up to three fp32 running
    # sums each). A whole row (N_CHUNKS = 1) gives its row sums by two reductions; a wider row is split
    # over N_CHUNKS programs, which read its row sums from ROW_SUMS (_bwd_row_sums_kernel): no reduction,
    # so no barrier, in their row loop.
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
    # One stage: the loop not software-pipelined. Pipelined over 2 stages (the next rows' tiles copied to
    # shared memory with cp.async while the current row reduces; the same registers, no spills) the backward
    # took 1.00-1.20x the GPU time at 16384 rows, h 1024 / 4096 / 12288 (H200, 9466f0b; its shared memory
    # fits fewer programs per SM, so fewer rows are in flight).
    for start in tl.range(row_start, row_end, BLOCK_M, num_stages=1):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        offs_row = rows.to(tl.int64)[:, None] * h
        offs = offs_row + cols[None, :]
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if N_CHUNKS > 1:
            sum_g = tl.load(ROW_SUMS + rows, mask=row_mask, other=0.0)
            sum_gx = tl.load(ROW_SUMS + n_rows + rows, mask=row_mask, other=0.0)
        gro = tl.load(GRO + offs, mask=mask, other=0.0)   # issued with the row's other loads
        x_hat, gy, g = _row_terms(GY, RO, offs_row, cols, mask, w, mean, rstd)
        if N_CHUNKS == 1:
            # Two tl.sum, not one tl.reduce over the pair: that saves one barrier per row on a GPU, but the
            # CPU interpreter runs a custom combine in Python (40-60 s for a 615 x 768 test, not 1 s).
            sum_g = tl.sum(g, axis=1)
            sum_gx = tl.sum(g * x_hat, axis=1)
        if SLOT_W >= 0:
            acc_w += gy * x_hat
        if SLOT_B >= 0:
            acc_b += gy

        c_gx = sum_gx / h
        c_g = sum_g / h
        g_res = rstd[:, None] * (g - c_g[:, None] - x_hat * c_gx[:, None]) + gro.to(tl.float32)
        g_res = tl.where(mask, g_res, 0.0)
        tl.store(GRES + offs, cast_rne(g_res, GRES.dtype.element_ty, MANUAL_BF16), mask=mask)
        if HAS_DROPOUT:
            keep = keep_mask(seed, rows.to(tl.int64) + row_offset, chunk * BLOCK_N, threshold, BLOCK_M, BLOCK_N,
                             False, False)
            g_x = tl.where(keep, g_res * scale, 0.0)
        else:
            g_x = g_res
        tl.store(GX + offs, cast_rne(g_x, GX.dtype.element_ty, MANUAL_BF16), mask=mask)
        if SLOT_BIAS >= 0:
            acc_bias += g_x

    part = pid.to(tl.int64) * h + cols
    buffer = tl.num_programs(0).to(tl.int64) * h           # one [programs, h] partial buffer
    if SLOT_W >= 0:
        tl.store(PARTS + SLOT_W * buffer + part, tl.sum(acc_w, axis=0), mask=col_mask)
    if SLOT_B >= 0:
        tl.store(PARTS + SLOT_B * buffer + part, tl.sum(acc_b, axis=0), mask=col_mask)
    if SLOT_BIAS >= 0:
        tl.store(PARTS + SLOT_BIAS * buffer + part, tl.sum(acc_bias, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- launch policy
def _fwd_config(n_rows: int, h: int):
    """(BLOCK_M, BLOCK_N, chunked, launch options)."""
    if h < 1:
        raise ValueError(f"hidden size h must be positive, got {h}")
    chunked = h > MAX_FUSED_HIDDEN
    # The dropout mask comes in whole 16-column groups: at least 16 columns.
    block_n = CHUNK_COLUMNS if chunked else max(16, triton.next_power_of_2(h))
    if R.interpreting():
        # Fewer, fatter programs: the interpreter's cost is per program, numpy vectorises the tile.
        return R.rows_per_block(n_rows, block_n, 1 << 15), block_n, chunked, {}
    block_m = 1 if chunked else R.rows_per_block(n_rows, block_n, 4096)
    # Up to 32 warps, 8 elements per thread: a whole 8192-wide row took 40-63 registers at 16 warps and
    # 32 at 32 warps (Triton 3.6 and 3.9, bf16).
    # No FMA contraction: residual + dropped must round exactly like the torch reference (bitwise
    # identical residual_out across backends); the kernel is memory bound, so this costs nothing.
    return block_m, block_n, chunked, {"num_warps": R.num_warps(block_m * block_n, 32), "enable_fp_fusion": False}


# Columns of one backward program, at most (R.chunk_columns splits a wider row into even chunks). A tile of
# 4096 elements, 4 per thread at 32 warps: ptxas fits it in the 64 registers a 1024-thread program may use,
# so an SM holds 32 warps (50% occupancy); at 16 warps (8 per thread) a whole 4096-wide row took 84-99
# registers, one 512-thread program per SM (25%), whose row reductions left the SM idle. Wider rows are
# chunked, their row sums computed first (_bwd_row_sums_kernel, which reads grad_y and residual_out once
# more: 7 tensor passes where 5 are the minimum, so at most 5/7 = 71% of the copy bandwidth counted on the
# minimal bytes). That pass replaced chunk programs that each streamed their rows' other chunks for the row
# sums: 16 warps at 100-128 registers (25% occupancy), 612-761 loop instructions per 8 elements at
# h = 12288 / 16384, and a block reduction per chunk per row; 16384 x 12288 bf16 took 2.3 ms on an H200, 5x
# its memory time (commit 96c73a0), where 7 passes take 0.66 ms at the copy bandwidth. Whole rows against
# the row-sum pass at h = 4096 (H200, commit 0200fea, bf16, p = 0, backward GPU time): 0.301 / 0.315 ms at
# 16384 rows, 0.033 / 0.038 at 1024, 0.018 / 0.023 at 256; so rows up to 4096 columns stay whole.
BWD_BLOCK_N = 4096
BWD_TILE = 4096


def _bwd_config(n_rows: int, h: int):
    """(BLOCK_M, BLOCK_N, column chunks, launch options) of one backward program's tile."""
    block_n = max(16, triton.next_power_of_2(h)) if h <= BWD_BLOCK_N else R.chunk_columns(h, BWD_BLOCK_N)
    n_chunks = triton.cdiv(h, block_n)
    if R.interpreting():  # few fat programs: the interpreter's cost is per program
        return R.rows_per_block(n_rows, block_n, 1 << 14), block_n, n_chunks, {}
    block_m = R.rows_per_block(n_rows, block_n, BWD_TILE)
    return block_m, block_n, n_chunks, {"num_warps": R.num_warps(block_m * block_n, 32, per_thread=4)}


# ----------------------------------------------------------------------------- launchers
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
    y = R.empty((n_rows, h), x.dtype, x.device)
    residual_out = R.empty((n_rows, h), residual.dtype, x.device)
    mean = R.empty((n_rows,), torch.float32, x.device)
    rstd = R.empty((n_rows,), torch.float32, x.device)
    if n_rows == 0:
        return y, residual_out, mean, rstd
    block_m, block_n, chunked, launch = _fwd_config(n_rows, h)
    drop_args, has_dropout = _drop_args(drop_threshold, seed, row_offset)
    _fwd_kernel[(triton.cdiv(n_rows, block_m),)](   # the [h] vectors are read at unit stride: a view may be strided
        x, x if bias is None else bias.contiguous(), residual, ln_weight.contiguous(), ln_bias.contiguous(),
        y, residual_out, mean, rstd,
        n_rows, h, x.stride(0), residual.stride(0), float(eps), *drop_args,
        HAS_BIAS=bias is not None, HAS_DROPOUT=has_dropout, MANUAL_BF16=R.interpreting(), CHUNKED=chunked,
        FULL_TILES=h % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, **launch)
    return y, residual_out, mean, rstd


def backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor,
             ln_weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, drop_threshold: int, seed: int,
             row_offset: int, param_grads: Sequence[bool]
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch the backward on 2-D ``[rows, h]`` gradients (made contiguous).

    ``param_grads``: which column sums to compute, (grad_ln_weight, grad_ln_bias, grad_bias); the others
    come back None (a frozen norm's: no partial rows, and no reduction at all when none is asked for).
    Returns ``(grad_x, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias)``: grad_x and
    grad_residual in grad_y's dtype, the column sums in fp32.
    """
    grad_y, grad_residual_out = grad_y.contiguous(), grad_residual_out.contiguous()
    residual_out = residual_out.contiguous()
    n_rows, h = grad_y.shape
    device = grad_y.device
    grad_x = R.empty((n_rows, h), grad_y.dtype, device)
    grad_res = R.empty((n_rows, h), grad_y.dtype, device)
    slots, n_sums = R.partial_slots(param_grads)
    if n_rows == 0:
        grad_w, grad_b, grad_bias = R.zero_sums(param_grads, h, device)
        return grad_x, grad_bias, grad_res, grad_w, grad_b
    block_m, block_n, n_chunks, launch = _bwd_config(n_rows, h)
    drop_args, has_dropout = _drop_args(drop_threshold, seed, row_offset)
    launch.update(SLOT_W=slots[0], SLOT_B=slots[1], SLOT_BIAS=slots[2], HAS_DROPOUT=has_dropout,
                  MANUAL_BF16=R.interpreting(), BLOCK_M=block_m, BLOCK_N=block_n, N_CHUNKS=n_chunks)
    ln_weight = ln_weight.contiguous()

    row_sums = mean                                        # (unused with whole rows)
    if n_chunks > 1:
        row_sums = R.empty((2, n_rows), torch.float32, device)
        sums_block_m, sums_launch = R.row_sums_config(n_rows, block_n)
        _bwd_row_sums_kernel[(triton.cdiv(n_rows, sums_block_m),)](
            grad_y, residual_out, ln_weight, mean, rstd, row_sums, n_rows, h,
            BLOCK_M=sums_block_m, BLOCK_N=block_n, **sums_launch)

    def args(partials, rows_per_program):
        return (grad_y, grad_residual_out, residual_out, ln_weight, mean, rstd, row_sums, grad_x, grad_res,
                partials, n_rows, h, rows_per_program, *drop_args)

    max_programs = R.wave_programs(_bwd_kernel, args(mean, 2 * block_m), launch, device, n_chunks)
    programs, rows_per_program = R.split_rows(n_rows, block_m, max_programs)
    partials = R.empty((n_sums, programs, h), torch.float32, device) if n_sums else mean   # (unused without sums)
    _bwd_kernel[(programs, n_chunks)](*args(partials, rows_per_program), **launch)
    grad_w, grad_b, grad_bias = R.column_sums(partials, slots)
    return grad_x, grad_bias, grad_res, grad_w, grad_b
