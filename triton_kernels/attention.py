"""Flash-style attention core with counter-based dropout: Triton kernels and launchers (no autograd).

Math, per (batch, head); rows i are queries, columns j keys, ``c`` the softmax scale, ``P`` the
dropout byte threshold round(p * 256)::

    S_ij   = c * q_i . k_j                       (-inf where causal and j > i)
    lse_i  = log2 sum_j exp(S_ij)                (fp32, base 2: the only per-row state saved)
    P_ij   = exp2(S_ij log2(e) - lse_i)
    Z_ij   = keep_ij * 256 / (256 - P),  keep_ij = mask_byte(seed, row_offset + (head*b + batch)*s_q + i, j) >= P
    o_i    = sum_j P_ij Z_ij v_j

Backward, given dO::

    delta_i = dO_i . o_i                          (= sum_j P_ij dP_ij)
    dP_ij   = Z_ij (dO_i . v_j)
    dS_ij   = P_ij (dP_ij - delta_i)
    dq_i = c sum_j dS_ij k_j,   dk_j = c sum_i dS_ij q_i,   dv_j = sum_i P_ij Z_ij dO_i

Two choices keep the backward exact to its dtype at extreme inputs:
- ``lse`` is stored in base 2, the domain the kernels exponentiate in (``exp2``). A natural-log ``lse``
  multiplied back by log2(e) is off by an ulp of |S log2 e|: at logits ~1e5 that is 0.0078, a 0.5 %
  error in every P (and 10x the torch backend's error in dv).
- the backward rounds ``c dS_ij = P_ij (c dP_ij - c delta_i)`` to the input dtype for its GEMMs (the
  gradient of the raw product q_i . k_j, on the scale of dq / |k|), not dS, which is 1 / c times
  larger (sqrt(d) at the default scale) and overflowed fp16's 65504 to inf (dq, dk NaN) where the
  gradients themselves were representable. The dq kernel stores ``c delta`` for the dk / dv kernel.

The forward runs an online softmax over key blocks (causal programs stop at the diagonal) and keeps
only ``o`` and ``lse``; the backward recomputes P block by block and regenerates Z with
:func:`triton_kernels.philox.keep_mask` (one Philox call per row and 16 keys, the mask of
:func:`seqpar.ops.attention_core.attention_keep_mask`; the dk/dv kernel transposes its [queries, keys]
tile), so no s_q x s_k tensor is ever written to memory. Two backward kernels avoid atomics: ``dq`` (one program
per query block, which also writes ``delta``) and then ``dk, dv`` (one program per key block).

Grouped-query attention: k and v may have Hk heads dividing q's Hq (G = Hq / Hk). A forward or dq program
of q head ``h`` reads kv head ``h // G``; a dk / dv program of kv head ``j`` loops over the G q heads
``j * G ..`` and sums their contributions in registers (still no atomics, and k, v are never repeated
in memory). Dropout rows and ``lse`` / ``delta`` stay per q head.

==============  ===================  ===============================================================
tensor          shape                notes
==============  ===================  ===============================================================
q               [b, Hq, s_q, d]      any strides; fp16 / bf16 (fp32 for testing)
k, v            [b, Hk, s_k, d]      any strides, dtype of q; Hk divides Hq
o, dq           [b, Hq, s_q, d]      views of contiguous [s_q, b, Hq, d] buffers (the layer's layout)
dk, dv          [b, Hk, s_k, d]      views of contiguous [s_k, b, Hk, d] buffers
lse, delta      [b, Hq, s_q]         fp32, contiguous (lse base 2; delta times c)
==============  ===================  ===============================================================

``d`` is padded to the next power of two inside the kernels (masked loads/stores), so d = 80, 96 work.
On a GPU each kernel is autotuned (block sizes, warps, stages keyed on s and d) at the first lengths of each
power-of-two bucket of (s_q, s_k), whose choice the other lengths of the bucket reuse; under
``TRITON_INTERPRET=1`` a small fixed configuration is used instead.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..random import dropout_scale
from .philox import keep_mask
from .rows import cast_rne

__all__ = ["attention_fwd", "attention_bwd", "HEAD_DIMS", "MAX_SEQ_STRIDE", "unsupported_reason"]

# Head dims the kernels are built for: multiples of 8 up to 128 (d is padded to a power of two).
HEAD_DIMS = tuple(range(16, 129, 8))
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535


# A tile's row offsets are row index x sequence stride in int32 (Triton passes strides below 2**31 as i32):
# the tallest tile's (128 rows) last row must stay below 2**31. Only views reach it: q, k, v of a fused QKV
# [s, b, 3h] have stride 3bh (b h >= 5.6M); fresh buffers stay under b Hq d <= 65535 x 128.
MAX_SEQ_STRIDE = (2**31 - 1) // 128


def unsupported_reason(head_dim: int, dtype: torch.dtype, batch_heads: int = 1, seq_strides: Tuple[int, ...] = (),
                       dropout: bool = False) -> Optional[str]:
    """Why these kernels can't run this problem (None when they can). ``seq_strides``: q's, k's and v's
    strides along the sequence; ``dropout``: whether dropout may be active (its mask needs ``tl.gather``)."""
    if head_dim not in HEAD_DIMS:
        return (f"head dim d={head_dim} is not supported by the triton attention kernel "
                "(need a multiple of 8 in [16, 128])")
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not supported by the triton attention kernel (need one of {_DTYPES})"
    if batch_heads > _MAX_GRID_Y:
        return f"b * heads = {batch_heads} exceeds the kernel grid limit {_MAX_GRID_Y}"
    if seq_strides and max(seq_strides) > MAX_SEQ_STRIDE:
        return (f"a sequence stride of {max(seq_strides)} elements in q, k or v (a view of a fused QKV with a "
                f"large b * h) exceeds the kernel's int32 tile offsets (at most {MAX_SEQ_STRIDE})")
    if dropout and not hasattr(tl, "gather"):
        return f"attention dropout in the triton kernel needs triton >= 3.3 (tl.gather), got {triton.__version__}"
    return None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_mode(dtype: torch.dtype) -> int:
    """The kernels' DOT constexpr (see ``_dot``)."""
    if dtype == torch.float32:
        return 1
    return 2 if dtype == torch.bfloat16 and _interpret() else 0


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    # DOT 1: fp32 inputs (testing) must not silently drop to tf32 on the GPU.
    # DOT 2: the CPU interpreter multiplies bf16 tiles as raw uint16 bits, so upcast them there.
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _load_2d(ptrs, mask_r, mask_d, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr):
    # Masks only where the tile can stick out: rows past s (EVEN_R False) or d < its padding.
    if EVEN_R:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask_d, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs, mask=mask_r, other=0.0)
        else:
            x = tl.load(ptrs, mask=mask_r & mask_d, other=0.0)
    return x


