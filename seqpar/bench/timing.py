"""Timing helpers shared by the benchmarks: median wall time of a callable (CUDA events on GPU,
perf_counter on CPU) and the speedup of one variant over another from paired timings."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Optional, Sequence

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int,
              before: Optional[Callable[[], object]] = None) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs.

    ``before`` runs ahead of each timed run, outside the timed region (e.g. an L2 flush).
    """
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paired_speedup(base_ms: Sequence[float], new_ms: Sequence[float], *, resamples: int = 2000,
                   seed: int = 0) -> Dict[str, float]:
    """Speedup of ``new`` over ``base`` from paired timings (iteration i of both ran back to back).

    Per pair ``ratio_i = base_ms[i] / new_ms[i]`` (> 1: new is faster). Pairing cancels what the two
    share within an iteration (load on the machine, cache and clock state), which on a shared CPU
    moves single timings by more than the effect measured. Returns ``median`` (of the ratios; the
    lower middle one for an even count),
    ``ci_low`` / ``ci_high`` (percentile-bootstrap 95% interval of that median, ``resamples`` draws
    with a fixed ``seed``), ``wins`` (fraction of pairs with ratio > 1) and ``pairs``. "new is faster"
    is shown when ``ci_low > 1``.
    """
    if len(base_ms) != len(new_ms) or len(base_ms) < 2:
        raise ValueError(f"need two equally long series of at least 2 timings, got {len(base_ms)} and "
                         f"{len(new_ms)}")
    if min(base_ms) <= 0 or min(new_ms) <= 0:
        raise ValueError("timings must be positive")
    ratios = torch.tensor([b / n for b, n in zip(base_ms, new_ms)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(ratios), (resamples, len(ratios)), generator=gen)
    medians = ratios[draws].median(dim=1).values.sort().values
    return {"median": ratios.median().item(),
            "ci_low": medians[int(0.025 * (resamples - 1))].item(),
            "ci_high": medians[int(0.975 * (resamples - 1))].item(),
            "wins": (ratios > 1).double().mean().item(), "pairs": float(len(ratios))}
