"""The few lines a job prints when its results are complete."""

from __future__ import annotations

from typing import Any


def summary(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]

    def fmt(d):
        if not d:
            return "—"
        ci = d.get("ci95")
        interval = f" [95% {ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        return f"{d['median']:.2f} ms{interval} (p90 {d['p90']:.2f})"

    def agrees(agree, what):
        if agree is None:
            return f"  generated tokens agree with {what}: n/a"
        if agree["outputs_equal"]:
            return f"  generated tokens agree with {what}: yes"
        rate = agree["token_agreement"]
        return f"  generated tokens agree with {what}: no (agreement {rate:.3f})"

    rounds = r.get("rounds") or {}
    tps = r["tokens_per_s"]
    lines = [
        f"experiment {r['experiment']}  overrides {' '.join(r['overrides']) or '(none)'}",
        f"  start (cold) {r['compile']['cold_s']:.2f} s"
        + (f", warm {r['compile']['warm_s']:.2f} s" if r["compile"]["warm_s"] else ""),
        f"  timed in {rounds.get('n', 0)} round(s)"
        + (" interleaved with the sweep's other configurations" * bool(rounds.get("interleaved"))),
        f"  prefill step {fmt(lat['prefill'])}; decode step {fmt(lat['decode'])}",
        f"  tokens/s {'—' if tps is None else format(tps, '.1f')}",
        agrees(r["agreement"], "eager (O0)"),
    ]
    comp = r["compile"]
    if comp.get("compiles") is not None or comp.get("loads") is not None:
        lines.append(
            f"  pieces: {comp.get('compiles') or 0} compiled, {comp.get('loads') or 0} loaded "
            f"from the cache (cache hits {comp.get('cache_hits')}, misses "
            f"{comp.get('cache_misses')})"
        )
    if comp.get("cache_dir"):
        whose = (
            "the per-user default, shared by every run without cache_dir"
            if comp.get("cache_shared")
            else "set by cache_dir"
        )
        lines.append(f"  artifact cache: {comp['cache_dir']} ({whose})")
    if r.get("passes"):
        counts = [
            f"{name} {'not reported' if p.get('matches_reported') is False else p.get('matches')}"
            f" ({p.get('status')})"
            for name, p in r["passes"].items()
        ]
        lines.append("  pass matches: " + ", ".join(counts))
    if r.get("agreement_baseline") is not None:
        lines.append(agrees(r["agreement_baseline"], "the sweep's baseline"))
    for name in r.get("unmatched_fusions") or []:
        lines.append(f"  warning: fusion {name} matched nothing in the whole model")
    for ex in r.get("text_examples") or []:
        lines.append(f"  {ex['prompt']!r} -> {ex['answer']!r}")
    if r.get("accuracy"):
        lines.append(
            f"  exact match {r['accuracy']['exact_match']:.3f} "
            f"({r['accuracy']['n']} held-out prompts)"
        )
    return "\n".join(lines)