@triton.jit
def _store_2d(ptrs, x, mask_r, mask_d, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr):
    if EVEN_R:
        if EVEN_D:
            tl.store(ptrs, x)
        else:
            tl.store(ptrs, x, mask=mask_d)
    else:
        if EVEN_D:
            tl.store(ptrs, x, mask=mask_r)
        else:
            tl.store(ptrs, x, mask=mask_r & mask_d)


@triton.jit
def _load_1d(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_offs, v_offs, start, end, offs_m, offs_n, mask_d, drop_rows,
               stride_kn, stride_vn, S_K, qk_scale, seed, threshold,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT: tl.constexpr):
    """Online softmax over key blocks [start, end); MASK applies the bound and causal masks."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = K_base + tl.cast(start_n, tl.int64) * stride_kn + k_offs
        if MASK:
            k = _load_2d(k_ptrs, (cols < S_K)[None, :], mask_d[:, None], EVEN_N, EVEN_D)
        else:
            k = _load_2d(k_ptrs, (cols < S_K)[None, :], mask_d[:, None], True, EVEN_D)
        qk = _dot(q, k, DOT) * qk_scale
        if MASK:
            valid = cols[None, :] < S_K
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(keep_mask(seed, drop_rows, start_n, threshold, BLOCK_M, BLOCK_N), p, 0.0)
        v_ptrs = V_base + tl.cast(start_n, tl.int64) * stride_vn + v_offs
        if MASK:
            v = _load_2d(v_ptrs, (cols < S_K)[:, None], mask_d[None, :], EVEN_N, EVEN_D)
        else:
            v = _load_2d(v_ptrs, (cols < S_K)[:, None], mask_d[None, :], True, EVEN_D)
        acc = acc * alpha[:, None] + _dot(cast_rne(p, v.dtype, DOT == 2), v, DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed", "row_offset", "threshold"])
def _attn_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ob, stride_oh, stride_om, stride_od,
                     B, H, GROUP, S_Q, S_K, qk_scale, seed, row_offset, threshold, drop_scale,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                     DROPOUT: tl.constexpr, DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    # Causal programs with many key blocks are launched first (better tail balance).
    pid_m = tl.cdiv(S_Q, BLOCK_M) - 1 - tl.program_id(0)
    bh = tl.program_id(1)                       # head-major: bh = head * B + batch (dropout rows)
    batch = bh % B
    head = bh // B                              # q head; its kv head is head // GROUP
    kv_head = head // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD

    q_ptrs = (Q + tl.cast(batch, tl.int64) * stride_qb + tl.cast(head, tl.int64) * stride_qh
              + tl.cast(m0, tl.int64) * stride_qm
              + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    q = _load_2d(q_ptrs, (offs_m < S_Q)[:, None], mask_d[None, :], EVEN_M, EVEN_D)
    # Scalar bases + loop-invariant offsets (not loop-carried pointer tiles, which cost registers).
    K_base = K + tl.cast(batch, tl.int64) * stride_kb + tl.cast(kv_head, tl.int64) * stride_kh
    V_base = V + tl.cast(batch, tl.int64) * stride_vb + tl.cast(kv_head, tl.int64) * stride_vh
    k_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn          # [D_PAD, BLOCK_N]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd          # [BLOCK_N, D_PAD]
    drop_rows = tl.cast(row_offset, tl.int64) + tl.cast(bh, tl.int64) * S_Q + offs_m   # global dropout rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Key blocks [0, full_end) need no mask; [full_end, hi) straddle the diagonal or the end.
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, S_K)
        full_end = (tl.minimum(m0 + 1, S_K) // BLOCK_N) * BLOCK_N
    else:
        hi = S_K
        full_end = (S_K // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_offs, v_offs, 0, full_end, offs_m, offs_n,
                               mask_d, drop_rows, stride_kn, stride_vn, S_K, qk_scale, seed, threshold,
                               False, CAUSAL, DROPOUT, BLOCK_M, BLOCK_N, EVEN_N, EVEN_D, DOT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_offs, v_offs, full_end, hi, offs_m, offs_n,
                               mask_d, drop_rows, stride_kn, stride_vn, S_K, qk_scale, seed, threshold,
                               True, CAUSAL, DROPOUT, BLOCK_M, BLOCK_N, EVEN_N, EVEN_D, DOT)
    inv_l = 1.0 / l_i
    if DROPOUT:
        inv_l = inv_l * drop_scale
    o = acc * inv_l[:, None]
    lse = m_i + tl.log2(l_i)                                   # base 2, as the backward uses it
    o_ptrs = (O + tl.cast(batch, tl.int64) * stride_ob + tl.cast(head, tl.int64) * stride_oh
              + tl.cast(m0, tl.int64) * stride_om
              + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :] * stride_od)
    _store_2d(o_ptrs, cast_rne(o, O.dtype.element_ty, DOT == 2), (offs_m < S_Q)[:, None], mask_d[None, :], EVEN_M, EVEN_D)
    lse_ptrs = LSE + tl.cast(batch * H + head, tl.int64) * S_Q + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < S_Q)


# ----------------------------------------------------------------------------- backward: dq (+ delta)
@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, k_offs, v_offs, start, end, offs_m, offs_n, mask_d,
                  drop_rows, stride_kn, stride_vn, S_K, qk_scale, dp_scale, seed, threshold,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT: tl.constexpr):
    """dq += sum over key blocks [start, end) of (c dS) k; MASK applies the bound and causal masks.
    ``delta`` holds c delta_i (see the module doc); ``dp_scale`` is c, times the dropout scale with dropout."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = K_base + tl.cast(start_n, tl.int64) * stride_kn + k_offs
        v_ptrs = V_base + tl.cast(start_n, tl.int64) * stride_vn + v_offs
        if MASK:
            kT = _load_2d(k_ptrs, (cols < S_K)[None, :], mask_d[:, None], EVEN_N, EVEN_D)
            vT = _load_2d(v_ptrs, (cols < S_K)[None, :], mask_d[:, None], EVEN_N, EVEN_D)
        else:
            kT = _load_2d(k_ptrs, (cols < S_K)[None, :], mask_d[:, None], True, EVEN_D)
            vT = _load_2d(v_ptrs, (cols < S_K)[None, :], mask_d[:, None], True, EVEN_D)
        qk = _dot(q, kT, DOT) * qk_scale
        p = tl.exp2(qk - lse[:, None])
        if MASK:
            valid = cols[None, :] < S_K
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = _dot(do, vT, DOT)                                  # dO v^T: gradient of the dropped P
        if DROPOUT:
            dp = tl.where(keep_mask(seed, drop_rows, start_n, threshold, BLOCK_M, BLOCK_N), dp, 0.0)
        ds = p * (dp * dp_scale - delta[:, None])               # c dS (one FFMA), rounded below
        dq += _dot(cast_rne(ds, kT.dtype, DOT == 2), tl.trans(kT), DOT)
    return dq


