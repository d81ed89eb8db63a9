"""Intervals and verdicts for repeated timing rounds (what experiments.report.sweep_report prints).

A configuration is timed in R rounds (``rounds`` in conf/config.yaml, 5 by default); round r of
every configuration of a sweep ran back to back (experiments.run.sweep), so the rounds of two
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

import functools
import math
from dataclasses import dataclass
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


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom (real ``df`` > 0): the density
    integrated by Simpson's rule (no scipy here; |error| < 1e-4 for df >= 1)."""
    if df <= 0:
        raise ValueError(f"t_cdf: need df > 0, got {df}")
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    t = np.linspace(0.0, x, 4001)
    f = c * (1 + t * t / df) ** (-(df + 1) / 2)
    h = x / 4000
    return min(1.0, 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom:
    bisection on :func:`t_cdf`."""
    if not 0.5 < q < 1 or df <= 0:
        raise ValueError(f"t_quantile: need 0.5 < q < 1 and df > 0, got q={q}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Comparison:
    """A configuration's timing against its baseline's, from paired rounds."""

    ratio: float
    """Geometric mean of the per-round ratios (job / baseline)."""
    lo: float
    hi: float
    """The ratio's 95% interval (uncorrected for multiple comparisons)."""
    p: float
    """Two-sided p-value of "no change" (t test on log ratios)."""
    median_ratio: float
    """Median of the per-round ratios: disagrees in sign with ``ratio`` when one round is an
    outlier."""
    df: float
    method: str
    """``paired t over rounds``, ``builds as a random effect`` or ``unpaired (Welch)``."""

    @property
    def signs_disagree(self) -> bool:
        return (self.ratio - 1.0) * (self.median_ratio - 1.0) < 0


def compare(
    samples: Optional[Sequence[float]],
    base: Optional[Sequence[float]],
    builds: Optional[Sequence[int]] = None,
    *,
    level: float = LEVEL,
) -> Optional[Comparison]:
    """How ``samples`` compare with ``base`` (see :func:`ratio_ci` for the pairing).

    ``builds``: which build of the configuration each round timed (round r of both sides ran
    build ``builds[r]``, experiments.run.sweep).  Two builds of one configuration can differ
    (memory placement, page layout) by more than rounds vary, so builds are a *random
    effect*, not pseudo-replicates: the per-round log ratios are grouped by build, and when
    the between-build mean square exceeds the within-build one, the mean's variance is
    ``sigma_e^2 / n + sigma_u^2 * sum(n_k^2) / n^2`` (one-way random-effects ANOVA) with
    ``B - 1`` degrees of freedom; otherwise (no build effect seen) the paired t over rounds."""
    a_all, b_all = _clean(samples), _clean(base)
    if len(a_all) == len(b_all) and len(a_all) >= 2 and all(x > 0 for x in a_all + b_all):
        d = np.log(np.asarray(a_all)) - np.log(np.asarray(b_all))
        n = d.size
        mean = float(d.mean())
        se, df, method = float(d.std(ddof=1)) / math.sqrt(n), n - 1.0, "paired t over rounds"
        groups = _build_groups(d, builds)
        if groups is not None:
            se_b = _random_effect_se(d, groups)
            if se_b is not None:
                se, df, method = se_b, float(len(groups) - 1), "builds as a random effect"
        ratios = np.exp(d)
        median_ratio = float(np.median(ratios))
    else:
        ci = ratio_ci(samples, base, level=level)
        if ci is None:
            return None
        a = np.log(np.asarray([x for x in a_all if x > 0]))
        b = np.log(np.asarray([x for x in b_all if x > 0]))
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        mean, se = float(a.mean() - b.mean()), math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se > 0 else 1.0
        median_ratio, method = float(np.exp(np.median(a) - np.median(b))), "unpaired (Welch)"
    if se > 0:
        half = t_quantile(1 - (1 - level) / 2, df) * se
        p = 2.0 * (1.0 - t_cdf(abs(mean) / se, df))
    else:
        half, p = 0.0, (1.0 if mean == 0 else 0.0)
    return Comparison(
        ratio=math.exp(mean),
        lo=math.exp(mean - half),
        hi=math.exp(mean + half),
        p=max(0.0, min(1.0, p)),
        median_ratio=median_ratio,
        df=df,
        method=method,
    )


def _build_groups(d: np.ndarray, builds: Optional[Sequence[int]]) -> Optional[list[np.ndarray]]:
    if builds is None or len(builds) != d.size:
        return None
    keys = sorted(set(builds))
    if len(keys) < 2:
        return None
    return [d[[i for i, b in enumerate(builds) if b == k]] for k in keys]


def _random_effect_se(d: np.ndarray, groups: list[np.ndarray]) -> Optional[float]:
    """The standard error of the mean log ratio with builds as a random effect, or None when
    the data show no between-build variance (or cannot estimate it)."""
    n, k = d.size, len(groups)
    if n - k < 1:
        return None
    grand = float(d.mean())
    sizes = np.asarray([g.size for g in groups], dtype=float)
    ms_between = float(sum(g.size * (g.mean() - grand) ** 2 for g in groups)) / (k - 1)
    ms_within = float(sum(((g - g.mean()) ** 2).sum() for g in groups)) / (n - k)
    n0 = (n - float((sizes**2).sum()) / n) / (k - 1)
    if ms_between <= ms_within or n0 <= 0:
        return None
    sigma_u2 = (ms_between - ms_within) / n0
    var = ms_within / n + sigma_u2 * float((sizes**2).sum()) / n**2
    return math.sqrt(var)


FDR = 0.05
CORRECTION = "Benjamini-Hochberg"


def bh_adjust(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values): a comparison is significant at false
    discovery rate ``FDR`` when its q-value is below it.  The family is every row x measure
    of one report."""
    m = len(pvalues)
    if m == 0:
        return []
    order = sorted(range(m), key=lambda i: pvalues[i])
    q = [0.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, pvalues[i] * m / rank)
        q[i] = running
    return q


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
