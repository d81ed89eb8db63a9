"""Optional experiment tracking: log each job's results.json to MLflow (``tracking=mlflow``).

Off by default (``tracking: none`` in conf/config.yaml). With ``tracking=mlflow`` every job
becomes one MLflow run in the MLflow experiment named after the sweep
(``results["experiment"]``):

* **params** — the resolved job config flattened to dotted keys (``compile.level``,
  ``quantization``, ``workload.num_prompts``, ...), so runs can be filtered by any setting;
* **metrics** — the numbers of the results.json contract: step latencies, tokens/s, compile
  times, cache hits/misses, agreement vs O0, exact match, padding waste, and per pass
  ``pass.<name>.matches`` / ``pass.<name>.time_s``;
* **tags** — ``experiment``, ``baseline``, ``outputs_changed``, ``overrides``;
* **artifacts** — ``results.json`` and ``trace.jsonl`` of the job folder.

The store is local: by default a file store ``mlruns/`` in the run folder (the sweep folder of
a multirun, so all jobs of a sweep land in one store; ``mlflow ui --backend-store-uri
file:<folder>/mlruns`` shows them). ``+tracking_uri=sqlite:///abs/path/mlflow.db`` picks an
SQLite store instead (or any MLflow tracking URI).

mlflow is not a dependency: it is imported only when tracking is on, and a missing install is
reported before the job starts (:func:`require_tracking`), not after a long compile.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional

TRACKERS = ("none", "mlflow")
"""Values of the ``tracking`` config key."""

_MAX_PARAM_VALUE = 500  # MLflow's historical param value limit (newer servers allow 6000)
_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit for params (and tags)


def require_tracking(tracking: Optional[str]) -> None:
    """Check ``tracking`` before a job runs: a known value, and mlflow importable if chosen."""
    if tracking not in TRACKERS:
        raise ValueError(f"tracking: unknown value {tracking!r}; choose one of {list(TRACKERS)}")
    if tracking == "mlflow":
        _import_mlflow()


def _import_mlflow():
    try:
        import mlflow
    except ImportError as e:
        raise ImportError(
            "tracking=mlflow needs the mlflow package, which is not installed: "
            "`pip install mlflow` (or run with tracking=none)"
        ) from e
    return mlflow


def default_tracking_uri(store_root: Path) -> str:
    """A local MLflow file store ``<store_root>/mlruns``."""
    return (Path(store_root).resolve() / "mlruns").as_uri()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": leaf}``; lists and scalars are leaves."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value} if prefix else {}


def params_of(result: Mapping[str, Any]) -> dict[str, str]:
    """The job config as MLflow params: dotted keys, values as text (``null`` for None)."""
    params = {}
    for key, value in flatten(result.get("config") or {}).items():
        text = "null" if value is None else str(value)
        if len(text) > _MAX_PARAM_VALUE:
            text = text[: _MAX_PARAM_VALUE - 3] + "..."
        params[key] = text
    return params


def metrics_of(result: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a results.json (schema: experiments/README.md) as MLflow metrics."""

    def get(*keys: str) -> Any:
        node: Any = result
        for key in keys:
            if not isinstance(node, Mapping):
                return None
            node = node.get(key)
        return node

    wanted = {
        "decode_ms_median": ("latency_ms", "decode", "median"),
        "decode_ms_p90": ("latency_ms", "decode", "p90"),
        "prefill_ms_median": ("latency_ms", "prefill", "median"),
        "prefill_ms_p90": ("latency_ms", "prefill", "p90"),
        "tokens_per_s": ("tokens_per_s",),
        "compile_cold_s": ("compile", "cold_s"),
        "compile_warm_s": ("compile", "warm_s"),
        "cache_hits": ("compile", "cache_hits"),
        "cache_misses": ("compile", "cache_misses"),
        "token_agreement": ("agreement", "token_agreement"),
        "max_logit_diff": ("agreement", "max_logit_diff"),
        "exact_match": ("accuracy", "exact_match"),
        "padding_waste": ("padding_waste",),
    }
    raw = {name: get(*keys) for name, keys in wanted.items()}
    for name, rec in (result.get("passes") or {}).items():
        if isinstance(rec, Mapping):
            raw[f"pass.{name}.matches"] = rec.get("matches")
            raw[f"pass.{name}.time_s"] = rec.get("time_s")
    return {
        k: float(v)
        for k, v in raw.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def tags_of(result: Mapping[str, Any]) -> dict[str, str]:
    """Same rule as experiments.report.sweep_report: outputs changed when token agreement < 1
    (or, without it, outputs_equal is false); "unknown" when the job has no agreement."""
    agreement = result.get("agreement") or {}
    value = agreement.get("token_agreement")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        changed: Optional[bool] = value < 1.0
    elif isinstance(agreement.get("outputs_equal"), bool):
        changed = not agreement["outputs_equal"]
    else:
        changed = None
    return {
        "experiment": str(result.get("experiment", "")),
        "baseline": str(bool(result.get("baseline"))).lower(),
        "outputs_changed": "unknown" if changed is None else str(changed).lower(),
        "overrides": " ".join(result.get("overrides") or [])[:_MAX_PARAM_VALUE],
    }


def log_mlflow(
    result: Mapping[str, Any],
    out_dir: Path,
    tracking_uri: Optional[str] = None,
    store_root: Optional[Path] = None,
) -> str:
    """Log one job (its results dict and the files in ``out_dir``) as an MLflow run; returns
    the run id. ``tracking_uri`` None: a file store under ``store_root`` (default
    ``out_dir``)."""
    _import_mlflow()
    from filelock import FileLock
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    out_dir = Path(out_dir)
    root = Path(store_root) if store_root is not None else out_dir
    uri = tracking_uri or default_tracking_uri(root)
    if uri.startswith("file:"):
        # MLflow 3 refuses its file store unless this opt-out is set; a local folder per
        # sweep is what this module promises (a database URI needs no opt-out).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    name = str(result.get("experiment") or "run")
    # Parallel jobs of one sweep (joblib) would race to create the same experiment.
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".mlflow.lock")):
        experiment = client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else client.create_experiment(name)
        )
    overrides = " ".join(result.get("overrides") or [])
    run = client.create_run(
        experiment_id, run_name=(overrides or out_dir.name)[:200], tags=tags_of(result)
    )
    run_id = run.info.run_id
    try:
        params = [Param(k, v) for k, v in params_of(result).items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i : i + _PARAMS_PER_BATCH])
        timestamp = int(run.info.start_time or 0)
        client.log_batch(
            run_id, metrics=[Metric(k, v, timestamp, 0) for k, v in metrics_of(result).items()]
        )
        for filename in ("results.json", "trace.jsonl"):
            if (out_dir / filename).is_file():
                client.log_artifact(run_id, str(out_dir / filename))
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
    return run_id
