"""The report's numbers from timing rounds: intervals, deltas, verdicts, the best row.

Each job's results.json keeps its per-round samples (``rounds.samples``, written by
experiments.run.sweep) and which build each round timed. For every measure the report prints the
median over rounds with its 95% bootstrap interval, and for every delta against its cell's
baseline (experiments/run/cells.py) the geometric mean of the per-round ratios with its 95%
interval (paired t on log times; builds a random effect when they differ), the median of the
per-round ratios when it disagrees in sign, and a verdict: **significant** when the
Benjamini-Hochberg adjusted p-value (q) over every row x measure of the report is below 5%,
else **within noise** (experiments.report.statistics). A measure taken once (the cold compile)
gets no interval and no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from experiments.report.statistics import (
    CORRECTION,
    FDR,
    Comparison,
    bh_adjust,
    compare,
    median_ci,
)

SAMPLE_KEYS = {
    "decode_median": "decode_median_ms",
    "prefill_median": "prefill_median_ms",
    "tokens_per_s": "tokens_per_s",
}
"""Report metric name -> key of its per-round samples in ``results["rounds"]["samples"]``."""


def round_samples(results: dict, metric: str) -> list[float]:
    """The per-round samples of ``metric`` in a job's results ([] when not timed in rounds)."""
    rounds = results.get("rounds")
    samples = rounds.get("samples") if isinstance(rounds, dict) else None
    key = SAMPLE_KEYS.get(metric)
    values = samples.get(key) if isinstance(samples, dict) and key else None
    return [v for v in values if v is not None] if isinstance(values, list) else []


def interval(results: dict, metric: str) -> Optional[tuple[float, float, float]]:
    """(median, lo, hi) over the job's rounds, or None with fewer than 2 rounds."""
    samples = round_samples(results, metric)
    return median_ci(samples) if len(samples) >= 2 else None


MEASURE_RANGES = {
    "decode_median": ("decode",),
    "prefill_median": ("prefill",),
    "tokens_per_s": ("decode", "prefill"),
}
"""Which steps a timed measure times (their compile ranges decide whether its code changed)."""


def round_builds(results: dict) -> Optional[list[int]]:
    """Which build each round timed (``rounds.samples.build``), or None."""
    rounds = results.get("rounds")
    samples = rounds.get("samples") if isinstance(rounds, dict) else None
    builds = samples.get("build") if isinstance(samples, dict) else None
    if isinstance(builds, list) and all(isinstance(b, int) for b in builds):
        return builds
    return None


def delta(job: dict, base: dict, metric: str) -> Optional[Comparison]:
    """The job's rounds against the baseline's, paired by round (builds a random effect when
    both timed the same builds in the same order)."""
    builds = round_builds(job)
    if builds != round_builds(base):
        builds = None
    return compare(round_samples(job, metric), round_samples(base, metric), builds)


@dataclass
class Verdict:
    comparison: Comparison
    q: float
    """Benjamini-Hochberg adjusted p-value over the report's family."""

    @property
    def significant(self) -> bool:
        return self.q < FDR


@dataclass
class Family:
    """Every comparison of one report (each non-baseline job x timed measure against its
    cell's baseline), with q-values adjusted across all of them."""

    verdicts: dict[tuple[str, str], Verdict] = field(default_factory=dict)

    @classmethod
    def of(cls, pairs: Iterable[tuple[Any, Any]]) -> "Family":
        """``pairs``: (job, its baseline job) for every compared job of the report."""
        found: list[tuple[tuple[str, str], Comparison]] = []
        for job, base in pairs:
            for metric in SAMPLE_KEYS:
                d = delta(job.results, base.results, metric)
                if d is not None:
                    found.append(((str(job.path), metric), d))
        qs = bh_adjust([d.p for _, d in found])
        return cls({key: Verdict(d, q) for (key, d), q in zip(found, qs)})

    def get(self, job: Any, metric: str) -> Optional[Verdict]:
        return self.verdicts.get((str(job.path), metric))

    def __len__(self) -> int:
        return len(self.verdicts)


def value_text(value: Optional[float], ci: Optional[tuple[float, float, float]], fmt: str) -> str:
    if value is None:
        return "—"
    if ci is None:
        return format(value, fmt)
    return f"{format(value, fmt)} [{format(ci[1], fmt)}, {format(ci[2], fmt)}]"


def delta_text(v: Optional[Verdict]) -> str:
    """``+3.2% [+1.0, +5.1] q=0.012 significant`` / ``… within noise``, with a warning when
    the median of the per-round ratios disagrees in sign; ``no interval`` without rounds."""
    if v is None:
        return "no interval (fewer than 2 rounds)"
    d = v.comparison
    pct = lambda r: f"{100 * (r - 1):+.1f}"  # noqa: E731
    text = (
        f"{pct(d.ratio)}% [{pct(d.lo)}, {pct(d.hi)}] q={v.q:.3g} "
        f"{'significant' if v.significant else 'within noise'}"
    )
    if d.signs_disagree:
        text += f" ⚠ median of the rounds {pct(d.median_ratio)}%: disagrees in sign"
    return text


def is_significant(v: Optional[Verdict]) -> bool:
    return v is not None and v.significant


