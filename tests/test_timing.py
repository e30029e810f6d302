"""seqpar.bench.timing.paired_speedup: the statistic the benchmarks use to call one variant faster."""
import random

import pytest

from seqpar.bench.timing import paired_speedup


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
