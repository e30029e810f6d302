"""The dropout mask of :mod:`seqpar.random` as a Triton tile: one Philox-4x32-7 call per 16 columns.

For global rows ``r`` and columns ``c`` (``threshold`` = P = round(p * 256))::

    (w0, w1, w2, w3) = tl.philox(seed, c // 16, r & 0xffffffff, r >> 32, 0, n_rounds=7)
    keep[r, c]       = byte (c % 4) of w[(c % 16) // 4]  >=  P

A tile draws whole 16-column groups: ``[rows, cols / 16]`` Philox calls (:func:`group_keep_bits`),
each group's 16 decisions packed into one word (SIMD within the word: a few integer instructions per
4 decisions). :func:`keep_mask` then spreads the words over the columns (one AND per element, in
whatever layout the tile has; on a GPU the MMA accumulator's): only one 32-bit word per
(row, group) moves between layouts.
Only core ``tl`` ops: runs under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["philox4x32", "group_keep_bits", "column_bit", "keep_mask"]

PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def philox4x32(seed, c0, c1, c2, c3, N_ROUNDS: tl.constexpr):
    """``tl.philox(seed, c0, c1, c2, c3, n_rounds=N_ROUNDS)`` for uint32 counters (broadcast together),
    with each round's two 32 x 32 -> 64-bit products written as such (one wide multiply each on the
    GPU, where tl.philox's separate high and low halves cost two)."""
    # A uint64 tensor from an int argument or a constexpr alike (a caller may pass a literal; an argument
    # that is not do_not_specialize arrives as a constexpr when it equals 1). tl.to_tensor would do it,
    # but Triton before 3.8 lacks it (pyproject admits >= 3.0; the GPU machine's is 3.6). The add folds.
    seed = seed + tl.zeros((), tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(N_ROUNDS):
        prod_b = c2.to(tl.uint64) * 0xCD9E8D57
        prod_a = c0.to(tl.uint64) * 0xD2511F53
        c0 = (prod_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (prod_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = prod_b.to(tl.uint32)
        c3 = prod_a.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _byte_ge(w, thr_lo, thr_hi, k: tl.constexpr):
    """Bits 8b + k (b = 0..3) of the result: byte b of ``w`` >= P (unsigned); the other bits are 0.
    thr_lo = (P & 0x7f) * 0x01010101, thr_hi = 0x80808080 if P >= 128 else 0.

    Per byte x: (x | 0x80) - (P & 0x7f) has bit 7 iff x & 0x7f >= P & 0x7f, and never borrows from the
    next byte; x >= P iff x's top bit beats P's, or they tie and the low 7 bits compare >=."""
    low_ge = (w | 0x80808080) - thr_lo
    ge = (w & ~thr_hi) | (~(w ^ thr_hi) & low_ge)     # bit 7 of each byte: the decision
    return (ge >> (7 - k)) & (0x01010101 << k)


@triton.jit
def group_keep_bits(seed, rows, col_start, threshold, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    """Keep bits [BLOCK_R, GROUPS] (uint32) of global rows ``rows`` ([BLOCK_R] int64) and the groups of
    columns ``col_start + 16 g .. + 15`` (``col_start`` % 16 == 0). Column 16 g + 4 k + b (byte b of
    word k) is bit 8 b + k of element (r, g): :func:`column_bit` gives the bit of a column."""
    group = (col_start // 16 + tl.arange(0, GROUPS)).to(tl.uint32)[None, :]      # [1, G]
    row_lo = (rows & 0xFFFFFFFF).to(tl.uint32)[:, None]                            # [R, 1]
    row_hi = (rows >> 32).to(tl.uint32)[:, None]
    # Counter (group, row_lo, row_hi, 0), broadcast to [R, G] inside the rounds: the row-only and
    # group-only parts of the first two rounds are shared along the tile.
    w0, w1, w2, w3 = philox4x32(seed, group, row_lo, row_hi, tl.zeros_like(group), PHILOX_ROUNDS)
    p = threshold + tl.zeros((), tl.uint32)        # a tensor, as for the seed in philox4x32
    thr_lo = (p & 0x7F) * 0x01010101
    thr_hi = tl.where(p >= 128, 0x80808080, 0).to(tl.uint32)
    return (_byte_ge(w0, thr_lo, thr_hi, 0) | _byte_ge(w1, thr_lo, thr_hi, 1)
            | _byte_ge(w2, thr_lo, thr_hi, 2) | _byte_ge(w3, thr_lo, thr_hi, 3))


@triton.jit
def column_bit(cols):
    """The bit of column ``cols`` in its group's keep bits: 8 * (c % 4) + (c % 16) // 4."""
    return (1 << (8 * (cols % 4) + (cols % 16) // 4)).to(tl.uint32)


@triton.jit
def keep_mask(seed, rows, col_start, threshold, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              TRANSPOSED: tl.constexpr = False, SHARED_GROUPS: tl.constexpr = True):
    """Bool keep-mask [BLOCK_R, BLOCK_C] of global ``rows`` ([BLOCK_R], int64) and columns
    ``col_start .. col_start + BLOCK_C - 1`` (``col_start`` and ``BLOCK_C`` multiples of 16), or its
    transpose [BLOCK_C, BLOCK_R] when ``TRANSPOSED`` (the groups then run along the first axis).
    ``seed`` is the 64-bit stream seed (< 2**62), ``threshold`` the byte threshold P in [1, 255].

    ``SHARED_GROUPS``: the tile's layout spreads a group over several threads of a row (the MMA
    accumulator layouts: each lane of a quad holds 4 of a group's 16 columns), so each group's word is
    drawn once and moved (an identity gather: without it, layout propagation recomputes the Philox in
    the tile's layout, where the four lanes of a quad would each draw it). Tiles whose threads hold 8
    contiguous columns (the row kernels' 16-byte vectors) draw in place instead: a group is shared by
    two threads at most, cheaper than moving its word."""
    tl.static_assert(BLOCK_C % 16 == 0, "keep_mask draws whole 16-column groups")
    GROUPS: tl.constexpr = BLOCK_C // 16
    bits = group_keep_bits(seed, rows, col_start, threshold, BLOCK_R, GROUPS)
    if SHARED_GROUPS:
        bits = tl.gather(bits, tl.broadcast_to(tl.arange(0, GROUPS)[None, :], [BLOCK_R, GROUPS]), axis=1)
    col_bit = column_bit(tl.arange(0, BLOCK_C))
    if TRANSPOSED:
        bits = tl.reshape(tl.broadcast_to(tl.trans(bits)[:, None, :], [GROUPS, 16, BLOCK_R]), [BLOCK_C, BLOCK_R])
        return (bits & col_bit[:, None]) != 0
    else:
        bits = tl.reshape(tl.broadcast_to(bits[:, :, None], [BLOCK_R, GROUPS, 16]), [BLOCK_R, BLOCK_C])
        return (bits & col_bit[None, :]) != 0
