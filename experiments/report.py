"""Markdown + PNG report of a Hydra multirun folder.

``python -m experiments.report DIR`` finds every ``results.json`` under ``DIR`` (one per job;
the schema is the contract in experiments/README.md), reads the job's overrides from
``.hydra/overrides.yaml`` next to it (falling back to ``results["overrides"]``), groups the
jobs by ``results["experiment"]`` and writes ``DIR/report.md`` with one table per sweep plus
PNG plots next to it. Missing keys never crash the report: they show as "—" and plots skip
the jobs that lack the value.

Rules (also in experiments/README.md):

* **Baseline** of a sweep: the first job (in job-number order) whose results say
  ``"baseline": true``; if none does, the first job. Deltas are relative to it.
* **Best** row: the lowest decode median (or the ``--metric`` chosen) among the jobs whose
  outputs did not change; only if every job changed outputs are all jobs eligible.
* **Outputs changed**: ``agreement.token_agreement < 1.0`` (or, when the agreement is absent,
  ``agreement.outputs_equal`` is false). Each such job gets a "⚠ outputs changed" line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from experiments.report_jobs import (  # noqa: F401  (re-exported)
    MISSING,
    Job,
    baseline_job,
    config_label,
    get,
    group_by_experiment,
    load_jobs,
    outputs_changed,
    unescape_override,
    varying_keys,
)
from experiments.report_plots import (
    write_plots,
)
from experiments.report_tables import (
    AGREEMENT,
    METRICS,
    best_job,
    changed_lines,
    pass_table,
    sweep_table,
)


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
    groups = group_by_experiment(jobs)
    num_changed = sum(outputs_changed(j.results) for j in jobs)
    lines = [
        f"# Experiment report: `{root}`",
        "",
        f"{len(jobs)} job(s) in {len(groups)} sweep(s). {_versions_line(jobs)}.",
        "",
        f'Baseline of a sweep: the first job with `"baseline": true` in results.json, '
        f"else the first job; deltas are relative to it. ★ best: "
        f"{'lowest' if best_metric.lower_is_better else 'highest'} {best_metric.header} "
        f"among configurations whose outputs are unchanged.",
        "",
    ]
    if num_changed:
        lines += [
            f"**{num_changed} configuration(s) changed outputs versus O0** "
            f"(see the ⚠ lines below).",
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

    for group, group_jobs in groups.items():
        keys = varying_keys(group_jobs)
        labels = {j.name: config_label(j, keys) for j in group_jobs}
        base = baseline_job(group_jobs)
        best = best_job(group_jobs, best_metric)
        lines += [
            f"## Sweep: {group}",
            "",
            f"Baseline: `{labels[base.name]}` (job {base.name}). Best: "
            + (
                f"`{labels[best.name]}` (job {best.name})."
                if best
                else f"{MISSING} (no job reports {best_metric.header})."
            ),
            "",
        ]
        lines += sweep_table(group_jobs, keys, base, best)
        lines.append("")
        changed = changed_lines(group_jobs, labels)
        unmeasured = [
            j.name
            for j in group_jobs
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
        passes = pass_table(group_jobs, labels)
        if passes:
            lines += ["### Pass matches (time)", ""] + passes + [""]
        if plots:
            for title, path in write_plots(group, group_jobs, labels, plot_dir or root):
                lines += [f"### {title}", "", f"![{title}]({path.name})", ""]
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
