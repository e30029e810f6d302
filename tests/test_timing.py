"""seqpar.bench.timing: paired_speedup (the statistic the benchmarks use to call one variant faster) and
device_time (the GPU time of back-to-back calls): its CPU fallback, and its batches against a simulated
GPU stream (the queue check, the retries, what is reported when the host cannot stay ahead)."""
import math
import random

import pytest
import torch

from seqpar.bench import timing
from seqpar.bench.timing import (Batch, calls_for, device_time, input_sets, measure_batches, paired_speedup,
                                 reuse_distance_l2, run_batch, summarize_batches)


def test_constant_ratio_gives_a_point_interval():
    base = [10.0, 12.0, 9.0, 30.0]
    res = paired_speedup(base, [b / 1.25 for b in base])
    assert res["median"] == pytest.approx(1.25) and res["wins"] == 1.0 and res["pairs"] == 4
    assert res["ci_low"] == pytest.approx(1.25) and res["ci_high"] == pytest.approx(1.25)


def test_median_wins_and_interval_of_known_ratios():
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3]
    res = paired_speedup([r * 7.0 for r in ratios], [7.0] * 5)
    assert res["median"] == pytest.approx(1.1)
    assert res["wins"] == pytest.approx(3 / 5)          # 1.0 is not a win
    assert 0.9 <= res["ci_low"] <= 1.1 <= res["ci_high"] <= 1.3


def test_pairing_finds_a_small_effect_under_large_shared_noise():
    """A 5% speedup buried in +-40% load swings shared by both variants of an iteration: the
    unpaired medians are inconclusive, the paired interval excludes 1 and contains 1.05."""
    rng = random.Random(3)
    load = [rng.uniform(0.6, 1.4) for _ in range(60)]
    base = [100.0 * l * rng.uniform(0.99, 1.01) for l in load]
    new = [100.0 / 1.05 * l * rng.uniform(0.99, 1.01) for l in load]
    res = paired_speedup(base, new)
    assert 1.0 < res["ci_low"] <= 1.05 <= res["ci_high"] < 1.1, res
    # the same data unpaired (shuffled): the effect is lost in the noise
    shuffled = paired_speedup(base, rng.sample(new, len(new)))
    assert shuffled["ci_low"] < 1.0 < shuffled["ci_high"], shuffled


def test_no_effect_interval_straddles_one():
    rng = random.Random(5)
    base = [rng.uniform(90, 110) for _ in range(40)]
    new = [rng.uniform(90, 110) for _ in range(40)]
    res = paired_speedup(base, new)
    assert res["ci_low"] < 1.0 < res["ci_high"], res


@pytest.mark.parametrize("base,new", [([1.0, 2.0], [1.0]), ([1.0], [1.0]), ([1.0, 0.0], [1.0, 1.0])])
def test_bad_series_raise(base, new):
    with pytest.raises(ValueError):
        paired_speedup(base, new)


# ----------------------------------------------------------------------------- device_time
class SimGpu:
    """One CUDA stream and the host clock, simulated (milliseconds): work queued at host time t starts
    when the stream is free and not before t; an event completes when the work queued before it has;
    waiting on one moves the host clock to it. Implements CudaQueue's interface for run_batch."""

    def __init__(self):
        self.t, self.free = 0.0, 0.0

    def clock(self) -> float:                      # seconds, as time.perf_counter
        return self.t / 1e3

    def launch(self, ms):
        self.free = max(self.free, self.t) + ms

    def call(self, host_ms, gpu_ms, syncs=False):
        """A provider's call: ``host_ms`` of launch path, then ``gpu_ms`` of kernels; ``syncs``: it
        waits for the GPU before returning (an .item(), a blocking copy)."""
        def fn():
            self.t += host_ms
            self.launch(gpu_ms)
            if syncs:
                self.t = max(self.t, self.free)
        return fn

    # CudaQueue's interface
    def sleep(self, ms):
        self.launch(ms)

    def event(self):
        self.free = max(self.free, self.t)
        return self.free

    def done(self, event):
        return self.t >= event

    def elapsed_ms(self, start, end):
        self.t = max(self.t, end)
        return end - start


def _runner(sim, fn):
    calls = iter(lambda: fn, None)              # the same callable forever
    return lambda n, sleep: run_batch(sim, calls, n, sleep, clock=sim.clock)


def test_a_batch_behind_a_long_enough_sleep_times_the_kernels_only():
    sim = SimGpu()
    batch = _runner(sim, sim.call(host_ms=0.1, gpu_ms=0.005))(8, 1.0)        # 8 x 0.1 ms issued in a 1 ms sleep
    assert batch.queue_full and batch.calls == 8
    assert batch.device_ms == pytest.approx(8 * 0.005) and batch.issue_ms == pytest.approx(0.8)


def test_a_batch_the_host_cannot_fill_is_flagged_and_includes_the_launch_gaps():
    sim = SimGpu()
    batch = _runner(sim, sim.call(host_ms=0.1, gpu_ms=0.005))(8, 0.3)        # the GPU wakes after 3 calls
    assert not batch.queue_full
    assert batch.device_ms > 8 * 0.005 * 5                                   # mostly waiting for the host