@triton.jit(do_not_specialize=["seed", "row_offset", "threshold"])
def _attn_bwd_dq_kernel(Q, K, V, O, DO, DQ, LSE, DELTA,
                        stride_qb, stride_qh, stride_qm, stride_qd,
                        stride_kb, stride_kh, stride_kn, stride_kd,
                        stride_vb, stride_vh, stride_vn, stride_vd,
                        stride_ob, stride_oh, stride_om, stride_od,
                        stride_dob, stride_doh, stride_dom, stride_dod,
                        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                        B, H, GROUP, S_Q, S_K, qk_scale, sm_scale, seed, row_offset, threshold, drop_scale,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                        DROPOUT: tl.constexpr, DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    pid_m = tl.cdiv(S_Q, BLOCK_M) - 1 - tl.program_id(0)
    bh = tl.program_id(1)                       # head * B + batch over the q heads, as the forward
    batch = bh % B
    head = bh // B
    kv_head = head // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_m = (offs_m < S_Q)[:, None]
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    rows = tl.arange(0, BLOCK_M)[:, None]

    q = _load_2d(Q + tl.cast(batch, tl.int64) * stride_qb + tl.cast(head, tl.int64) * stride_qh
                 + tl.cast(m0, tl.int64) * stride_qm + rows * stride_qm + offs_d[None, :] * stride_qd,
                 mask_m, mask_d[None, :], EVEN_M, EVEN_D)
    do = _load_2d(DO + tl.cast(batch, tl.int64) * stride_dob + tl.cast(head, tl.int64) * stride_doh
                  + tl.cast(m0, tl.int64) * stride_dom + rows * stride_dom + offs_d[None, :] * stride_dod,
                  mask_m, mask_d[None, :], EVEN_M, EVEN_D)
    o = _load_2d(O + tl.cast(batch, tl.int64) * stride_ob + tl.cast(head, tl.int64) * stride_oh
                 + tl.cast(m0, tl.int64) * stride_om + rows * stride_om + offs_d[None, :] * stride_od,
                 mask_m, mask_d[None, :], EVEN_M, EVEN_D)
    # c delta_i = c dO_i . o_i: computed here once per query block, read again by the dk/dv kernel.
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1) * sm_scale
    stat_offs = tl.cast(batch * H + head, tl.int64) * S_Q + offs_m
    if EVEN_M:
        tl.store(DELTA + stat_offs, delta)
    else:
        tl.store(DELTA + stat_offs, delta, mask=offs_m < S_Q)
    lse = _load_1d(LSE + stat_offs, offs_m < S_Q, EVEN_M)
    if DROPOUT:
        dp_scale = sm_scale * drop_scale
    else:
        dp_scale = sm_scale

    # Scalar bases + loop-invariant offsets (not loop-carried pointer tiles, which cost registers).
    K_base = K + tl.cast(batch, tl.int64) * stride_kb + tl.cast(kv_head, tl.int64) * stride_kh
    V_base = V + tl.cast(batch, tl.int64) * stride_vb + tl.cast(kv_head, tl.int64) * stride_vh
    k_offs = offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn          # [D_PAD, BLOCK_N]
    v_offs = offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn          # [D_PAD, BLOCK_N]
    drop_rows = tl.cast(row_offset, tl.int64) + tl.cast(bh, tl.int64) * S_Q + offs_m   # global dropout rows
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M, S_K)
        full_end = (tl.minimum(m0 + 1, S_K) // BLOCK_N) * BLOCK_N
    else:
        hi = S_K
        full_end = (S_K // BLOCK_N) * BLOCK_N
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, k_offs, v_offs, 0, full_end, offs_m, offs_n, mask_d,
                       drop_rows, stride_kn, stride_vn, S_K, qk_scale, dp_scale, seed, threshold,
                       False, CAUSAL, DROPOUT, BLOCK_M, BLOCK_N, EVEN_N, EVEN_D, DOT)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, k_offs, v_offs, full_end, hi, offs_m, offs_n, mask_d,
                       drop_rows, stride_kn, stride_vn, S_K, qk_scale, dp_scale, seed, threshold,
                       True, CAUSAL, DROPOUT, BLOCK_M, BLOCK_N, EVEN_N, EVEN_D, DOT)
    _store_2d(DQ + tl.cast(batch, tl.int64) * stride_dqb + tl.cast(head, tl.int64) * stride_dqh
              + tl.cast(m0, tl.int64) * stride_dqm + rows * stride_dqm + offs_d[None, :] * stride_dqd,
              cast_rne(dq, DQ.dtype.element_ty, DOT == 2), mask_m, mask_d[None, :], EVEN_M, EVEN_D)


