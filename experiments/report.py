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
* **Intervals and verdicts** (experiments/report_rounds.py, experiments/stats.py): every timed
  measure is the median over the job's timing rounds with a 95% bootstrap interval; every
  delta against the baseline has a paired 95% interval and the verdict **significant** or
  **within noise**.
* **Best** row (★): the best decode median (or the ``--metric`` chosen) among the jobs whose
  change against the baseline is a *significant* improvement and whose outputs equal the
  baseline's; no job qualifying, no ★.
* **Outputs changed**: against the sweep's baseline (``agreement_baseline``) when measured,
  else against O0 (``agreement``): ``token_agreement < 1.0`` (or ``outputs_equal`` false).
  Each such job gets a "⚠ outputs changed" line. Agreement with O0 stays a column.
* **Warnings**: fusions that matched nothing in a job (``unmatched_fusions``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from experiments import report_rounds

MISSING = "—"


@dataclass
class Job:
    """One job of the multirun: its folder, overrides and parsed results."""

    name: str
    path: Path
    overrides: list[str]
    results: dict
    override_map: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.override_map = dict(_split_override(o) for o in self.overrides)

    @property
    def experiment(self) -> str:
        value = self.results.get("experiment")
        return value if isinstance(value, str) and value else "(unnamed)"


def _split_override(override: str) -> tuple[str, str]:
    """``++compile.level=2`` -> ``("compile.level", "2")``; a bare key maps to ``""``."""
    key, _, value = str(override).partition("=")
    return key.lstrip("+~"), value


def get(results: Any, *keys: str) -> Any:
    """``results[k0][k1]...`` or None when any level is missing or not a mapping."""
    for key in keys:
        if not isinstance(results, dict) or key not in results:
            return None
        results = results[key]
    return results


def number(results: Any, *keys: str) -> Optional[float]:
    """A finite number at ``keys`` or None (bools, strings and NaN count as missing)."""
    value = get(results, *keys)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_jobs(root: Path) -> tuple[list[Job], list[str]]:
    """All jobs under ``root`` in job order, and a list of problems with skipped jobs."""
    jobs: list[Job] = []
    problems: list[str] = []
    for results_path in root.rglob("results.json"):
        rel = results_path.parent.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .hydra, .submitit, ... hold no job results
        name = str(rel) if rel.parts else "."
        try:
            results = json.loads(results_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"job `{name}`: {results_path} is not readable JSON ({e})")
            continue
        if not isinstance(results, dict):
            problems.append(f"job `{name}`: {results_path} holds no JSON object")
            continue
        overrides = _read_overrides(results_path.parent, results, name, problems)
        jobs.append(Job(name=name, path=results_path.parent, overrides=overrides, results=results))
    jobs.sort(key=lambda job: _natural_key(job.name))
    return jobs, problems


def _read_overrides(job_dir: Path, results: dict, name: str, problems: list[str]) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            problems.append(
                f"job `{name}`: {path} is not valid YAML ({e}); using the overrides in results.json"
            )
        else:
            if isinstance(loaded, list):
                return [str(o) for o in loaded]
            if loaded is None:
                return []
            problems.append(f"job `{name}`: {path} is not a list; using results.json")
    fallback = results.get("overrides")
    return [str(o) for o in fallback] if isinstance(fallback, list) else []


def group_by_experiment(jobs: Sequence[Job]) -> dict[str, list[Job]]:
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.experiment, []).append(job)
    return groups


def varying_keys(jobs: Sequence[Job]) -> list[str]:
    """Override keys whose value (or presence) differs between the jobs, in first-seen order."""
    keys: list[str] = []
    for job in jobs:
        keys.extend(k for k in job.override_map if k not in keys)
    return [k for k in keys if len({job.override_map.get(k) for job in jobs}) > 1]


_HYDRA_ESCAPE = re.compile(r"\\(.)")


def unescape_override(value: str) -> str:
    """An override value as the user meant it: Hydra's command-line escapes removed
    (``mypasses.silu\\:SigmoidMulToSilu`` -> ``mypasses.silu:SigmoidMulToSilu``)."""
    return _HYDRA_ESCAPE.sub(r"\1", value)


def config_label(job: Job, keys: Sequence[str]) -> str:
    parts = [f"{k}={unescape_override(job.override_map[k])}" for k in keys if k in job.override_map]
    return ", ".join(parts) if parts else f"job {job.name}"


def reference_of(results: dict) -> str:
    """Which agreement decides "outputs changed": the sweep's baseline when measured."""
    return (
        "agreement_baseline" if isinstance(results.get("agreement_baseline"), dict) else "agreement"
    )


def outputs_changed(results: dict) -> bool:
    ref = reference_of(results)
    agreement = number(results, ref, "token_agreement")
    if agreement is not None:
        return agreement < 1.0
    return get(results, ref, "outputs_equal") is False


def baseline_job(jobs: Sequence[Job]) -> Job:
    for job in jobs:
        if job.results.get("baseline") is True:
            return job
    return jobs[0]


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


def best_job(jobs: Sequence[Job], metric: Metric, base: Optional[Job] = None) -> Optional[Job]:
    """★ best: a significant improvement on ``metric`` with outputs unchanged against the
    baseline (report_rounds.best); None when no job qualifies."""
    if not jobs:
        return None
    base = base or baseline_job(jobs)
    return report_rounds.best(jobs, base, metric.name, metric.lower_is_better, outputs_changed)


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
        + ["cache hits/misses", BASE_AGREEMENT.header, BASE_LOGIT_DIFF.header]
        + [AGREEMENT.header, LOGIT_DIFF.header]
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
            ci = report_rounds.interval(job.results, metric.name)
            text = report_rounds.value_text(value, ci, metric.fmt)
            if metric.show_delta and job is not base and value is not None:
                if metric.name in report_rounds.SAMPLE_KEYS:
                    d = report_rounds.delta(job.results, base.results, metric.name)
                    text += f" ({report_rounds.delta_text(d)})"
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


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "sweep"


