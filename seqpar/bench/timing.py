"""Timing helpers shared by the benchmarks.

* :func:`median_ms`: median time of ONE call, start to end (CUDA events on GPU, perf_counter on CPU),
  optionally after an L2 flush, with a synchronize after every run. On a GPU this is the *eager call
  time*: the host's launch path (Python, dispatcher, autograd, Triton's launcher) is inside it, and for
  small shapes it is most of it.
* :func:`device_time`: the *device time* of a call: what the GPU spends on the call's kernels when the
  host runs ahead of it, as in a training step. See its docstring for the method and why.
* :func:`paired_speedup`: the speedup of one variant over another from paired timings.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

#: The L2 size :func:`l2_bytes` assumes when torch does not say: H100 / H200 (GH100: 50 MB of L2 enabled).
DEFAULT_L2_BYTES = 50 * 2**20


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


# ----------------------------------------------------------------------------- device time
@dataclass(frozen=True)
class Batch:
    """One timed batch: ``calls`` back-to-back calls issued while the GPU slept ``sleep_ms``.

    ``device_ms``: event after the sleep to event after the last call (the GPU's time on the batch);
    ``issue_ms``: host time to issue the batch; ``queue_full``: the GPU had not yet reached the first
    call when the host had issued the last one, so it never waited for the host inside the batch."""
    calls: int
    sleep_ms: float
    device_ms: float
    issue_ms: float
    queue_full: bool


@dataclass(frozen=True)
class DeviceTime:
    """Result of :func:`device_time`.

    ms          median device milliseconds per call (over the batches whose queue stayed full, or over
                all batches when none did: then an upper bound that includes launch gaps)
    host_ms     median host milliseconds to issue one call while the GPU is busy (the launch path)
    calls       calls per batch (the last batch's: retries may halve it)
    batches     timed batches
    queue_full  fraction of the timed batches whose queue stayed full (1.0: every one; nan: no queue,
                the wall-clock fallback)
    method      "cuda-back-to-back" or "wall-clock"
    note        why a fallback was taken, or that the queue drained; "" when neither
    """
    ms: float
    host_ms: float
    calls: int
    batches: int
    queue_full: float
    method: str
    note: str = ""


class CudaQueue:
    """The device side of a batch on the current CUDA stream: a GPU-side sleep, timing events, and
    whether the GPU has reached an event yet (:meth:`done`, a non-blocking ``cudaEventQuery``)."""

    _cycles_per_ms: Dict[int, float] = {}

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.can_sleep = hasattr(torch.cuda, "_sleep")
        if self.can_sleep and self.index not in self._cycles_per_ms:
            self._cycles_per_ms[self.index] = self._calibrate()

    def _calibrate(self) -> float:
        """``torch.cuda._sleep`` spins for a number of GPU clock cycles: cycles per millisecond, from
        timing a 2M-cycle sleep (clocks may move later: the batches check the queue themselves)."""
        torch.cuda._sleep(20_000_000)          # ~10 ms at boost clock: lets an idle GPU raise its clocks first
        start = self.event()
        torch.cuda._sleep(2_000_000)
        end = self.event()
        return 2_000_000 / max(self.elapsed_ms(start, end), 1e-3)

    def sleep(self, ms: float) -> None:
        if self.can_sleep and ms > 0:
            torch.cuda._sleep(max(1, int(ms * self._cycles_per_ms[self.index])))

    @staticmethod
    def event() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def done(event) -> bool:
        return event.query()

    @staticmethod
    def elapsed_ms(start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end)


def run_batch(queue, fns: Iterator[Callable[[], object]], calls: int, sleep_ms: float,
              clock: Callable[[], float] = time.perf_counter) -> Batch:
    """Sleep the GPU ``sleep_ms``, record ``start``, issue ``calls`` calls (the next ones of ``fns``),
    record ``end``; then ask, before waiting, whether the GPU has reached ``start``. It has not
    (``queue_full``): every call was queued before the GPU finished sleeping, so ``start .. end`` is
    device time only. It has: the GPU may have idled waiting for the host (a host slower than the sleep,
    a synchronizing call, or a full launch queue blocking the host), and ``device_ms`` is an upper bound.
    ``queue`` is a :class:`CudaQueue` (a simulated one in the tests)."""
    queue.sleep(sleep_ms)
    start = queue.event()
    t0 = clock()
    for _ in range(calls):
        next(fns)()
    end = queue.event()
    issue_ms = (clock() - t0) * 1e3
    full = not queue.done(start)
    return Batch(calls, sleep_ms, queue.elapsed_ms(start, end), issue_ms, full)


def sleep_for(calls: int, host_ms_per_call: float, margin: float, slack_ms: float) -> float:
    """GPU sleep that covers issuing ``calls`` calls: ``margin`` x their host time + ``slack_ms``."""
    return slack_ms + margin * calls * host_ms_per_call


def calls_for(device_ms_per_call: float, target_ms: float, min_calls: int, max_calls: int) -> int:
    """Calls per batch: enough for ``target_ms`` of device time, within ``[min_calls, max_calls]``."""
    want = math.ceil(target_ms / max(device_ms_per_call, 1e-6))
    return max(min_calls, min(max_calls, want))


def measure_batches(run: Callable[[int, float], Batch], host_ms_per_call: float, *, reps: int, target_ms: float,
                    min_calls: int, max_calls: int, margin: float, slack_ms: float, max_sleep_ms: float,
                    retries: int) -> List[Batch]:
    """The timed batches of :func:`device_time`, given ``run(calls, sleep_ms) -> Batch``.

    A probe batch of ``min_calls`` (not counted; rerun with a longer sleep while its queue drains, at
    most ``retries`` times) gives the device time per call, hence the calls per batch
    (:func:`calls_for`) and the sleep (:func:`sleep_for`, from the probe's host time per call). A
    timed batch whose queue drained is run again (``retries`` times at most) with the sleep doubled (at
    least ``margin`` x the host time it just took, at most ``max_sleep_ms``) and, from the second retry
    on, half the calls; the adjustments stay for the later batches. A batch still drained after the
    retries is kept, marked."""
    sleep = min(max_sleep_ms, sleep_for(min_calls, host_ms_per_call, margin, slack_ms))
    for attempt in range(retries + 1):
        probe = run(min_calls, sleep)
        if probe.queue_full:
            break
        sleep = min(max_sleep_ms, max(2 * sleep, slack_ms + margin * probe.issue_ms))
    host = probe.issue_ms / probe.calls       # steady state (the estimate may hold a first call's allocations)
    calls = calls_for(probe.device_ms / probe.calls, target_ms, min_calls, max_calls)
    sleep = min(max_sleep_ms, sleep_for(calls, host, margin, slack_ms))
    batches = []
    for _ in range(reps):
        for attempt in range(retries + 1):
            batch = run(calls, sleep)
            if batch.queue_full or attempt == retries:
                break
            sleep = min(max_sleep_ms, max(2 * sleep, slack_ms + margin * batch.issue_ms))
            if attempt >= 1:
                calls = max(min_calls, calls // 2)
        batches.append(batch)
    return batches


def summarize_batches(batches: Sequence[Batch], method: str = "cuda-back-to-back") -> DeviceTime:
    """:class:`DeviceTime` of timed batches: the median per-call device time of the batches whose queue
    stayed full (of all batches, flagged in ``note``, when none did)."""
    full = [b for b in batches if b.queue_full]
    used = full or list(batches)
    note = ""
    if len(full) < len(batches):
        note = (f"the launch queue drained in {len(batches) - len(full)} of {len(batches)} batches"
                + ("" if full else ": device time is an upper bound (host launch gaps included)"))
    return DeviceTime(ms=statistics.median(b.device_ms / b.calls for b in used),
                      host_ms=statistics.median(b.issue_ms / b.calls for b in batches),
                      calls=batches[-1].calls, batches=len(batches), queue_full=len(full) / len(batches),
                      method=method, note=note)


def device_time(fns: Union[Callable[[], object], Sequence[Callable[[], object]]], device: torch.device, *,
                reps: int = 8, warmup: int = 1, target_ms: float = 0.25, min_calls: int = 4, max_calls: int = 16,
                margin: float = 1.25, slack_ms: float = 0.2, max_sleep_ms: float = 200.0,
                retries: int = 3) -> DeviceTime:
    """Device milliseconds per call of ``fns`` (one callable, or several taken in turn), without the
    host's launch gaps: the time the GPU spends on the call's kernels when the host runs ahead of it.

    Method (CUDA): a batch of K calls issued back to back, no synchronization between them, behind a
    GPU-side sleep (``torch.cuda._sleep``) long enough for the host to queue all K before the GPU
    reaches the first; events after the sleep and after the last call time the batch, and K divides
    it. Every batch checks that the queue stayed full (:func:`run_batch`: the GPU had not left the
    sleep when the host issued the last call); a drained batch is retried with a longer sleep and
    fewer calls (:func:`measure_batches`), and one still drained is reported
    (``DeviceTime.queue_full`` < 1, ``note``). The median over ``reps`` batches is returned, with the
    host time per call (the launch path the eager call time also contains).

    Why this method. It times the very eager call that the call time (:func:`median_ms`) times, so it
    works the same for every provider: seqpar custom ops launching Triton or CUDA kernels, torch eager,
    torch.compile'd functions, Liger's Triton autograd functions, and a backward alone through
    ``torch.autograd.grad(..., retain_graph=True)`` (no forward inside it). It counts every kernel,
    memset and copy the call queues, and the in-stream gaps between them, which a training step also
    pays. The alternatives each fail some provider or miss some time: CUDA-graph replay
    (``triton.testing.do_bench_cudagraph``) needs every provider to be capturable, and autograd backward,
    torch.compile guards and host-side logic in peers' autograd functions are where capture fails or
    changes what runs (graph-private memory pools, RNG offsets), with a fallback then timing something
    else; torch.profiler sums kernel durations only, drops the gaps between kernels, perturbs the host
    and depends on telling the call's kernels from others by name. The one condition this method rests
    on, that the host stays ahead, is checked in every batch rather than assumed.

    L2: nothing is flushed between the back-to-back calls (a flush would be inside the timed batch).
    With a single callable, a call whose data fits in L2 (50 MB on H100 / H200) reads it from L2 in
    every call but the first, and bandwidth then exceeds DRAM's. Pass several callables, each on its own
    copy of the inputs, to take them in turn (the rotation continues across batches): with
    :func:`input_sets` copies, the same data comes back only after at least twice the L2 size of other
    data has passed through, so it is read from DRAM as in a step where other layers run in between.

    Fallback: on a device other than CUDA there is no launch queue; the host wall time of ``min_calls``
    back-to-back calls is returned (``method`` "wall-clock", ``queue_full`` nan, ``note`` says so).
    Without ``torch.cuda._sleep`` the batches run with no sleep and their check reports what it sees.
    """
    fn_list = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if not fn_list:
        raise ValueError("device_time needs at least one callable")
    if reps < 1 or min_calls < 1 or max_calls < min_calls:
        raise ValueError(f"need reps >= 1 and 1 <= min_calls <= max_calls, got {reps}, {min_calls}, {max_calls}")
    rotation = itertools.cycle(fn_list)
    t0 = time.perf_counter()
    for _ in range(warmup * len(fn_list)):
        next(rotation)()
    host_ms = (time.perf_counter() - t0) * 1e3 / max(1, warmup * len(fn_list))
    if device.type != "cuda":
        batches = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(min_calls):
                next(rotation)()
            wall = (time.perf_counter() - t0) * 1e3
            batches.append(Batch(min_calls, 0.0, wall, wall, True))
        return dataclasses.replace(summarize_batches(batches, method="wall-clock"), queue_full=math.nan,
                                   note=f"no CUDA device ({device.type}): host wall time of {min_calls} "
                                        "back-to-back calls, not a GPU's time")
    torch.cuda.synchronize(device)
    queue = CudaQueue(device)
    batches = measure_batches(lambda calls, sleep: run_batch(queue, rotation, calls, sleep), host_ms, reps=reps,
                              target_ms=target_ms, min_calls=min_calls, max_calls=max_calls, margin=margin,
                              slack_ms=slack_ms, max_sleep_ms=max_sleep_ms, retries=retries)
    result = summarize_batches(batches)
    if not queue.can_sleep:
        note = "torch.cuda._sleep missing: batches ran without a GPU-side sleep"
        result = dataclasses.replace(result, note="; ".join(n for n in (note, result.note) if n))
    return result


def l2_bytes(device: torch.device) -> Optional[int]:
    """The device's L2 size in bytes (CUDA; ``DEFAULT_L2_BYTES`` when torch does not say), None on CPU."""
    if device.type != "cuda":
        return None
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def input_sets(bytes_per_call: int, l2: Optional[int], *, l2_multiple: float = 2.0, cap: int = 64) -> int:
    """Copies of a call's inputs to take in turn so that between two uses of the same data at least
    ``l2_multiple`` x ``l2`` bytes of other data pass through L2: ``ceil(l2_multiple * l2 / bytes_per_call)
    + 1`` (the other copies' calls move it), at most ``cap``; 1 when one call already moves that much
    (a streaming kernel has evicted its first bytes by the time it ends) or without an L2 size."""
    if not l2 or bytes_per_call <= 0 or bytes_per_call >= l2_multiple * l2:
        return 1
    return min(cap, math.ceil(l2_multiple * l2 / bytes_per_call) + 1)


def reuse_distance_l2(bytes_per_call: int, sets: int, l2: int) -> float:
    """Bytes that pass through L2 between two uses of the same data, in L2 sizes, when ``sets`` copies
    of the inputs are taken in turn: ``(sets - 1) * bytes_per_call / l2``, or ``bytes_per_call / l2``
    with one set. At 2 or more the data is read from DRAM; below 1 it can stay in L2."""
    return max(sets - 1, 1) * bytes_per_call / l2


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