# ----------------------------------------------------------------------------- backward: dk, dv
@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, q_offs, do_offs, LSE_base, DELTA_base, start, end, n0, offs_n,
                    offs_m_local, mask_d, drop_row_base, stride_qm, stride_dom, S_Q, qk_scale, sm_scale, seed,
                    threshold, drop_scale, MASK: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr, DOT: tl.constexpr):
    """Accumulate dk (of c dS, see the module doc) and dv of one key block over query blocks [start, end);
    MASK = causal diagonal."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m_local
        q_ptrs = Q_base + tl.cast(start_m, tl.int64) * stride_qm + q_offs
        do_ptrs = DO_base + tl.cast(start_m, tl.int64) * stride_dom + do_offs
        # Rows past s_q load q = dO = 0, lse = delta = 0: their P is 1 and every term they add is 0.
        qT = _load_2d(q_ptrs, (rows < S_Q)[None, :], mask_d[:, None], EVEN_M, EVEN_D)   # [D_PAD, BLOCK_M]
        lse = _load_1d(LSE_base + rows, rows < S_Q, EVEN_M)
        qkT = _dot(k, qT, DOT) * qk_scale                                             # [BLOCK_N, BLOCK_M]
        pT = tl.exp2(qkT - lse[None, :])
        if MASK:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        do = _load_2d(do_ptrs, (rows < S_Q)[:, None], mask_d[None, :], EVEN_M, EVEN_D)   # [BLOCK_M, D_PAD]
        dpT = _dot(v, tl.trans(do), DOT)
        if DROPOUT:
            # The mask of (query rows, key columns), drawn transposed for this [keys, queries] tile.
            z = tl.where(keep_mask(seed, drop_row_base + rows, n0, threshold, BLOCK_M, BLOCK_N, True), drop_scale, 0.0)
            ppT = pT * z
            dpT = dpT * z
        else:
            ppT = pT
        dv += _dot(cast_rne(ppT, do.dtype, DOT == 2), do, DOT)
        delta = _load_1d(DELTA_base + rows, rows < S_Q, EVEN_M)
        dsT = pT * (dpT * sm_scale - delta[None, :])            # c dS^T (one FFMA; delta holds c delta)
        dk += _dot(cast_rne(dsT, qT.dtype, DOT == 2), tl.trans(qT), DOT)
    return dk, dv


@triton.jit(do_not_specialize=["seed", "row_offset", "threshold"])
def _attn_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA,
                          stride_qb, stride_qh, stride_qm, stride_qd,
                          stride_kb, stride_kh, stride_kn, stride_kd,
                          stride_vb, stride_vh, stride_vn, stride_vd,
                          stride_dob, stride_doh, stride_dom, stride_dod,
                          stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                          stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                          B, H, GROUP, S_Q, S_K, qk_scale, sm_scale, seed, row_offset, threshold, drop_scale,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                          DROPOUT: tl.constexpr, DOT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)                       # kv_head * B + batch: one program per key block of a kv head
    batch = bh % B
    kv_head = bh // B
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_n = (offs_n < S_K)[:, None]
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    cols = tl.arange(0, BLOCK_N)[:, None]

    k = _load_2d(K + tl.cast(batch, tl.int64) * stride_kb + tl.cast(kv_head, tl.int64) * stride_kh
                 + tl.cast(n0, tl.int64) * stride_kn + cols * stride_kn + offs_d[None, :] * stride_kd,
                 mask_n, mask_d[None, :], EVEN_N, EVEN_D)
    v = _load_2d(V + tl.cast(batch, tl.int64) * stride_vb + tl.cast(kv_head, tl.int64) * stride_vh
                 + tl.cast(n0, tl.int64) * stride_vn + cols * stride_vn + offs_d[None, :] * stride_vd,
                 mask_n, mask_d[None, :], EVEN_N, EVEN_D)
    q_offs = offs_d[:, None] * stride_qd + offs_m_local[None, :] * stride_qm       # [D_PAD, BLOCK_M]
    do_offs = offs_m_local[:, None] * stride_dom + offs_d[None, :] * stride_dod    # [BLOCK_M, D_PAD]

    if CAUSAL:
        # Query blocks before the one holding row n0 see none of these keys; blocks from m_mid on
        # lie wholly below the diagonal (every row >= the last key n0 + BLOCK_N - 1).
        m_start = (n0 // BLOCK_M) * BLOCK_M
        m_mid = tl.minimum(((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, S_Q)

    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    # dk, dv of a kv head sum over the GROUP q heads that share it: this program visits them in turn (no
    # atomics, nothing repeated in memory). GROUP = 1 (no GQA) is a constant to the compiler: no loop.
    for g in range(GROUP):
        head = kv_head * GROUP + g
        Q_base = Q + tl.cast(batch, tl.int64) * stride_qb + tl.cast(head, tl.int64) * stride_qh
        DO_base = DO + tl.cast(batch, tl.int64) * stride_dob + tl.cast(head, tl.int64) * stride_doh
        stat_base = tl.cast(batch * H + head, tl.int64) * S_Q
        LSE_base = LSE + stat_base
        DELTA_base = DELTA + stat_base
        drop_row_base = (tl.cast(row_offset, tl.int64)
                         + tl.cast(head * B + batch, tl.int64) * S_Q)          # global dropout row of query 0
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, q_offs, do_offs, LSE_base, DELTA_base,
                                     m_start, m_mid, n0, offs_n, offs_m_local, mask_d, drop_row_base, stride_qm,
                                     stride_dom, S_Q, qk_scale, sm_scale, seed, threshold, drop_scale, True, DROPOUT,
                                     BLOCK_M, BLOCK_N, EVEN_M, EVEN_D, DOT)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, q_offs, do_offs, LSE_base, DELTA_base,
                                     m_mid, S_Q, n0, offs_n, offs_m_local, mask_d, drop_row_base, stride_qm,
                                     stride_dom, S_Q, qk_scale, sm_scale, seed, threshold, drop_scale, False, DROPOUT,
                                     BLOCK_M, BLOCK_N, EVEN_M, EVEN_D, DOT)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, q_offs, do_offs, LSE_base, DELTA_base,
                                     0, S_Q, n0, offs_n, offs_m_local, mask_d, drop_row_base, stride_qm,
                                     stride_dom, S_Q, qk_scale, sm_scale, seed, threshold, drop_scale, False, DROPOUT,
                                     BLOCK_M, BLOCK_N, EVEN_M, EVEN_D, DOT)
    _store_2d(DK + tl.cast(batch, tl.int64) * stride_dkb + tl.cast(kv_head, tl.int64) * stride_dkh
              + tl.cast(n0, tl.int64) * stride_dkn + cols * stride_dkn + offs_d[None, :] * stride_dkd,
              cast_rne(dk, DK.dtype.element_ty, DOT == 2), mask_n, mask_d[None, :], EVEN_N, EVEN_D)
    _store_2d(DV + tl.cast(batch, tl.int64) * stride_dvb + tl.cast(kv_head, tl.int64) * stride_dvh
              + tl.cast(n0, tl.int64) * stride_dvn + cols * stride_dvn + offs_d[None, :] * stride_dvd,
              cast_rne(dv, DV.dtype.element_ty, DOT == 2), mask_n, mask_d[None, :], EVEN_N, EVEN_D)


# ----------------------------------------------------------------------------- configurations
_EVEN = {
    "EVEN_M": lambda args: args["S_Q"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["S_K"] % args["BLOCK_N"] == 0,
}
_TUNE_KEY = ["S_Q", "S_K", "HEAD_DIM", "CAUSAL", "DROPOUT", "DOT", "GROUP"]


# (BLOCK_M, BLOCK_N, num_warps, num_stages, largest D_PAD without dropout, largest D_PAD with dropout;
# 0: never), and for dk/dv the same two limits again under GQA (GROUP > 1). Forward and dq keep a tall
# query tile resident and stream keys; dk/dv keeps a wide key tile resident and streams queries. The limits
# come from bench/kernel_report.py (sm_90a, bf16 / fp16, causal; bench/results/kernel_report.txt): a tile
# is offered only where ptxas doesn't spill on sm_90a (on sm_80 / sm_89 a few spill up to 7 KB, and the
# autotuner skips those over sm_89's 99 KB of shared memory), and with dropout only where the main loop
# stays within 1.6x of its dropout-free instruction count. So the 4-warp tiles stop at d_pad = 64, and
# with dropout the 128 x 128 forward (its mask costs ~1.75x) and, at d_pad = 128, the 64-query dk/dv
# tiles (they spill) are left out. A GQA dk/dv program loops over its kv head's q heads around the
# query-block loops; that loop costs registers (the dk, dv accumulators and the k, v tiles stay live
# across it), so under GQA the larger tiles spill earlier and d_pad = 128 with dropout takes a 16-query
# tile.
_FWD_TILES = [(128, 64, 8, 3, 128, 128), (128, 32, 8, 3, 128, 128), (128, 64, 8, 2, 128, 128),
              (128, 128, 8, 2, 128, 0), (64, 64, 4, 3, 64, 64), (128, 32, 4, 4, 64, 64)]
_DQ_TILES = [(128, 64, 8, 2, 128, 128), (128, 64, 8, 3, 128, 128), (128, 32, 8, 3, 128, 128),
             (64, 64, 8, 3, 128, 128), (64, 64, 4, 3, 64, 64), (64, 32, 4, 4, 64, 64)]
_DKDV_TILES = [(32, 128, 8, 3, 128, 128, 128, 64), (64, 128, 8, 3, 128, 64, 64, 0), (64, 128, 8, 2, 64, 64, 64, 0),
               (64, 64, 8, 3, 128, 64, 64, 64), (64, 64, 4, 3, 64, 64, 64, 0), (32, 64, 4, 4, 64, 64, 0, 0),
               (16, 128, 8, 3, 0, 0, 128, 128)]


def _configs(tiles):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s, *_ in tiles]


def _pruner(tiles):
    """early_config_prune of one kernel: the configs of ``tiles`` offered for this D_PAD, DROPOUT and GQA."""
    limits = {}
    for bm, bn, w, s, no_drop, drop, *gqa in tiles:
        limits[(bm, bn, w, s)] = ((no_drop, drop), tuple(gqa) or (no_drop, drop))

    def prune(configs, named_args, **meta):
        d_pad, dropout = meta.get("D_PAD", 0), meta.get("DROPOUT", False)
        gqa = named_args.get("GROUP", 1) != 1
        kept = [c for c in configs if d_pad <= limits[(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps,
                                                       c.num_stages)][gqa][dropout]]
        return kept or configs[:1]

    return prune


# Interpreter (CPU tests): one small fixed tile, distinct M and N so every mask path is exercised.
INTERPRET_CONFIG: Dict[str, Dict[str, int]] = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 16},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 16},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32},
}


# fp32 inputs (testing only) use ieee dots, i.e. FMA loops without tensor cores: a 128 x 128 tile unrolls
# into ~8k FMAs per thread per dot, so compiling every config for each new shape (each gpu test is one)
# took minutes. One small 8-warp, 2-stage tile each, launched as a fixed config (no autotuner, which triton
# 3.6 runs even for a single config). At d = 128 with dropout they need at most 68 KB of shared memory and
# don't spill on sm_80, sm_89 or sm_90 (triton.compile's sizes, ptxas), so they run on every GPU from sm_80
# (sm_86 / sm_89 have 99 KB a block); the H100-sized tiles used before needed up to 208 KB (dq, d = 128).
FP32_CONFIG: Dict[str, Dict[str, int]] = {
    "fwd": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}

_fwd_even = triton.heuristics(_EVEN)(_attn_fwd_kernel)
_dq_even = triton.heuristics(_EVEN)(_attn_bwd_dq_kernel)
_dkdv_even = triton.heuristics(_EVEN)(_attn_bwd_dkdv_kernel)
_fwd_tuned = triton.autotune(configs=_configs(_FWD_TILES), key=_TUNE_KEY,
                             prune_configs_by={"early_config_prune": _pruner(_FWD_TILES)})(_fwd_even)
_dq_tuned = triton.autotune(configs=_configs(_DQ_TILES), key=_TUNE_KEY,
                            prune_configs_by={"early_config_prune": _pruner(_DQ_TILES)})(_dq_even)
_dkdv_tuned = triton.autotune(configs=_configs(_DKDV_TILES), key=_TUNE_KEY,
                              prune_configs_by={"early_config_prune": _pruner(_DKDV_TILES)})(_dkdv_even)


# The autotuner keys on the exact s_q and s_k (_TUNE_KEY), so every new length benchmarked the configs
# again (about a second a kernel): a generation loop without a KV cache (s = 1, 2, 3, ...) or batches of
# varying length paid it at each new length. Here the first lengths of a power-of-two bucket of (s_q, s_k)
# tune, and the others launch that config as a fixed one: (kernel, buckets, GROUP, dtype, device, meta) ->
# config. Tuning holds _TUNE_LOCK: the autotuner keeps its choice in one attribute per kernel (best_config),
# which another thread tuning the same kernel would overwrite before it is read.
_BUCKET_CONFIGS: Dict[tuple, Dict[str, int]] = {}
_TUNE_LOCK = threading.Lock()
_TUNED_FOR: Dict[str, Optional[Tuple[int, int]]] = {}   # kernel -> the GPU arch its autotuner cache is for


def _arch(like: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The compute capability of ``like``'s GPU (None off CUDA): what a tuned choice depends on beyond the
    autotuner's key (the shared memory a tile needs must fit the GPU's)."""
    return torch.cuda.get_device_capability(like.device) if like.is_cuda else None


