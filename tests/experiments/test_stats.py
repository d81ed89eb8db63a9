"""experiments/stats.py: bootstrap intervals of medians and paired ratios, verdicts."""

import random

from experiments.stats import (
    SIGNIFICANT,
    WITHIN_NOISE,
    is_improvement,
    median_ci,
    ratio_ci,
    verdict,
)


def test_median_ci_brackets_the_median_and_degenerates_to_one_sample():
    med, lo, hi = median_ci([5.0, 1.0, 3.0, 2.0, 4.0])
    assert med == 3.0 and 1.0 <= lo <= med <= hi <= 5.0
    assert median_ci([7.0]) == (7.0, 7.0, 7.0)
    assert median_ci([]) is None and median_ci(None) is None
    assert median_ci([1.0, float("nan"), 3.0])[0] == 2.0  # non-finite samples are dropped


def test_same_distribution_is_within_noise_a_large_shift_is_significant():
    rng = random.Random(0)
    base = [10 + rng.gauss(0, 1) for _ in range(5)]
    same = [10 + rng.gauss(0, 1) for _ in range(5)]
    ratio, lo, hi = ratio_ci(same, base)
    assert lo <= 1.0 <= hi and verdict(lo, hi) == WITHIN_NOISE
    slower = [12.6 + rng.gauss(0, 0.2) for _ in range(5)]  # ~1.26x, like no prepack_linear
    ratio, lo, hi = ratio_ci(slower, [10 + rng.gauss(0, 0.2) for _ in range(5)])
    assert 1.2 < ratio < 1.32 and lo > 1.0 and verdict(lo, hi) == SIGNIFICANT
    assert not is_improvement((ratio, lo, hi), lower_is_better=True)
    assert is_improvement((ratio, lo, hi), lower_is_better=False)


def test_pairing_removes_drift_shared_by_both_configurations():
    """Drift across rounds (both configurations slow down alike) hides a 5% effect from an
    unpaired comparison but not from the paired one."""
    drift = [10.0, 14.0, 9.0, 16.0, 11.0]
    base = drift
    faster = [0.95 * d for d in drift]
    ratio, lo, hi = ratio_ci(faster, base)
    assert abs(ratio - 0.95) < 1e-9 and hi < 1.0
    # unpaired (different round counts): the drift swamps the effect
    ratio, lo, hi = ratio_ci(faster, base + [12.0])
    assert verdict(lo, hi) == WITHIN_NOISE


def test_no_interval_without_two_rounds_on_each_side():
    assert ratio_ci([1.0], [1.0, 2.0]) is None
    assert ratio_ci([1.0, 2.0], []) is None
    assert ratio_ci([1.0, 2.0], [0.0, 0.0]) is None
    assert not is_improvement(None, lower_is_better=True)
