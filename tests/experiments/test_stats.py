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


def test_t_quantile_matches_the_tables():
    from experiments.stats import t_quantile

    # Student's t, two-sided 95%: df 1 -> 12.706, 4 -> 2.776, 9 -> 2.262, 30 -> 2.042
    for df, want in ((1, 12.706), (4, 2.776), (9, 2.262), (30, 2.042), (2, 4.303), (3, 3.182)):
        assert abs(t_quantile(0.975, df) - want) < 2e-3, df
    assert abs(t_quantile(0.975, 1e6) - 1.960) < 1e-3


def _share_significant(n_rounds: int, trials: int, effect: float = 1.0) -> float:
    """Share of simulated comparisons called significant: both configurations share each
    round's drift (lognormal, 10%), each sample has its own 5% noise, ``samples`` is
    ``effect`` times slower."""
    import numpy as np

    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(trials):
        drift = np.exp(rng.normal(0, 0.10, n_rounds))
        a = 10 * effect * drift * np.exp(rng.normal(0, 0.05, n_rounds))
        b = 10 * drift * np.exp(rng.normal(0, 0.05, n_rounds))
        _, lo, hi = ratio_ci(list(a), list(b))
        hits += verdict(lo, hi) == SIGNIFICANT
    return hits / trials


def test_aa_comparisons_are_significant_at_the_stated_rate():
    """An interval that claims 95% must call about 5% of A/A comparisons significant, at
    the default 5 rounds and at 10 (binomial sd over 600 trials: 0.9 points)."""
    for n in (5, 10):
        assert 0.02 <= _share_significant(n, 600) <= 0.08, n


def test_real_effects_are_found():
    """Power with that noise: a 1.26x slowdown (no prepack_linear on CPU) at 5 rounds, a
    10% one at 10 rounds."""
    assert _share_significant(5, 300, effect=1.26) >= 0.95
    assert _share_significant(10, 300, effect=1.10) >= 0.8