def test_measure_batches_lengthens_a_short_sleep_until_the_queue_stays_full():
    sim = SimGpu()
    run = _runner(sim, sim.call(host_ms=0.1, gpu_ms=0.005))
    # host estimate 10x too low: the first sleeps are too short, the retries double them
    batches = measure_batches(run, 0.01, reps=5, target_ms=0.25, min_calls=4, max_calls=16, margin=1.25,
                              slack_ms=0.0, max_sleep_ms=200.0, retries=3)
    assert len(batches) == 5 and all(b.queue_full for b in batches)
    result = summarize_batches(batches)
    assert result.ms == pytest.approx(0.005) and result.queue_full == 1.0 and result.note == ""
    assert result.host_ms == pytest.approx(0.1)
    assert result.calls == calls_for(0.005, 0.25, 4, 16) == 16               # 0.25 ms wants 50 calls: capped


def test_the_probe_sets_the_sleep_not_an_inflated_warm_up_estimate():
    """A warm-up whose host time held first-call costs (50 ms a call here) must not make every batch
    sleep 200 ms: the batches' sleep comes from the probe's measured host time."""
    sim = SimGpu()
    seen = []
    run = _runner(sim, sim.call(host_ms=0.1, gpu_ms=0.005))
    batches = measure_batches(lambda n, sleep: seen.append(sleep) or run(n, sleep), 50.0, reps=3, target_ms=0.25,
                              min_calls=4, max_calls=16, margin=1.25, slack_ms=0.2, max_sleep_ms=200.0, retries=3)
    assert seen[0] == 200.0 and seen[1:] == [pytest.approx(0.2 + 1.25 * 16 * 0.1)] * 3
    assert all(b.queue_full for b in batches)


def test_a_call_that_synchronizes_is_reported_as_an_upper_bound():
    sim = SimGpu()
    run = _runner(sim, sim.call(host_ms=0.1, gpu_ms=0.005, syncs=True))
    batches = measure_batches(run, 0.1, reps=3, target_ms=0.25, min_calls=4, max_calls=16, margin=1.25,
                              slack_ms=0.2, max_sleep_ms=5.0, retries=2)
    result = summarize_batches(batches)
    assert result.queue_full == 0.0 and "upper bound" in result.note and "3 of 3" in result.note
    assert result.ms > 0.005 and result.calls == 4                            # retries halved the calls


def test_summarize_takes_the_full_batches_when_some_drained():
    batches = [Batch(4, 1.0, 0.04, 0.4, True), Batch(4, 1.0, 0.4, 0.4, False), Batch(4, 1.0, 0.08, 0.4, True)]
    result = summarize_batches(batches)
    assert result.ms == pytest.approx(0.015)                                  # median of 0.01 and 0.02
    assert result.queue_full == pytest.approx(2 / 3) and "1 of 3" in result.note and "upper" not in result.note


def test_cpu_falls_back_to_wall_time_per_call_and_says_so(monkeypatch):
    """No CUDA device: host wall time of min_calls back-to-back calls, divided per call (a fake clock
    that the calls advance makes it exact), taking the callables in turn across batches."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    order = []

    def make(i, ms):
        def fn():
            order.append(i)
            now[0] += ms / 1e3
        return fn

    result = device_time([make(0, 2.0), make(1, 4.0), make(2, 6.0)], torch.device("cpu"), reps=3, warmup=1,
                         min_calls=2)
    assert order == [0, 1, 2] + [0, 1, 2, 0, 1, 2]                 # warm-up once each, then 3 batches of 2
    # batches: (0, 1) 3 ms per call, (2, 0) 4 ms, (1, 2) 5 ms: median 4
    assert result.ms == pytest.approx(4.0) and result.host_ms == pytest.approx(4.0)
    assert result.method == "wall-clock" and math.isnan(result.queue_full)
    assert "no CUDA device" in result.note and result.calls == 2 and result.batches == 3


def test_device_time_refuses_bad_arguments():
    with pytest.raises(ValueError):
        device_time([], torch.device("cpu"))
    with pytest.raises(ValueError):
        device_time(lambda: None, torch.device("cpu"), min_calls=8, max_calls=4)


def test_input_sets_keep_two_l2_sizes_between_uses_of_the_same_data():
    l2 = 50 * 2**20
    assert input_sets(2 * 2**20, l2) == 51                   # 50 other sets of 2 MiB pass between two uses
    assert reuse_distance_l2(2 * 2**20, 51, l2) == pytest.approx(2.0)
    assert input_sets(200 * 2**20, l2) == 1                  # one call moves 4 L2 sizes already
    assert reuse_distance_l2(200 * 2**20, 1, l2) == pytest.approx(4.0)
    assert input_sets(1024, l2) == 64 and input_sets(2 * 2**20, None) == 1   # capped; no L2 (CPU)
