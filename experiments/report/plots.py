"""The report's PNG plots: latency (p90 whiskers), compile time and padding waste per sweep."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from experiments.report.jobs import Job, get, number, outputs_changed


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
    # No plot that carries no information: without CUDA graphs (CPU) nothing is padded, every
    # bar would be 0 %.
    if any(r[1] for r in rows):
        fig, ax = plt.subplots(figsize=(width, 4.5))
        x = list(range(len(rows)))
        ax.bar(x, [100 * r[1] for r in rows], color="tab:green")
        ax.set_xticks(x, [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("padded tokens, % of computed tokens")
        ax.set_title(f"{group}: padding waste per capture-size set")
        save(fig, "Padding waste per capture-size set", "padding")
    return written
