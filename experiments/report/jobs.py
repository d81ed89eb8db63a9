"""The jobs of a multirun as the report reads them: each job's folder, overrides and
``results.json``, grouped by experiment, with their labels and baseline."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

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
