"""Pieces shared by the row-wise Triton kernels (LayerNorm, RMSNorm, SwiGLU, RoPE): rounding under the
interpreter, the launch heuristics, the allocator every launcher uses, and the deterministic column
reduction of a backward pass.

Column sums without atomics: each backward program of a row kernel accumulates its rows into one fp32
partial row per summed quantity, written to ``partials[q, program, :]`` of an ``[n_buffers, n_partials, h]``
buffer; :func:`reduce_partials` then sums the partial rows of every buffer (``_reduce_partials_kernel``:
one program per 32-column block of one buffer).

Only core ``tl`` ops are used, so everything runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["cast_rne", "interpreting", "sm_count", "rows_per_block", "chunk_columns", "num_warps",
           "row_sums_config", "empty", "reduce_partials", "partial_slots", "zero_sums", "column_sums",
           "resident_per_sm", "wave_programs", "split_rows"]


@triton.jit
def cast_rne(v, dtype: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """``v.to(dtype)`` with round-to-nearest-even.

    The CPU interpreter truncates fp32 -> bf16 (and its "rtne" mode rounds ties away), so there the bf16
    rounding is done on the bits; on a GPU the native conversion already rounds to nearest even. A NaN
    becomes bf16's quiet NaN (0x7FC0): rounding its bits carried a NaN with a full mantissa (0x7FFFFFFF,
    0xFFFFFFFF) into +-0.
    """
    if MANUAL_BF16 and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        bits = tl.where(v != v, 0x7FC0, bits)
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


def chunk_columns(h: int, widest: int, narrowest: int = 1024) -> int:
    """Columns per chunk of a row wider than ``widest``: the widest power of two in [narrowest, widest]
    whose padding (the masked columns of the last chunk) is at most h / 8, else ``narrowest``; h = 6144
    takes three chunks of 2048, not two of 4096 with a quarter of the second chunk's threads idle."""
    block_n, narrowest = widest, min(narrowest, widest)
    while block_n > narrowest and triton.cdiv(h, block_n) * block_n - h > h // 8:
        block_n //= 2
    return block_n