def _bucket(which: str, s_q: int, s_k: int, group: int, like: torch.Tensor, meta) -> tuple:
    """The key of :data:`_BUCKET_CONFIGS` (lengths below 16 share the bucket 16)."""
    return (which, triton.next_power_of_2(max(s_q, 16)), triton.next_power_of_2(max(s_k, 16)), group,
            str(like.dtype), str(like.device), *sorted(meta.items()))


def _launch(which: str, even_kernel, tuned_kernel, grid_rows: int, bh: int, args, meta, config,
            bucket: tuple = ()):
    """Run a fixed config (interpreter, fp32, or ``config`` given), the config tuned for this length ``bucket``
    (see :data:`_BUCKET_CONFIGS`), or the autotuned kernel, remembering its choice for the bucket."""
    if config is None and _interpret():
        config = INTERPRET_CONFIG[which]
    if config is None and meta["DOT"] == 1:
        config = FP32_CONFIG[which]
    if config is None:
        config = _BUCKET_CONFIGS.get(bucket)
    if config is None:
        grid = lambda m: (triton.cdiv(grid_rows, m["BLOCK_M" if which != "dkdv" else "BLOCK_N"]), bh)
        with _TUNE_LOCK:
            arch = _arch(args[0])
            if _TUNED_FOR.get(which, arch) != arch:
                # Triton's autotune cache keys leave the device out: a choice made on an H100 (a 118 KB
                # tile) was reused, untimed, on an L4 (99 KB of shared memory), whose launch then failed.
                tuned_kernel.cache.clear()
            _TUNED_FOR[which] = arch
            tuned_kernel[grid](*args, **meta)
            best = tuned_kernel.best_config
            _BUCKET_CONFIGS[bucket] = dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)
        return
    config = dict(config)
    num_warps = config.pop("num_warps", 4)
    num_stages = config.pop("num_stages", 2)
    block = config["BLOCK_M" if which != "dkdv" else "BLOCK_N"]
    even_kernel[(triton.cdiv(grid_rows, block), bh)](*args, **meta, **config,
                                                     num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- launchers
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate the launchers' inputs; returns GROUP = Hq / Hk, the q heads per kv head."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "[b, Hq, s_q, d], [b, Hk, s_k, d], [b, Hk, s_k, d] with Hk dividing Hq")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    reason = unsupported_reason(q.shape[3], q.dtype, q.shape[0] * q.shape[1], (q.stride(2), k.stride(2), v.stride(2)))
    if reason:
        raise ValueError(reason)
    return q.shape[1] // k.shape[1]


def _seq_major(b: int, heads: int, s: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """A [b, H, s, d] view of a fresh contiguous [s, b, H, d] buffer (the layer's [s, b, h] layout)."""
    return torch.empty((s, b, heads, d), dtype=like.dtype, device=like.device).permute(1, 2, 0, 3)


def _drop_args(drop_threshold: int, seed: int, row_offset: int):
    """Kernel arguments (seed, row_offset, threshold, drop_scale) and whether dropout is on."""
    if not isinstance(drop_threshold, int) or not 0 <= drop_threshold < 256:
        raise ValueError(f"dropout threshold P must be an int in [0, 256), got {drop_threshold!r}")
    if drop_threshold == 0:
        return (0, 0, 0, 1.0), False
    return (int(seed), int(row_offset), drop_threshold, dropout_scale(drop_threshold)), True


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  drop_threshold: int = 0, seed: int = 0, row_offset: int = 0,
                  config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward: returns ``(o, lse)``; ``o`` [b, Hq, s_q, d] (a view of [s_q, b, Hq, d]), ``lse`` fp32
    [b, Hq, s_q] in base 2 (log2 sum_j exp(S_ij)). k, v [b, Hk, s_k, d] with Hk dividing Hq (grouped-query
    attention: q head i reads kv head i // (Hq / Hk)).

    ``drop_threshold`` is the dropout byte threshold P = round(p * 256) (0: no dropout; see
    :func:`seqpar.random.dropout_threshold`). ``config`` (tests) pins ``BLOCK_M``/``BLOCK_N`` (and
    optionally num_warps/num_stages) instead of autotuning.
    """
    group = _check(q, k, v)
    b, heads, s_q, d = q.shape
    s_k = k.shape[2]
    o = _seq_major(b, heads, s_q, d, q)
    lse = torch.empty((b, heads, s_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if s_k == 0:  # softmax over no keys: define o = 0, lse = -inf (nothing to attend to)
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    (seed, row_offset, threshold, drop_scale), active = _drop_args(drop_threshold, seed, row_offset)
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            b, heads, group, s_q, s_k, scale * _LOG2E, seed, row_offset, threshold, drop_scale)
    meta = dict(HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), CAUSAL=bool(causal), DROPOUT=active,
                DOT=_dot_mode(q.dtype))
    _launch("fwd", _fwd_even, _fwd_tuned, s_q, b * heads, args, meta, config,
            _bucket("fwd", s_q, s_k, group, q, meta))
    return o, lse


def attention_bwd(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, drop_threshold: int = 0,
                  seed: int = 0, row_offset: int = 0,
                  config: Optional[Dict[str, dict]] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)`` (views of [s, b, H, d] buffers; dk, dv with k's Hk heads, each the sum
    over its group of q heads) from ``grad_o`` (any strides) and the forward's ``o`` and ``lse``.
    ``config`` (tests): {"dq": {...}, "dkdv": {...}} pinned tiles."""
    group = _check(q, k, v)
    if grad_o.shape != q.shape or o.shape != q.shape:
        raise ValueError(f"grad_o {tuple(grad_o.shape)} / o {tuple(o.shape)} must match q {tuple(q.shape)}")
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    dq = _seq_major(b, heads, s_q, d, q)
    dk = _seq_major(b, kv_heads, s_k, d, k)
    dv = _seq_major(b, kv_heads, s_k, d, v)
    if s_q == 0 or s_k == 0 or b * heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    grad_o = grad_o.to(q.dtype)
    if grad_o.stride(2) > MAX_SEQ_STRIDE:
        # grad_o comes from autograd in any layout; q, k, v were checked in forward, this one only here.
        grad_o = grad_o.contiguous()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    (seed, row_offset, threshold, drop_scale), active = _drop_args(drop_threshold, seed, row_offset)
    meta = dict(HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), CAUSAL=bool(causal), DROPOUT=active,
                DOT=_dot_mode(q.dtype))
    config = config or {}
    common = (b, heads, group, s_q, s_k, scale * _LOG2E, scale, seed, row_offset, threshold, drop_scale)
    _launch("dq", _dq_even, _dq_tuned, s_q, b * heads,
            (q, k, v, o, grad_o, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
             *grad_o.stride(), *dq.stride(), *common), meta, config.get("dq"),
            _bucket("dq", s_q, s_k, group, q, meta))
    _launch("dkdv", _dkdv_even, _dkdv_tuned, s_k, b * kv_heads,
            (q, k, v, grad_o, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(),
             *dk.stride(), *dv.stride(), *common), meta, config.get("dkdv"),
            _bucket("dkdv", s_q, s_k, group, q, meta))
    return dq, dk, dv
