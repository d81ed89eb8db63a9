"""Intervals and verdicts for repeated timing rounds (what experiments.report prints).

A configuration is timed in R rounds (``rounds`` in conf/config.yaml, 5 by default); round r of
every configuration of a sweep ran back to back (experiments.sweep), so the rounds of two
configurations are *paired*: drift of the machine between rounds hits both alike.

* ``median_ci(samples)``: the median of the round samples and a 95% percentile-bootstrap
  interval of it (rounds resampled with replacement, 2000 resamples, fixed seed: the report
  is reproducible).
* ``ratio_ci(samples, base)``: the ratio median(samples) / median(base) and a 95% paired
  percentile-bootstrap interval of it (both resampled with the *same* round indices).
* ``verdict(lo, hi)``: **significant** when the ratio's interval excludes 1 (the delta's
  interval excludes 0), else **within noise**.

With 5 rounds the bootstrap interval of a median spans roughly the smallest to the largest
round, so "significant" means every round of the configuration sits on the same side of its
paired baseline round (like a sign test: about a 6% false-positive rate per comparison when
nothing changed). Use ``rounds=10`` or more for a claim you publish.
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


def ratio_ci(
    samples: Optional[Sequence[float]],
    base: Optional[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Optional[tuple[float, float, float]]:
    """(ratio, lo, hi) of median(samples) / median(base); paired by round index when both
    have the same number of rounds, else the two are resampled independently. None when
    either side has fewer than 2 rounds (no interval can be claimed) or a median is 0."""
    a, b = np.asarray(_clean(samples)), np.asarray(_clean(base))
    if a.size < 2 or b.size < 2:
        return None
    ma, mb = float(np.median(a)), float(np.median(b))
    if mb == 0:
        return None
    rng = np.random.default_rng(0)
    ia = rng.integers(0, a.size, size=(resamples, a.size))
    ib = ia if a.size == b.size else rng.integers(0, b.size, size=(resamples, b.size))
    den = np.median(b[ib], axis=1)
    num = np.median(a[ia], axis=1)
    ok = den != 0
    lo, hi = _bounds(num[ok] / den[ok], level)
    return ma / mb, lo, hi


def verdict(lo: float, hi: float) -> str:
    """``significant`` when the ratio's interval [lo, hi] excludes 1, else ``within noise``."""
    return SIGNIFICANT if lo > 1.0 or hi < 1.0 else WITHIN_NOISE


def is_improvement(ci: Optional[tuple[float, float, float]], lower_is_better: bool) -> bool:
    """A significant change of the ratio in the good direction."""
    if ci is None:
        return False
    _, lo, hi = ci
    return hi < 1.0 if lower_is_better else lo > 1.0