def num_warps(tile_elements: int, cap: int, per_thread: int = 8) -> int:
    """About ``per_thread`` fp32 values per thread per live tensor for the tile; clamped to [4, cap]."""
    return max(4, min(cap, triton.next_power_of_2(max(tile_elements // (32 * per_thread), 1))))


def row_sums_config(n_rows: int, block_n: int) -> Tuple[int, dict]:
    """(BLOCK_M, launch options) of a normalisation backward's row-sum pass over chunks of ``block_n``
    columns (rows too wide for one backward program): tiles of about 4096 elements, 8 per thread (one or
    two fp32 running sums each, no reduction inside the loop); few fat programs under the interpreter."""
    if interpreting():
        return rows_per_block(n_rows, block_n, 1 << 14), {}
    block_m = rows_per_block(n_rows, block_n, 4096)
    return block_m, {"num_warps": num_warps(block_m * block_n, 32, per_thread=8)}


# Programs per SM a backward launch is sized for where the compiled kernel's registers can't be read.
FALLBACK_RESIDENT_PER_SM = 4
_resident: Dict[tuple, int] = {}


def occupancy(n_regs: int, num_warps: int, shared: int, props) -> int:
    """Programs (thread blocks) one SM holds at once: the least of its register, thread and shared-memory
    limits, with registers allocated per warp in units of 256 (the CUDA occupancy calculator's rules)."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = props.regs_per_multiprocessor // regs_per_warp // num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024) if shared else by_threads
    return max(1, min(by_regs, by_threads, by_shared))


def resident_per_sm(kernel, args: Sequence, launch: dict, device: torch.device) -> int:
    """Programs of ``kernel`` compiled for ``args`` and ``launch`` (its constexprs and options) that one
    SM holds at once, what ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` tells the CUDA backend.
    Cached per kernel, device, argument dtypes and launch. Reading the registers takes Triton's compiled
    kernel internals (``n_regs`` once the binary is loaded); without them, FALLBACK_RESIDENT_PER_SM."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (getattr(kernel, "__name__", id(kernel)), index, tuple(sorted(launch.items())),
           tuple(getattr(a, "dtype", type(a)) for a in args))
    if key not in _resident:
        try:
            compiled = kernel.warmup(*args, grid=(1,), **launch)
            compiled._init_handles()          # loads the binary; n_regs is known from then on
            _resident[key] = occupancy(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                                       torch.cuda.get_device_properties(index))
        except (AttributeError, TypeError):   # a Triton whose compiled kernels expose neither
            _resident[key] = FALLBACK_RESIDENT_PER_SM
    return _resident[key]


def wave_programs(kernel, args: Sequence, launch: dict, device: torch.device, n_chunks: int) -> int:
    """Row-range programs per column chunk that fill the device once (one wave of resident programs of
    ``kernel`` compiled for ``args`` / ``launch``); 4 fat programs under the interpreter."""
    if interpreting():
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, sm_count(index) * resident_per_sm(kernel, args, launch, device) // n_chunks)


def split_rows(n_rows: int, block_m: int, max_programs: int) -> Tuple[int, int]:
    """(programs, rows per program) for a backward over ``n_rows`` rows in tiles of ``block_m`` with at most
    ``max_programs`` programs: each program a contiguous row range of whole tiles, writing one fp32
    partial row per summed quantity. One wave (wave_programs) is enough: more programs than fit the device
    at once add only partial rows for the reduction to write and read."""
    tiles = triton.cdiv(max(n_rows, 1), block_m)
    rows_per_program = triton.cdiv(tiles, min(tiles, max(1, max_programs))) * block_m
    return triton.cdiv(max(n_rows, 1), rows_per_program), rows_per_program


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the row-kernel launchers allocate (outputs and partial sums); tests poison it with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _reduce_partials_kernel(PARTS, OUT0, OUT1, OUT2, n_partials, h, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (column block, buffer q): OUTq[cols] = sum over the n_partials rows of PARTS[q][:, cols].
    pid_n = tl.program_id(0)
    q = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < h
    part = PARTS + q.to(tl.int64) * n_partials * h
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(part + rows.to(tl.int64)[:, None] * h + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if q == 0:
        tl.store(OUT0 + cols, total, mask=col_mask)
    elif q == 1:
        tl.store(OUT1 + cols, total, mask=col_mask)
    else:
        tl.store(OUT2 + cols, total, mask=col_mask)


# Columns of one reduction program: 32 fp32 are one 128-byte line per partial row, and a narrow block
# gives many programs (h / 32 per buffer). With 128 columns, h = 4096 had 32 programs for three 6-25 MB
# buffers and took 54 us on an H200 (1.4% SM throughput), twice the backward kernel it follows.
REDUCE_BLOCK_N = 32
REDUCE_BLOCK_P = 64


def reduce_partials(partials: torch.Tensor) -> List[torch.Tensor]:
    """The column sums (fp32 [h] each, separate tensors) of contiguous fp32 partial rows
    ``[n_buffers, n_partials, h]``, n_buffers in 1 .. 3: one program per (32-column block, buffer)."""
    n_buffers, n_partials, h = partials.shape
    if not 1 <= n_buffers <= 3 or not partials.is_contiguous():
        raise ValueError(f"partials must be a contiguous [1..3, n_partials, h] buffer, got {tuple(partials.shape)}")
    outs = [empty((h,), torch.float32, partials.device) for _ in range(n_buffers)]
    if interpreting():  # one program per buffer: a few [n_partials, h] numpy sums
        block_n, block_p = triton.next_power_of_2(h), triton.next_power_of_2(n_partials)
    else:
        block_n, block_p = REDUCE_BLOCK_N, min(triton.next_power_of_2(n_partials), REDUCE_BLOCK_P)
    padded = outs + [outs[0]] * (3 - n_buffers)          # unused pointer arguments
    _reduce_partials_kernel[(triton.cdiv(h, block_n), n_buffers)](partials, *padded, n_partials, h,
                                                                 BLOCK_P=block_p, BLOCK_N=block_n)
    return outs


def partial_slots(wanted: Sequence[bool]) -> Tuple[Tuple[int, ...], int]:
    """(buffer of each column sum in a backward's partial rows, -1 for one not wanted; number of buffers):
    the wanted sums take buffers 0, 1, ... in their order, so a frozen parameter's sum costs no traffic."""
    slots, n_buffers = [], 0
    for want in wanted:
        slots.append(n_buffers if want else -1)
        n_buffers += bool(want)
    return tuple(slots), n_buffers


def column_sums(partials: torch.Tensor, slots: Sequence[int]) -> List[Optional[torch.Tensor]]:
    """The column sums of ``partials`` ([buffers, n_partials, h]) in slot order (:func:`reduce_partials`);
    None for a slot of -1. Nothing is launched when no sum is wanted."""
    sums = reduce_partials(partials) if any(s >= 0 for s in slots) else []
    return [sums[s] if s >= 0 else None for s in slots]


def zero_sums(wanted: Sequence[bool], h: int, device: torch.device) -> List[Optional[torch.Tensor]]:
    """The column sums of no rows: fp32 zeros [h] where wanted, None elsewhere."""
    return [torch.zeros((h,), dtype=torch.float32, device=device) if want else None for want in wanted]
