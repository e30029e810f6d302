"""Median wall time of a callable: CUDA events on GPU, perf_counter on CPU (shared by the benchmarks)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

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
