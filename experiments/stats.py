"""Intervals and verdicts for repeated timing rounds (what experiments.report prints).

A configuration is timed in R rounds (``rounds`` in conf/config.yaml, 5 by default); round r of
every configuration of a sweep ran back to back (experiments.sweep), so the rounds of two
configurations are *paired*: drift of the machine between rounds hits both alike.

* ``median_ci(samples)``: the median of the round samples and a 95% percentile-bootstrap
  interval of it (rounds resampled with replacement, 2000 resamples, fixed seed: the report
  is reproducible); what a configuration's cells show.
* ``ratio_ci(samples, base)``: the geometric mean of the per-round ratios samples[r] /
  base[r] and its 95% paired Student-t interval (a t test on log times, n - 1 degrees of
  freedom; Welch's unpaired interval when the round counts differ).
* ``verdict(lo, hi)``: **significant** when the ratio's interval excludes 1 (the delta's
  interval excludes 0), else **within noise**.

The t interval holds its 5% false-positive rate at 5 rounds (simulated A/A comparisons with
drift shared by paired rounds: 5.3%, where the paired bootstrap of medians used before gave
7.1%). What no number of rounds fixes is a difference between two *builds* of one
configuration (memory placement of weights, code path); the A/A sweep
(conf/experiment/aa_noise.yaml) is how to check a machine and the code for that.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SIGNIFICANT = "significant"
WITHIN_NOISE = "within noise"


def _clean(samples: Optional[Sequence[float]]) -> list[float]:
    if not samples:
        return []
    return [
        float(x)
        for x in samples
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    ]


def _bounds(stats: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def median_ci(
    samples: Optional[Sequence[float]], *, resamples: int = RESAMPLES, level: float = LEVEL
) -> Optional[tuple[float, float, float]]:
    """(median, lo, hi) of the round samples; None without samples (one sample: lo = hi)."""
    xs = np.asarray(_clean(samples))
    if xs.size == 0:
        return None
    med = float(np.median(xs))
    if xs.size == 1:
        return med, med, med
    rng = np.random.default_rng(0)
    idx = rng.integers(0, xs.size, size=(resamples, xs.size))
    lo, hi = _bounds(np.median(xs[idx], axis=1), level)
    return med, lo, hi


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom (real
    ``df`` > 0, as Welch's test needs): bisection on the CDF, the density integrated by
    Simpson's rule (no scipy here; |error| < 1e-4 for df >= 1)."""
    if not 0.5 < q < 1 or df <= 0:
        raise ValueError(f"t_quantile: need 0.5 < q < 1 and df > 0, got q={q}, df={df}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float) -> float:
        t = np.linspace(0.0, x, 4001)
        f = c * (1 + t * t / df) ** (-(df + 1) / 2)
        h = x / 4000
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def ratio_ci(
    samples: Optional[Sequence[float]],
    base: Optional[Sequence[float]],
    *,
    level: float = LEVEL,
) -> Optional[tuple[float, float, float]]:
    """(ratio, lo, hi): how ``samples`` compare with ``base``, as a ratio with its ``level``
    interval, from a t test on log times (timings are positive and their noise is
    multiplicative).

    * Same number of rounds: *paired* by round index (round r of both configurations ran
      back to back).  ``ratio`` is the geometric mean of the per-round ratios
      ``samples[r] / base[r]``; the interval is Student's t interval of the mean log ratio
      with n - 1 degrees of freedom.
    * Otherwise unpaired: the ratio of geometric means, with Welch's interval.

    Why not the bootstrap of the medians (what the cells use): with 5 rounds a percentile
    bootstrap is too narrow -- 7% false "significant" in simulated A/A comparisons against
    the 5% it claims (the t interval: 5%; tests/experiments/test_stats.py).  None when either
    side has fewer than 2 positive finite rounds (no interval can be claimed)."""
    a = np.asarray([x for x in _clean(samples) if x > 0])
    b = np.asarray([x for x in _clean(base) if x > 0])
    if a.size < 2 or b.size < 2:
        return None
    q = 1 - (1 - level) / 2
    la, lb = np.log(a), np.log(b)
    if a.size == b.size and len(_clean(samples)) == len(_clean(base)):
        d = la - lb
        mean, se, df = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(d.size), d.size - 1
    else:
        va, vb = la.var(ddof=1) / a.size, lb.var(ddof=1) / b.size
        mean, se = float(la.mean() - lb.mean()), math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se > 0 else 1.0
    half = t_quantile(q, df) * se if se > 0 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(lo: float, hi: float) -> str:
    """``significant`` when the ratio's interval [lo, hi] excludes 1, else ``within noise``."""
    return SIGNIFICANT if lo > 1.0 or hi < 1.0 else WITHIN_NOISE


def is_improvement(ci: Optional[tuple[float, float, float]], lower_is_better: bool) -> bool:
    """A significant change of the ratio in the good direction."""
    if ci is None:
        return False
    _, lo, hi = ci
    return hi < 1.0 if lower_is_better else lo > 1.0