def same_code(results: dict, base: dict, metric: Optional[str] = None) -> bool:
    """Whether a job ran exactly the baseline's code for ``metric``'s steps: every compile
    range its decode (or prefill) steps ran has the baseline's digest (``code_digests``,
    ``ranges_used``); without ``metric``, or without per-range digests, the whole model's
    ``code_digest``.  Such a delta can only be noise or a difference between builds."""
    digests, base_digests = results.get("code_digests"), base.get("code_digests")
    used = results.get("ranges_used")
    if metric in MEASURE_RANGES and isinstance(digests, dict) and isinstance(base_digests, dict):
        if isinstance(used, dict):
            ranges = {r for kind in MEASURE_RANGES[metric] for r in used.get(kind) or []}
            if ranges:
                return all(
                    digests.get(r) is not None and digests.get(r) == base_digests.get(r)
                    for r in ranges
                )
    digest = results.get("code_digest")
    return digest is not None and digest == base.get("code_digest")


def best(
    jobs: Sequence[Any],
    baseline_of: dict[str, Any],
    metric: str,
    lower_is_better: bool,
    changed: Any,
    family: Family,
) -> Optional[Any]:
    """★ best: among the compared jobs whose outputs equal their baseline's, whose code for
    ``metric`` differs from the baseline's and whose ``metric`` improves *significantly*
    (after the report's correction), the one with the best ratio; None when none qualifies.
    ``baseline_of``: job name -> its cell's baseline job."""
    pool = []
    for job in jobs:
        base = baseline_of.get(job.name)
        if base is None or job is base or changed(job.results):
            continue
        if same_code(job.results, base.results, metric):
            continue
        v = family.get(job, metric)
        if v is None or not v.significant:
            continue
        d = v.comparison
        if (d.hi < 1.0) if lower_is_better else (d.lo > 1.0):
            pool.append((d.ratio, job))
    if not pool:
        return None
    sign = 1 if lower_is_better else -1
    return min(pool, key=lambda p: sign * p[0])[1]


def verdict_lines(
    jobs: Sequence[Any],
    base: Any,
    labels: dict[str, str],
    metrics: Sequence[Any],
    family: Family,
) -> list[str]:
    """One line per non-baseline job: each timed measure's delta, interval and verdict, and
    which measures ran the baseline's code (their deltas measure noise)."""
    lines = []
    for job in jobs:
        if job is base:
            continue
        parts = []
        same = []
        for m in metrics:
            if m.name not in SAMPLE_KEYS or m.value(job.results) is None:
                continue
            parts.append(f"{m.header} {delta_text(family.get(job, m.name))}")
            if same_code(job.results, base.results, m.name):
                same.append(m.name)
        if parts:
            note = ""
            if same and len(same) == len(parts):
                note = " — same compiled code as the baseline: these deltas measure noise"
            elif same:
                kinds = sorted({k for name in same for k in MEASURE_RANGES.get(name, ())})
                note = (
                    f" — same {'/'.join(kinds)} code as the baseline: the "
                    f"{', '.join(same)} delta(s) measure noise"
                )
            lines.append(f"- `{labels[job.name]}` (job {job.name}): " + "; ".join(parts) + note)
    return lines


def correction_note(family: Family) -> str:
    return (
        f"Verdicts: {CORRECTION} false discovery rate {FDR:.0%} over all {len(family)} "
        f"comparisons (rows x timed measures) of this report; q is the adjusted p-value."
    )


def rounds_note(jobs: Sequence[Any]) -> str:
    """How the sweep was timed: rounds per job and whether they were interleaved."""
    counts = sorted(
        {
            int(r["n"])
            for j in jobs
            if isinstance(r := j.results.get("rounds"), dict) and isinstance(r.get("n"), int)
        }
    )
    if not counts:
        return "Timed once per configuration (no rounds recorded): no intervals, no verdicts."
    inter = [
        isinstance(j.results.get("rounds"), dict) and j.results["rounds"].get("interleaved")
        for j in jobs
    ]
    how = (
        "interleaved round-robin across the configurations"
        if all(inter)
        else "back to back per configuration (not interleaved: machine drift can masquerade "
        "as an effect)"
        if not any(inter)
        else "partly interleaved"
    )
    n = "/".join(str(c) for c in counts)
    return (
        f"Timed in {n} round(s) per configuration, {how}. Cells: median over rounds "
        f"[95% bootstrap interval]; deltas: geometric mean of the per-round ratios to the "
        f"cell's baseline (paired by round) [95% t interval on log times; builds a random "
        f"effect when they differ], **significant** when the {CORRECTION}-adjusted q is "
        f"below {FDR:.0%}, else **within noise**."
    )


def unmatched_lines(jobs: Sequence[Any], labels: dict[str, str]) -> list[str]:
    """The zero-match fusion warnings of every job."""
    lines = []
    for job in jobs:
        names = job.results.get("unmatched_fusions")
        for name in names if isinstance(names, list) else []:
            lines.append(
                f"- ⚠ fusion `{name}` matched nothing in the whole model: "
                f"`{labels[job.name]}` (job {job.name})"
            )
    return lines