def _sizes_label(sizes: Any, fallback: str) -> str:
    if not isinstance(sizes, list) or not sizes:
        return fallback
    if len(sizes) <= 6:
        return "[" + ",".join(str(s) for s in sizes) + "]"
    return f"[{sizes[0]},{sizes[1]},…,{sizes[-1]}] K={len(sizes)}"


def write_plots(
    group: str, jobs: Sequence[Job], labels: dict[str, str], out_dir: Path
) -> list[tuple[str, Path]]:
    """Latency, compile-time and padding-waste PNGs for one sweep; returns (title, path)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    written: list[tuple[str, Path]] = []
    slug = _slug(group)

    def save(fig, title: str, suffix: str) -> None:
        path = out_dir / f"{slug}_{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append((title, path))

    def bars(ax, phase: str) -> bool:
        # Configurations that changed outputs are hatched and labelled, so a fast but wrong
        # configuration cannot be mistaken for a win.
        rows = [
            (
                labels[j.name] + (" (outputs changed)" if outputs_changed(j.results) else ""),
                number(j.results, "latency_ms", phase, "median"),
                number(j.results, "latency_ms", phase, "p90"),
                outputs_changed(j.results),
            )
            for j in jobs
        ]
        rows = [r for r in rows if r[1] is not None]
        if not rows:
            return False
        x = range(len(rows))
        upper = [max((p90 if p90 is not None else med) - med, 0.0) for _, med, p90, _ in rows]
        drawn = ax.bar(
            x,
            [r[1] for r in rows],
            yerr=[[0.0] * len(rows), upper],
            capsize=4,
            color="tab:blue" if phase == "decode" else "tab:orange",
        )
        for patch, row in zip(drawn.patches, rows):
            if row[3]:
                patch.set_hatch("//")
        ax.set_xticks(list(x), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms (bar: median, whisker: p90)")
        ax.set_title(f"{phase} step latency")
        return True

    width = max(6.0, 1.1 * len(jobs) + 2)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 4.5))
    drawn = [bars(axes[0], "decode"), bars(axes[1], "prefill")]
    if any(drawn):
        for ax, ok in zip(axes, drawn):
            if not ok:
                ax.set_axis_off()
        fig.suptitle(f"{group}: latency per configuration")
        save(fig, "Latency per configuration (median, p90 whiskers)", "latency")
    else:
        plt.close(fig)

    rows = [
        (
            labels[j.name],
            number(j.results, "compile", "cold_s"),
            number(j.results, "compile", "warm_s"),
        )
        for j in jobs
    ]
    rows = [r for r in rows if r[1] is not None or r[2] is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(width, 4.5))
        x = list(range(len(rows)))
        ax.bar([i - 0.2 for i in x], [r[1] or 0.0 for r in rows], width=0.4, label="cold")
        ax.bar([i + 0.2 for i in x], [r[2] or 0.0 for r in rows], width=0.4, label="warm")
        ax.set_xticks(x, [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(f"{group}: compile time per configuration")
        ax.legend()
        save(fig, "Compile time per configuration (cold vs warm cache)", "compile")

    rows = [
        (
            _sizes_label(get(j.results, "capture_sizes"), labels[j.name]),
            number(j.results, "padding_waste"),
        )
        for j in jobs
    ]
    rows = [r for r in rows if r[1] is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(width, 4.5))
        x = list(range(len(rows)))
        ax.bar(x, [100 * r[1] for r in rows], color="tab:green")
        ax.set_xticks(x, [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("padded tokens, % of computed tokens")
        ax.set_title(f"{group}: padding waste per capture-size set")
        save(fig, "Padding waste per capture-size set", "padding")
    return written


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
        f"else the first job; deltas are relative to it, outputs are compared with its outputs. "
        f"★ best: {'lowest' if best_metric.lower_is_better else 'highest'} "
        f"{best_metric.header} among configurations whose change is a significant "
        f"improvement and whose outputs equal the baseline's.",
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

    for group, group_jobs in groups.items():
        keys = varying_keys(group_jobs)
        labels = {j.name: config_label(j, keys) for j in group_jobs}
        base = baseline_job(group_jobs)
        best = best_job(group_jobs, best_metric, base)
        lines += [
            f"## Sweep: {group}",
            "",
            f"Baseline: `{labels[base.name]}` (job {base.name}). Best: "
            + (
                f"`{labels[best.name]}` (job {best.name})."
                if best
                else f"none (no configuration is a significant improvement in "
                f"{best_metric.header} with unchanged outputs)."
            ),
            "",
            report_rounds.rounds_note(group_jobs),
            "",
        ]
        lines += sweep_table(group_jobs, keys, base, best)
        lines.append("")
        verdicts = report_rounds.verdict_lines(group_jobs, base, labels, list(METRICS.values()))
        if verdicts:
            lines += ["### Deltas against the baseline", ""] + verdicts + [""]
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
        warnings = report_rounds.unmatched_lines(group_jobs, labels)
        if warnings:
            lines += ["### Warnings", ""] + warnings + [""]
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
