"""The report's speculative-decoding table: per job, the method and k, the acceptance (rate,
per draft position, mean tokens per verify step), the proposer's and the verify step's time,
and tokens/s with the speed-up over the cell's baseline (the same engine without
speculation: the k = 0 row of conf/experiment/ablate_spec.yaml).

Reads ``results["stats"]["spec_*"]`` (``LLM.stats`` of the job's first generation:
``framework.engine.spec.decoder.SpecDecoder.stats``); a job without them is a plain engine."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from experiments.report.jobs import MISSING, Job, get, number


def _spec(job: Job, key: str) -> Any:
    return get(job.results, "stats", f"spec_{key}")


def _num(value: Any, fmt: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return MISSING
    return format(value, fmt)


def _positions(value: Any) -> str:
    if not isinstance(value, list) or not value:
        return MISSING
    return " / ".join(_num(v, ".2f") for v in value)


def has_speculation(jobs: Sequence[Job]) -> bool:
    return any(_spec(j, "method") is not None for j in jobs)


def spec_table(jobs: Sequence[Job], labels: dict[str, str], base: Optional[Job]) -> list[str]:
    """Markdown lines of the table (empty when no job speculates)."""
    if not has_speculation(jobs):
        return []
    base_tps = number(base.results, "tokens_per_s") if base is not None else None
    headers = [
        "configuration",
        "method",
        "k",
        "acceptance",
        "acceptance per position",
        "mean accepted length",
        "propose ms/step",
        "verify ms/step",
        "tokens/s",
        "speed-up",
    ]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(["---"] * len(headers)) + "|",
    ]
    for job in jobs:
        method = _spec(job, "method")
        tps = number(job.results, "tokens_per_s")
        ci = get(job.results, "tokens_per_s_ci95")
        tps_text = _num(tps, ".1f")
        if tps is not None and isinstance(ci, list) and len(ci) == 2:
            tps_text += f" [{_num(ci[0], '.1f')}, {_num(ci[1], '.1f')}]"
        speedup = f"{tps / base_tps:.2f}x" if tps and base_tps else MISSING
        row = [
            labels.get(job.name, job.name),
            str(method) if method is not None else "off",
            _num(_spec(job, "num_speculative_tokens"), "d") if method is not None else "0",
            _num(_spec(job, "acceptance_rate"), ".3f"),
            _positions(_spec(job, "acceptance_rate_per_position")),
            _num(_spec(job, "mean_accepted_length"), ".2f"),
            _num(_spec(job, "propose_ms_per_step"), ".2f"),
            _num(_spec(job, "verify_ms_per_step"), ".2f"),
            tps_text,
            speedup,
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    lines += [
        "",
        "Acceptance: accepted / proposed draft tokens; per position j: of the verify chunks "
        "holding a j-th draft, the fraction that accepted it; mean accepted length: tokens "
        "kept per verify chunk (accepted drafts + the target's own token). Speed-up: "
        "tokens/s over the cell baseline's (no speculation).",
    ]
    return lines
