"""The report's numbers from timing rounds: intervals, deltas, verdicts, the best row.

Each job's results.json keeps its per-round samples (``rounds.samples``, written by
experiments.sweep). For every measure the report prints the median over rounds with its 95%
bootstrap interval, and for every delta against the sweep's baseline the ratio's paired 95%
t interval and a verdict, **significant** (the interval excludes no change) or **within noise**
(experiments.stats). A measure taken once (the cold compile) gets no interval and no verdict.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from experiments.stats import SIGNIFICANT, is_improvement, median_ci, ratio_ci, verdict

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


def delta(job: dict, base: dict, metric: str) -> Optional[tuple[float, float, float]]:
    """(ratio, lo, hi) of the job's median over the baseline's, paired by round."""
    return ratio_ci(round_samples(job, metric), round_samples(base, metric))


def value_text(value: Optional[float], ci: Optional[tuple[float, float, float]], fmt: str) -> str:
    if value is None:
        return "—"
    if ci is None:
        return format(value, fmt)
    return f"{format(value, fmt)} [{format(ci[1], fmt)}, {format(ci[2], fmt)}]"


def delta_text(d: Optional[tuple[float, float, float]]) -> str:
    """``+3.2% [+1.0, +5.1] significant`` / ``… within noise``; ``n=1`` without rounds."""
    if d is None:
        return "no interval (fewer than 2 rounds)"
    ratio, lo, hi = d
    pct = lambda r: f"{100 * (r - 1):+.1f}"  # noqa: E731
    return f"{pct(ratio)}% [{pct(lo)}, {pct(hi)}] {verdict(lo, hi)}"


def is_significant(d: Optional[tuple[float, float, float]]) -> bool:
    return d is not None and verdict(d[1], d[2]) == SIGNIFICANT


def same_code(results: dict, base: dict) -> bool:
    """Whether a job compiled to exactly the baseline's code (equal ``code_digest``): its
    delta can only be noise or a difference between builds, never an effect."""
    digest = results.get("code_digest")
    return digest is not None and digest == base.get("code_digest")


def best(
    jobs: Sequence[Any],
    base: Any,
    metric: str,
    lower_is_better: bool,
    changed: Any,
) -> Optional[Any]:
    """★ best: among the jobs (not the baseline) whose outputs equal the baseline's, whose
    compiled code differs from the baseline's and whose ``metric`` improves *significantly*
    on the baseline, the one with the best median; None when no job qualifies.
    ``changed(results)`` says whether outputs changed."""
    pool = []
    for job in jobs:
        if job is base or changed(job.results) or same_code(job.results, base.results):
            continue
        d = delta(job.results, base.results, metric)
        if is_improvement(d, lower_is_better):
            pool.append((d[0], job))
    if not pool:
        return None
    sign = 1 if lower_is_better else -1
    return min(pool, key=lambda p: sign * p[0])[1]


def verdict_lines(
    jobs: Sequence[Any], base: Any, labels: dict[str, str], metrics: Sequence[Any]
) -> list[str]:
    """One line per non-baseline job: each timed measure's delta, interval and verdict."""
    lines = []
    for job in jobs:
        if job is base:
            continue
        parts = []
        for m in metrics:
            if m.name not in SAMPLE_KEYS or m.value(job.results) is None:
                continue
            parts.append(f"{m.header} {delta_text(delta(job.results, base.results, m.name))}")
        if parts:
            note = (
                " — same compiled code as the baseline: these deltas measure noise"
                if same_code(job.results, base.results)
                else ""
            )
            lines.append(f"- `{labels[job.name]}` (job {job.name}): " + "; ".join(parts) + note)
    return lines


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
        f"baseline (paired by round) [95% t interval on log times], **significant** when the "
        f"interval excludes no change, else **within noise**."
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
