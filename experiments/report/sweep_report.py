"""Markdown + PNG report of a Hydra multirun folder.

``python -m experiments.report DIR`` finds every ``results.json`` under ``DIR`` (one per job;
the schema is the contract in experiments/README.md), reads the job's overrides from
``.hydra/overrides.yaml`` next to it (falling back to ``results["overrides"]``), groups the
jobs by ``results["experiment"]`` and writes ``DIR/report.md`` with one table per sweep plus
PNG plots next to it. Missing keys never crash the report: they show as "—" and plots skip
the jobs that lack the value.

Rules (also in experiments/README.md):

* **Baselines, one per cell** (experiments/run/cells.py): a job whose results say
  ``"baseline": true`` is the baseline of its cell, the jobs that share its values of the
  keys in which the baselines differ (``compile=O1,O2,O3 'toggle_passes=[],[x]'``: one cell
  per level). No baseline flag: the first job. Two baselines in one cell: an error. Each cell
  gets its own section; deltas are relative to the cell's baseline.
* **Intervals and verdicts** (experiments/report/rounds.py, experiments/report/statistics.py):
  every timed measure is the median over the job's timing rounds with a 95% bootstrap interval;
  every delta against its baseline has a paired 95% interval (builds a random effect) and the
  verdict **significant** (Benjamini-Hochberg q < 5% over every row x measure of the report)
  or **within noise**; a delta whose steps ran the baseline's code says it measures noise.
* **Best** row (★): the largest improvement in decode median (or the ``--metric`` chosen), as
  the geometric mean of the paired per-round ratios to the baseline, among the jobs whose
  change against their baseline is a *significant* improvement, whose code for that measure
  differs from the baseline's and whose outputs equal the baseline's; none qualifying, no ★.
* **Outputs changed**: against the sweep's baseline (``agreement_baseline``) when measured,
  else against O0 (``agreement``): ``token_agreement < 1.0`` (or ``outputs_equal`` false).
  Each such job gets a "⚠ outputs changed" line. Agreement with O0 stays a column.
* **Warnings**: fusions that matched nothing in a job (``unmatched_fusions``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from experiments.report import rounds as report_rounds
from experiments.report.jobs import (  # noqa: F401  (names the report and its tests use)
    MISSING,
    Job,
    baseline_job,
    config_label,
    get,
    group_by_experiment,
    load_jobs,
    number,
    outputs_changed,
    reference_of,
    unescape_override,
    varying_keys,
)
from experiments.report.plots import write_plots
from experiments.report.spec import spec_table
from experiments.run.cells import CellPlan, plan_cells


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
    "token agreement vs O0",
    ("agreement", "token_agreement"),
    ".4f",
    lower_is_better=False,
)
LOGIT_DIFF = Metric(
    "max_logit_diff", "max logit diff vs O0", ("agreement", "max_logit_diff"), ".3g"
)
BASE_AGREEMENT = Metric(
    "baseline_token_agreement",
    "token agreement vs baseline",
    ("agreement_baseline", "token_agreement"),
    ".4f",
    lower_is_better=False,
)
BASE_LOGIT_DIFF = Metric(
    "baseline_max_logit_diff",
    "max logit diff vs baseline",
    ("agreement_baseline", "max_logit_diff"),
    ".3g",
)
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


def best_job(
    jobs: Sequence[Job],
    metric: Metric,
    base: Optional[Job] = None,
    family: Optional[report_rounds.Family] = None,
) -> Optional[Job]:
    """★ best: a significant improvement on ``metric`` with outputs unchanged against the
    baseline (report_rounds.best); None when no job qualifies."""
    if not jobs:
        return None
    base = base or baseline_job(jobs)
    family = family if family is not None else report_rounds.Family.of((j, base) for j in jobs)
    return report_rounds.best(
        jobs,
        {j.name: base for j in jobs},
        metric.name,
        metric.lower_is_better,
        outputs_changed,
        family,
    )


@dataclass
class Cell:
    """One baseline and the jobs compared with it."""

    label: str
    base: Job
    jobs: list[Job]


def sweep_cells(jobs: Sequence[Job]) -> tuple[list[Cell], list[Job]]:
    """The cells of one sweep (experiments/run/cells.py) and the jobs whose cell has no baseline."""
    plan: CellPlan = plan_cells(
        [j.override_map for j in jobs],
        [j.results.get("baseline") is True for j in jobs],
        [j.name for j in jobs],
    )
    cells, orphans = [], []
    for b in plan.baselines:
        members = [j for i, j in enumerate(jobs) if plan.baseline_of[i] == b]
        cells.append(Cell(plan.label(jobs[b].override_map), jobs[b], members))
    orphans = [j for i, j in enumerate(jobs) if plan.baseline_of[i] is None]
    return cells, orphans


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _cache_cell(results: dict) -> str:
    hits, misses = get(results, "compile", "cache_hits"), get(results, "compile", "cache_misses")
    if hits is None and misses is None:
        return MISSING
    return f"{MISSING if hits is None else hits}/{MISSING if misses is None else misses}"


def sweep_table(
    jobs: Sequence[Job],
    keys: Sequence[str],
    base: Job,
    best: Optional[Job],
    family: Optional[report_rounds.Family] = None,
) -> list[str]:
    """The markdown lines of one sweep's main table."""
    extra = [m for m in (EXACT_MATCH, PADDING) if any(m.value(j.results) is not None for j in jobs)]
    headers = (
        ["", "job"]
        + list(keys)
        + [m.header for m in METRICS.values()]
        + ["cache hits/misses", BASE_AGREEMENT.header, BASE_LOGIT_DIFF.header]
        + [AGREEMENT.header, LOGIT_DIFF.header]
        + [m.header for m in extra]
    )
    lines = [
        "| " + " | ".join(_cell(h) for h in headers) + " |",
        "|" + "|".join(["---"] * len(headers)) + "|",
    ]
    if family is None:
        family = report_rounds.Family.of((j, base) for j in jobs if j is not base)
    for job in jobs:
        marks = (["★ best"] if job is best else []) + (["baseline"] if job is base else [])
        if outputs_changed(job.results):
            marks.append("⚠")
        row = [", ".join(marks), job.name]
        row += [job.override_map.get(k, MISSING) for k in keys]
        for metric in METRICS.values():
            value = metric.value(job.results)
            ci = report_rounds.interval(job.results, metric.name)
            text = report_rounds.value_text(value, ci, metric.fmt)
            if metric.show_delta and job is not base and value is not None:
                if metric.name in report_rounds.SAMPLE_KEYS:
                    v = family.get(job, metric.name)
                    text += f" ({report_rounds.delta_text(v)})"
                else:  # measured once: a plain delta, no verdict
                    text = _with_delta(value, metric.value(base.results), metric.fmt) + " n=1"
            row.append(text)
        row.append(_cache_cell(job.results))
        row += [
            _fmt(m.value(job.results), m.fmt)
            for m in (BASE_AGREEMENT, BASE_LOGIT_DIFF, AGREEMENT, LOGIT_DIFF, *extra)
        ]
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
                if get(job.results, "passes", name, "matches_reported") is False:
                    matches = "not reported"
                cells.append(f"{MISSING if matches is None else matches}{timing}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def changed_lines(jobs: Sequence[Job], labels: dict[str, str]) -> list[str]:
    lines = []
    for job in jobs:
        if not outputs_changed(job.results):
            continue
        vs_base = reference_of(job.results) == "agreement_baseline"
        what = "the baseline" if vs_base else "O0"
        agreement = (BASE_AGREEMENT if vs_base else AGREEMENT).value(job.results)
        diff = (BASE_LOGIT_DIFF if vs_base else LOGIT_DIFF).value(job.results)
        details = []
        if agreement is not None:
            details.append(f"token agreement {agreement:.4f} vs {what}")
        else:
            details.append(f"outputs differ from {what}")
        if diff is not None:
            details.append(f"max logit diff {diff:.3g}")
        lines.append(
            f"- ⚠ outputs changed: `{labels[job.name]}` (job {job.name}) — " + ", ".join(details)
        )
    return lines


def _versions_line(jobs: Sequence[Job]) -> str:
    parts = []
    for key in ("torch", "piecewise", "python"):
        values = {
            str(get(j.results, "versions", key))
            for j in jobs
            if get(j.results, "versions", key) is not None
        }
        if values:
            parts.append(
                f"{key} {values.pop()}"
                if len(values) == 1
                else f"{key} varies ({', '.join(sorted(values))})"
            )
    return "Versions: " + ", ".join(parts) if parts else "Versions: " + MISSING


def _cell_section(
    group: str,
    cell: Cell,
    several: bool,
    best_metric: Metric,
    family: report_rounds.Family,
    plots: bool,
    plot_dir: Path,
) -> list[str]:
    """The tables, verdicts, warnings and plots of one cell (its jobs and its baseline)."""
    jobs, base = cell.jobs, cell.base
    keys = varying_keys(jobs)
    labels = {j.name: config_label(j, keys) for j in jobs}
    best = report_rounds.best(
        jobs,
        {j.name: base for j in jobs},
        best_metric.name,
        best_metric.lower_is_better,
        outputs_changed,
        family,
    )
    lines = [f"### Cell: {cell.label}", ""] if several else []
    lines += [
        f"Baseline: `{labels[base.name]}` (job {base.name}). Best: "
        + (
            f"`{labels[best.name]}` (job {best.name})."
            if best
            else f"none (no configuration is a significant improvement in "
            f"{best_metric.header} with unchanged outputs)."
        ),
        "",
        report_rounds.rounds_note(jobs),
        "",
    ]
    lines += sweep_table(jobs, keys, base, best, family)
    lines.append("")
    verdicts = report_rounds.verdict_lines(jobs, base, labels, list(METRICS.values()), family)
    if verdicts:
        lines += ["#### Deltas against the baseline", ""] + verdicts + [""]
    pays = break_even_lines(cell, labels)
    if pays:
        lines += ["#### Does compiling pay off?", ""] + pays + [""]
    changed = changed_lines(jobs, labels)
    unmeasured = [
        j.name
        for j in jobs
        if AGREEMENT.value(j.results) is None
        and get(j.results, "agreement", "outputs_equal") is None
    ]
    if changed:
        lines += changed
    elif unmeasured:
        lines.append(
            f"No measured configuration changed outputs; agreement was not "
            f"measured for job(s) {', '.join(unmeasured)}."
        )
    else:
        lines.append("Outputs unchanged in every configuration of this sweep.")
    lines.append("")
    warnings = report_rounds.unmatched_lines(jobs, labels)
    if warnings:
        lines += ["#### Warnings", ""] + warnings + [""]
    spec = spec_table(jobs, labels, base)
    if spec:
        lines += ["#### Speculative decoding", ""] + spec + [""]
    passes = pass_table(jobs, labels)
    if passes:
        lines += ["#### Pass matches (time)", ""] + passes + [""]
    if plots:
        name = group if not several else f"{group} {cell.label}"
        for title, path in write_plots(name, jobs, labels, plot_dir):
            lines += [f"#### {title}", "", f"![{title}]({path.name})", ""]
    return lines


def _level(results: dict) -> Optional[int]:
    level = get(results, "resolved_compilation", "level")
    if level is None:
        level = get(results, "config", "compile", "level")
    return level if isinstance(level, int) else None


def _tokens_text(n: Optional[float]) -> str:
    if n is None:
        return "never (not faster than O0)"
    if n <= 0:
        return "immediately (starts no slower than O0)"
    return f"{n:,.0f}"


def break_even_lines(cell: Cell, labels: dict[str, str]) -> list[str]:
    """When the cell's baseline is O0 (eager) and other jobs compile: per compiled level, its
    cold and warm start, its tokens/s, and after how many generated tokens the extra start
    time has paid for itself: (start - O0's start) / (O0's seconds per token - its seconds per
    token).  Empty when the cell has no O0 baseline or no timing."""
    base = cell.base
    tps0, start0 = number(base.results, "tokens_per_s"), number(base.results, "compile", "cold_s")
    if _level(base.results) != 0 or not tps0 or start0 is None:
        return []
    rows = []
    for job in cell.jobs:
        level, tps = _level(job.results), number(job.results, "tokens_per_s")
        if job is base or not level or not tps:
            continue
        cold, warm = (
            number(job.results, "compile", "cold_s"),
            number(job.results, "compile", "warm_s"),
        )
        gain = 1.0 / tps0 - 1.0 / tps  # seconds saved per generated token

        def tokens(start: Optional[float]) -> str:
            if start is None:
                return MISSING
            extra = start - start0
            return _tokens_text(None if gain <= 0 else extra / gain if extra > 0 else 0.0)

        rows.append(
            f"| `{labels[job.name]}` | {_fmt(cold, '.2f')} | {_fmt(warm, '.2f')} | {tps:.1f} "
            f"| {1e3 * gain:+.3f} | {tokens(cold)} | {tokens(warm)} |"
        )
    if not rows:
        return []
    return [
        f"Against `{labels[base.name]}` (eager: start {start0:.2f} s, {tps0:.1f} tokens/s). "
        f"Break-even = extra start time / time saved per generated token (tokens/s over the "
        f"workload, medians over rounds).",
        "",
        "| configuration | cold start s | warm start s | tokens/s | ms saved per token | "
        "break-even after a cold start (tokens) | break-even after a warm start (tokens) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def failed_lines(failed: Sequence[Job]) -> list[str]:
    """The "Failed jobs" section: each failed job, its overrides, when it failed, the error
    and its log file (empty when no job failed)."""
    if not failed:
        return []
    lines = [
        "## Failed jobs",
        "",
        "| job | overrides | failed at | error | log |",
        "|---|---|---|---|---|",
    ]
    for j in failed:
        logs = sorted(p.name for p in j.path.glob("*.log"))
        error = str(j.results.get("error") or MISSING).splitlines()[0][:300]
        lines.append(
            f"| {_cell(j.name)} | {_cell(' '.join(j.overrides) or MISSING)} | "
            f"{_cell(j.results.get('failed_at') or MISSING)} | {_cell(error)} | "
            f"{_cell(', '.join(f'{j.name}/{n}' for n in logs) or MISSING)} |"
        )
    return lines + [""]


def build_report(
    root: Path, metric: str = "decode_median", plots: bool = True, plot_dir: Optional[Path] = None
) -> str:
    """Write the PNGs for every sweep under ``root`` into ``plot_dir`` (default ``root``)
    and return the markdown text (which links the PNGs by file name)."""
    if metric not in METRICS:
        raise ValueError(f"report: unknown metric {metric!r}; choose one of {sorted(METRICS)}")
    best_metric = METRICS[metric]
    jobs, problems = load_jobs(root)
    if not jobs:
        raise FileNotFoundError(
            f"report: no results.json under {root}; pass the multirun "
            f"folder (e.g. multirun/2025-01-01/12-00-00)"
        )
    failed = [j for j in jobs if j.results.get("status") == "failed"]
    jobs = [j for j in jobs if j.results.get("status") != "failed"]
    groups = group_by_experiment(jobs)
    num_changed = sum(outputs_changed(j.results) for j in jobs)
    lines = [
        f"# Experiment report: `{root}`",
        "",
        f"{len(jobs)} job(s) in {len(groups)} sweep(s)"
        + (f", **{len(failed)} failed** (see Failed jobs)" if failed else "")
        + f". {_versions_line(jobs)}.",
        "",
        f'Baseline of a sweep: the first job with `"baseline": true` in results.json, '
        f"else the first job; deltas are relative to it, outputs are compared with its outputs. "
        f"★ best: the largest improvement in {best_metric.header} (the geometric mean of "
        f"its per-round ratios to the baseline, not the raw median) among configurations "
        f"whose change is a significant improvement, whose outputs equal the baseline's and "
        f"whose compiled code differs from the baseline's (equal code: the delta can only be "
        f"noise).",
        "",
    ]
    if num_changed:
        lines += [
            f"**{num_changed} configuration(s) changed outputs versus their sweep's baseline "
            f"(or O0 where no baseline agreement was measured)** (see the ⚠ lines below).",
            "",
        ]
    elif any(AGREEMENT.value(j.results) is not None for j in jobs):
        lines += ["No configuration changed outputs: every measured token agreement is 1.0.", ""]
    else:
        lines += ["Token agreement was not measured by any job.", ""]
    for problem in problems:
        lines.append(f"- skipped: {problem}")
    if problems:
        lines.append("")
    lines += failed_lines(failed)

    plans = {group: sweep_cells(group_jobs) for group, group_jobs in groups.items()}
    family = report_rounds.Family.of(
        (job, cell.base)
        for cells, _ in plans.values()
        for cell in cells
        for job in cell.jobs
        if job is not cell.base
    )
    lines += [report_rounds.correction_note(family), ""]
    for group, group_jobs in groups.items():
        cells, orphans = plans[group]
        lines += [f"## Sweep: {group}", ""]
        if len(cells) > 1:
            lines += [
                f"{len(cells)} cells, each with its own baseline: "
                + "; ".join(f"`{c.label}` (baseline job {c.base.name})" for c in cells)
                + ".",
                "",
            ]
        for job in orphans:
            lines.append(
                f"- ⚠ job {job.name} has no baseline in its cell (no job with "
                f'`"baseline": true` shares its values of the cell keys): not compared'
            )
        if orphans:
            lines.append("")
        for cell in cells:
            lines += _cell_section(
                group, cell, len(cells) > 1, best_metric, family, plots, plot_dir or root
            )
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    root: Path | str,
    metric: str = "decode_median",
    plots: bool = True,
    output: Optional[Path | str] = None,
) -> Path:
    """Build the report for ``root`` and write it to ``output`` (default ``root/report.md``)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"report: {root} is not a folder")
    out = Path(output) if output is not None else root / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = build_report(root, metric=metric, plots=plots, plot_dir=out.parent)
    out.write_text(text, encoding="utf-8")
    return out


def main(argv: Optional[Sequence[str]] = None, echo: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.report",
        description="Markdown + PNG report of a Hydra multirun.",
    )
    parser.add_argument("dir", help="multirun folder (holds one subfolder per job)")
    parser.add_argument(
        "--metric",
        default="decode_median",
        choices=sorted(METRICS),
        help="column that picks the best row (default: decode_median)",
    )
    parser.add_argument(
        "--no-plots", dest="plots", action="store_false", help="write only report.md"
    )
    parser.add_argument("--output", default=None, help="report path (default DIR/report.md)")
    args = parser.parse_args(argv)
    out = write_report(args.dir, metric=args.metric, plots=args.plots, output=args.output)
    echo(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
