"""Markdown tables of :mod:`experiments.report`: the metrics (where each lives in results.json,
how it prints), the sweep table with deltas against the baseline, the pass table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from experiments.report_jobs import MISSING, Job, get, number, outputs_changed


@dataclass(frozen=True)
class Metric:
    """A numeric column: where it lives in results.json and how it prints."""

    name: str
    header: str
    keys: tuple[str, ...]
    fmt: str
    lower_is_better: bool = True
    show_delta: bool = False

    def value(self, results: dict) -> Optional[float]:
        return number(results, *self.keys)


METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric(
            "decode_median",
            "decode median ms",
            ("latency_ms", "decode", "median"),
            ".2f",
            show_delta=True,
        ),
        Metric("decode_p90", "decode p90 ms", ("latency_ms", "decode", "p90"), ".2f"),
        Metric(
            "prefill_median",
            "prefill median ms",
            ("latency_ms", "prefill", "median"),
            ".2f",
            show_delta=True,
        ),
        Metric(
            "tokens_per_s",
            "tokens/s",
            ("tokens_per_s",),
            ".1f",
            lower_is_better=False,
            show_delta=True,
        ),
        Metric("compile_cold", "compile cold s", ("compile", "cold_s"), ".2f", show_delta=True),
        Metric("compile_warm", "warm s", ("compile", "warm_s"), ".2f"),
    ]
}
AGREEMENT = Metric(
    "token_agreement",
    "token agreement",
    ("agreement", "token_agreement"),
    ".4f",
    lower_is_better=False,
)
LOGIT_DIFF = Metric("max_logit_diff", "max logit diff", ("agreement", "max_logit_diff"), ".3g")
EXACT_MATCH = Metric(
    "exact_match", "exact match", ("accuracy", "exact_match"), ".3f", lower_is_better=False
)
PADDING = Metric("padding_waste", "padding waste", ("padding_waste",), ".2%")


def _fmt(value: Optional[float], fmt: str) -> str:
    return MISSING if value is None else format(value, fmt)


def _with_delta(value: Optional[float], base: Optional[float], fmt: str) -> str:
    text = _fmt(value, fmt)
    if value is None or base is None or base == 0:
        return text
    return f"{text} ({100 * (value - base) / abs(base):+.1f}%)"


def best_job(jobs: Sequence[Job], metric: Metric) -> Optional[Job]:
    """Best job by ``metric`` among jobs with unchanged outputs (all jobs if none qualify)."""
    scored = [j for j in jobs if metric.value(j.results) is not None]
    unchanged = [j for j in scored if not outputs_changed(j.results)]
    pool = unchanged or scored
    if not pool:
        return None
    sign = 1 if metric.lower_is_better else -1
    return min(pool, key=lambda j: sign * metric.value(j.results))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _cache_cell(results: dict) -> str:
    hits, misses = get(results, "compile", "cache_hits"), get(results, "compile", "cache_misses")
    if hits is None and misses is None:
        return MISSING
    return f"{MISSING if hits is None else hits}/{MISSING if misses is None else misses}"


def sweep_table(
    jobs: Sequence[Job], keys: Sequence[str], base: Job, best: Optional[Job]
) -> list[str]:
    """The markdown lines of one sweep's main table."""
    extra = [m for m in (EXACT_MATCH, PADDING) if any(m.value(j.results) is not None for j in jobs)]
    headers = (
        ["", "job"]
        + list(keys)
        + [m.header for m in METRICS.values()]
        + ["cache hits/misses", AGREEMENT.header, LOGIT_DIFF.header]
        + [m.header for m in extra]
    )
    lines = [
        "| " + " | ".join(_cell(h) for h in headers) + " |",
        "|" + "|".join(["---"] * len(headers)) + "|",
    ]
    for job in jobs:
        marks = (["★ best"] if job is best else []) + (["baseline"] if job is base else [])
        if outputs_changed(job.results):
            marks.append("⚠")
        row = [", ".join(marks), job.name]
        row += [job.override_map.get(k, MISSING) for k in keys]
        for metric in METRICS.values():
            value = metric.value(job.results)
            if metric.show_delta and job is not base:
                row.append(_with_delta(value, metric.value(base.results), metric.fmt))
            else:
                row.append(_fmt(value, metric.fmt))
        row.append(_cache_cell(job.results))
        row += [_fmt(m.value(job.results), m.fmt) for m in (AGREEMENT, LOGIT_DIFF, *extra)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def pass_table(jobs: Sequence[Job], labels: dict[str, str]) -> list[str]:
    """Per-pass match counts (and time) per configuration; empty when no job has passes."""
    names: list[str] = []
    for job in jobs:
        passes = get(job.results, "passes")
        if isinstance(passes, dict):
            names.extend(n for n in passes if n not in names)
    if not names:
        return []
    lines = [
        "| configuration | " + " | ".join(_cell(n) for n in names) + " |",
        "|" + "|".join(["---"] * (len(names) + 1)) + "|",
    ]
    for job in jobs:
        cells = [labels[job.name]]
        for name in names:
            matches = get(job.results, "passes", name, "matches")
            seconds = number(job.results, "passes", name, "time_s")
            if matches is None and seconds is None:
                cells.append(MISSING)
            else:
                timing = "" if seconds is None else f" ({1000 * seconds:.1f} ms)"
                cells.append(f"{MISSING if matches is None else matches}{timing}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def changed_lines(jobs: Sequence[Job], labels: dict[str, str]) -> list[str]:
    lines = []
    for job in jobs:
        if not outputs_changed(job.results):
            continue
        agreement = AGREEMENT.value(job.results)
        diff = LOGIT_DIFF.value(job.results)
        details = []
        if agreement is not None:
            details.append(f"token agreement {agreement:.4f} vs O0")
        else:
            details.append("outputs differ from O0")
        if diff is not None:
            details.append(f"max logit diff {diff:.3g}")
        lines.append(
            f"- ⚠ outputs changed: `{labels[job.name]}` (job {job.name}) — " + ", ".join(details)
        )
    return lines
