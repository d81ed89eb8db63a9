"""experiments/report/statistics.py: bootstrap intervals of medians and paired ratios, verdicts."""

import random

from experiments.report.statistics import (
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
    from experiments.report.statistics import t_quantile

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


def _simulated_report(rng, effect=0.0, sigma_build=0.02, rows=10, measures=3, rounds=5):
    """p-values of one simulated report: ``rows`` configurations x ``measures`` against a
    baseline, ``rounds`` paired rounds, each round its own build (a random build effect of
    ``sigma_build`` on both sides), machine drift shared by a round's pair, 2% run noise; the
    first row has a real ``effect`` (a log ratio)."""
    import numpy as np

    from experiments.report.statistics import compare

    builds = list(range(rounds))
    ps = []
    for row in range(rows):
        for _ in range(measures):
            drift = rng.normal(0, 0.05, rounds)
            noise = lambda: rng.normal(0, sigma_build, rounds) + rng.normal(0, 0.02, rounds)  # noqa: E731
            base = np.exp(2.3 + drift + noise())
            job = np.exp(2.3 + drift + (effect if row == 0 else 0.0) + noise())
            ps.append(compare(list(job), list(base), builds).p)
    return ps


def test_corrected_verdicts_hold_the_false_positive_rate_of_a_10_row_aa_report():
    """Simulated A/A reports (10 rows x 3 measures, 5 rounds, build effects): with the
    Benjamini-Hochberg correction at most ~5% of reports show any "significant" verdict;
    uncorrected 5% tests on the same p-values call something in most reports. The power for
    a real 10% effect at the default 5 rounds is printed (and bounded) too."""
    import numpy as np

    from experiments.report.statistics import FDR, bh_adjust

    rng = np.random.default_rng(7)
    n = 150
    corrected = uncorrected = 0
    for _ in range(n):
        ps = _simulated_report(rng)
        corrected += any(q < FDR for q in bh_adjust(ps))
        uncorrected += any(p < 0.05 for p in ps)
    assert corrected / n <= 0.10, corrected / n  # 5% nominal; Monte-Carlo sd ~1.8%
    assert uncorrected / n > 0.5, uncorrected / n  # ~1 - 0.95**30
    hits = sum(bh_adjust(_simulated_report(rng, np.log(1.1), 0.0))[0] < FDR for _ in range(n))
    print(
        f"A/A reports with a false discovery: {corrected / n:.3f} (uncorrected "
        f"{uncorrected / n:.3f}); power for a 10% effect, no build noise: {hits / n:.2f}"
    )
    assert hits / n >= 0.6


def test_builds_as_a_random_effect_widen_the_interval_only_when_builds_differ():
    from experiments.report.statistics import compare

    base = [10.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    # builds 0 and 1 alternate; the job's builds run 3% and 5% slower: two draws of a build
    # effect, each repeated three times (pseudo-replicates, not six independent samples)
    job = [10.3, 10.5, 10.31, 10.51, 10.29, 10.49]
    builds = [0, 1, 0, 1, 0, 1]
    plain = compare(job, base)
    nested = compare(job, base, builds)
    assert plain.method == "paired t over rounds" and nested.method == "builds as a random effect"
    assert nested.df == 1 and (nested.hi - nested.lo) > (plain.hi - plain.lo)
    assert plain.p < 0.05 < nested.p  # two builds cannot tell a 4% effect from build draws
    # no build effect: the paired t over rounds
    same_builds = [10.1, 9.9, 9.9, 10.1, 10.0, 10.0]  # both builds average the same
    assert compare(same_builds, base, builds).method == "paired t over rounds"


def test_median_of_round_ratios_flags_an_outlier_that_flips_the_sign():
    from experiments.report.statistics import compare

    base = [6.9, 6.9, 6.9, 6.9, 6.9]
    job = [6.95, 6.93, 6.94, 4.0, 6.96]  # one outlier round pulls the geometric mean down
    c = compare(job, base)
    assert c.ratio < 1.0 < c.median_ratio and c.signs_disagree


def test_bh_adjust_matches_the_definition():
    from experiments.report.statistics import bh_adjust

    # p sorted: .01 .02 .03 .04 .20 -> q_i = min over j >= i of p_j m / j
    q = bh_adjust([0.04, 0.01, 0.20, 0.03, 0.02])
    assert [round(x, 4) for x in q] == [0.05, 0.05, 0.2, 0.05, 0.05]
    assert bh_adjust([]) == []
