"""The peer benchmark's results, read back: per (size, contender, batch) the step times over the
rounds (median, min, max, spread), start and peak RSS per contender, the ratios of medians
(:data:`RATIOS`, plus every ``name@variant`` against its ``name``; the targets use these) and
beside them the ratios within each round (:func:`paired`), the streaming floors and
the markdown the run prints and commits.  Pure functions of the results file
(:mod:`experiments.bench.peers` writes it; nothing here runs a contender)."""

from __future__ import annotations

import statistics
from typing import Any, Optional


def _stats(xs: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "spread": max(xs) / min(xs) if min(xs) > 0 else None,
        "n": len(xs),
        "all": xs,
    }


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per (size, contender, batch): step ms over the rounds; per (size, contender): start,
    peak RSS; token checks; ratios; floors."""
    rows: dict[str, dict[str, Any]] = {}
    for r in data["runs"]:
        key = f"{r['size']}/{r['contender']}"
        s = rows.setdefault(
            key,
            {
                "size": r["size"],
                "contender": r["contender"],
                "batches": {},
                "start_s": [],
                "to_first_tokens_s": [],
                "page_cache_frac": [],
                "warm_after_torch_s": [],
                "rss_peak_bytes": [],
                "rss_peak_first_batch_bytes": [],
                "others_frac": [],
                "steal_frac": [],
            },
        )
        first = r["batches"].get(str(min(int(b) for b in r["batches"]))) if r["batches"] else None
        if first and first.get("rss_after"):
            s["rss_peak_first_batch_bytes"].append(first["rss_after"].get("VmHWM", 0))
        s["start_s"].append(r["start_s"])
        if "to_first_tokens_s" in r:
            s["to_first_tokens_s"].append(r["to_first_tokens_s"])
        held = page_cache_frac(r)
        if held is not None:
            s["page_cache_frac"].append(held)
        if "warm_after_torch_s" in r:
            s["warm_after_torch_s"].append(r["warm_after_torch_s"])
        s["rss_peak_bytes"].append(r["rss_end"].get("VmHWM", 0))
        s["others_frac"].append(r.get("load", {}).get("others_frac", 0.0))
        s["steal_frac"].append(r.get("load", {}).get("steal_frac", 0.0))
        for b, row in r["batches"].items():
            bs = s["batches"].setdefault(b, {"step_ms": [], "checks": []})
            bs["checks"].append(
                {k: row.get(k) for k in ("tokens_match", "first_divergence", "why_not_timed")}
            )
            if row.get("timed"):
                bs["step_ms"].append(row["step_ms"])
    for s in rows.values():
        for b in s["batches"].values():
            b["stats"] = _stats(b["step_ms"]) if b["step_ms"] else None
        for k in (
            "start_s",
            "to_first_tokens_s",
            "page_cache_frac",
            "warm_after_torch_s",
            "rss_peak_bytes",
            "rss_peak_first_batch_bytes",
            "others_frac",
            "steal_frac",
        ):
            s[k] = _stats(s[k]) if s[k] else None
    return rows


def page_cache_frac(run: dict[str, Any]) -> Optional[float]:
    """The fraction of a run's weights the page cache held when it started: for the project
    on a processed-weights cache hit, that file's (``LLM.stats``); else its weight files'
    (the worker's ``page_cache_before_load``).  None for a file from before it was kept."""
    stats = run.get("project_stats") or {}
    if stats.get("weights_cache") == "hit" and stats.get("weights_page_cache_frac") is not None:
        return stats["weights_page_cache_frac"]
    return (run.get("page_cache_before_load") or {}).get("fraction")


def median_step(summary: dict[str, Any], size: str, contender: str, batch: int) -> Optional[float]:
    s = summary.get(f"{size}/{contender}")
    b = s and s["batches"].get(str(batch))
    return b["stats"]["median"] if b and b["stats"] else None


RATIOS = (
    # (label, baseline contender, contender: ratio = baseline median / contender median)
    ("project bf16 vs llama.cpp bf16", "llamacpp_bf16", "project_bf16"),
    ("project int8 vs llama.cpp q8_0", "llamacpp_q8_0", "project_int8"),
    ("project int8 vs project bf16", "project_bf16", "project_int8"),
    (
        "project int8 (LM head int8, as q8_0) vs llama.cpp q8_0",
        "llamacpp_q8_0",
        "project_int8@head",
    ),
    ("project bf16 vs CTranslate2 int8", "ct2_int8", "project_bf16"),
    ("project int8 vs CTranslate2 int8", "ct2_int8", "project_int8"),
    ("project bf16 vs transformers eager bf16", "hf_eager", "project_bf16"),
)


def ratio_pairs(contenders: set[str]) -> list[tuple[str, str, str]]:
    """(label, baseline, contender) of every ratio: :data:`RATIOS`, then each ``name@variant``
    against its ``name``."""
    variants = sorted(c for c in contenders if "@" in c)
    return list(RATIOS) + [
        (f"{v} vs {v.partition('@')[0]}", v.partition("@")[0], v) for v in variants
    ]


def paired(
    runs: list[dict[str, Any]], size: str, base: str, contender: str, batch: int
) -> Optional[dict[str, Any]]:
    """The ratio within each round (baseline step / contender step, the two processes of one
    round run minutes apart at most), over the rounds where both were timed: median, min,
    max, n.  A machine whose speed drifts over a run moves the two medians apart by whatever
    each contender's rounds happened to meet; a round's own ratio sees the same machine."""
    steps: dict[tuple[str, int], float] = {}
    for r in runs:
        row = r["batches"].get(str(batch)) if r["size"] == size and "round" in r else None
        if row and row.get("timed"):
            steps[(r["contender"], r["round"])] = row["step_ms"]
    rounds = sorted({k[1] for k in steps})
    xs = [
        steps[(base, n)] / steps[(contender, n)]
        for n in rounds
        if (base, n) in steps and (contender, n) in steps
    ]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratios(
    summary: dict[str, Any],
    sizes: list[str],
    batches: list[int],
    runs: Optional[list[dict[str, Any]]] = None,
) -> list[dict[str, Any]]:
    """The ratios of medians (what the targets use); with ``runs``, each also with its
    :func:`paired` per-round ratios."""
    out = []
    for size in sizes:
        for batch in batches:
            for label, base, c in ratio_pairs({s["contender"] for s in summary.values()}):
                a, b = median_step(summary, size, base, batch), median_step(summary, size, c, batch)
                if a and b:
                    row = {
                        "size": size,
                        "batch": batch,
                        "ratio": label,
                        "speedup": a / b,
                        "baseline_ms": a,
                        "contender_ms": b,
                    }
                    if runs is not None:
                        row["paired"] = paired(runs, size, base, c, batch)
                    out.append(row)
    return out


def paired_cell(p: Optional[dict[str, Any]]) -> str:
    """A :func:`paired` result as a table cell: ``median [min, max]``."""
    return "-" if not p else f"{p['median']:.2f}x [{p['min']:.2f}, {p['max']:.2f}]"


def floors(summary: dict[str, Any], data: dict[str, Any], sizes: list[str]) -> dict[str, Any]:
    """Per size: bytes streamed per step, the probe's best read bandwidth, every contender's
    own streaming rate at batch 1, the best of them all, and the floor at that bandwidth."""
    probes = [p["best_gb_s"] for p in data["probes"] if "best_gb_s" in p]
    probe = max(probes) if probes else None
    out: dict[str, Any] = {}
    rate_bytes = {
        "project_bf16": "bf16",
        "llamacpp_bf16": "bf16",
        "hf_eager": "bf16",
        "llamacpp_q8_0": "q8_0",
    }
    for size in sizes:
        info = data.get("models", {}).get(size)
        if not info:
            continue
        nbytes = info["streamed_bytes"]
        rates = {}
        for c, fmt in rate_bytes.items():
            best = summary.get(f"{size}/{c}", {}).get("batches", {}).get("1", {}).get("stats")
            if best and best["min"] > 0:
                rates[c] = nbytes[fmt] / (best["min"] / 1e3) / 1e9  # best round
        best_bw = max([probe or 0.0, *rates.values()]) or None
        out[size] = {
            "streamed_bytes": nbytes,
            "probe_best_gb_s": probe,
            "contender_best_gb_s": rates,
            "best_gb_s": best_bw,
            "probe_is_best": bool(probe and probe >= max(rates.values(), default=0.0)),
            "floor_ms": {k: v / (best_bw * 1e9) * 1e3 for k, v in nbytes.items()}
            if best_bw
            else None,
        }
    return out


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(data: dict[str, Any], summary: dict[str, Any], rat: list, fl: dict) -> str:
    lines = [
        "| size | contender | batch | step ms median | min-max | spread | rounds | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        for b, bs in sorted(s["batches"].items(), key=lambda kv: int(kv[0])):
            st = bs["stats"]
            checks = bs["checks"]
            if all(c["tokens_match"] is None for c in checks):
                tok = "reference"
            elif all(c["tokens_match"] for c in checks):
                tok = "= ref"
            else:
                divs = sorted({c["first_divergence"] for c in checks if not c["tokens_match"]})
                tok = f"differ from step {divs[0]}" + (" (not timed)" if not st else "")
            lines.append(
                f"| {s['size']} | {s['contender']} | {b} | "
                + (
                    f"{st['median']:.2f} | {st['min']:.2f}-{st['max']:.2f} | "
                    f"{_fmt(st['spread'])} | "
                    f"{st['n']}"
                    if st
                    else "- | - | - | 0"
                )
                + f" | {tok} |"
            )
    lines += [
        "",
        "| size | contender | start s (median) | to first 2 tokens s (median) "
        "| weights in page cache at start [min, max] | peak RSS GB (median) | others' CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        first, held = s.get("to_first_tokens_s"), s.get("page_cache_frac")
        lines.append(
            f"| {s['size']} | {s['contender']} | {s['start_s']['median']:.2f} | "
            f"{_fmt(first['median'] if first else None)} | "
            + (f"{100 * held['min']:.0f}%, {100 * held['max']:.0f}%" if held else "-")
            + f" | {s['rss_peak_bytes']['median'] / 1e9:.2f} | "
            f"{100 * s['others_frac']['median']:.0f}% |"
        )
    if rat:
        lines += [
            "",
            "| size | batch | ratio | speed-up (of medians) | per round: median [min, max] |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['size']} | {r['batch']} | {r['ratio']} | {r['speedup']:.2f}x | "
            f"{paired_cell(r.get('paired'))} |"
            for r in rat
        ]
    for size, f in fl.items():
        if f["best_gb_s"]:
            lines.append(
                f"\n{size}: a step streams {f['streamed_bytes']['bf16'] / 1e9:.3f} GB (bf16) / "
                f"{f['streamed_bytes']['q8_0'] / 1e9:.3f} GB (q8_0); probe "
                f"{f['probe_best_gb_s'] or 0:.1f} GB/s, contenders "
                + ", ".join(f"{c} {v:.1f}" for c, v in f["contender_best_gb_s"].items())
                + f" GB/s; floor (bf16) {f['floor_ms']['bf16']:.2f} ms, (q8_0) "
                f"{f['floor_ms']['q8_0']:.2f} ms"
                + ("" if f["probe_is_best"] else " — the probe is below a contender's rate")
            )
    if data.get("skipped"):
        lines += ["", "left out: " + "; ".join(f"{k}: {v}" for k, v in data["skipped"].items())]
    return "\n".join(lines)
