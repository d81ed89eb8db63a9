"""experiments/run/tracking.py: the MLflow mapping of a results.json, logged through the real
mlflow package into a local file store and read back with its client."""

import sys

import pytest

from experiments.run.tracking import (
    flatten,
    log_mlflow,
    metrics_of,
    params_of,
    require_tracking,
    tags_of,
)

RESULT = {
    "experiment": "ablate_levels",
    "overrides": ["compile=O2", "experiment=ablate_levels"],
    "baseline": False,
    "config": {
        "compile": {"level": 2, "compile_sizes": [1, 8]},
        "quantization": None,
        "dtype": "float32",
    },
    "compile": {"cold_s": 30.5, "warm_s": None, "cache_hits": 0, "cache_misses": 3},
    "latency_ms": {"prefill": {"median": 40.0, "p90": 48.0}, "decode": None},
    "tokens_per_s": 95.0,
    "passes": {"noop_elimination": {"matches": 16, "time_s": 0.01}},
    "agreement": {"token_agreement": 0.97, "max_logit_diff": 0.4, "outputs_equal": False},
    "accuracy": None,
    "padding_waste": float("nan"),
}


def test_flatten_and_params_are_dotted_text():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": [1, 2], "d": None}
    assert params_of(RESULT) == {
        "compile.level": "2",
        "compile.compile_sizes": "[1, 8]",
        "quantization": "null",
        "dtype": "float32",
    }


def test_metrics_keep_only_finite_numbers():
    assert metrics_of(RESULT) == {
        "prefill_ms_median": 40.0,
        "prefill_ms_p90": 48.0,
        "tokens_per_s": 95.0,
        "compile_cold_s": 30.5,
        "cache_hits": 0.0,
        "cache_misses": 3.0,
        "token_agreement": 0.97,
        "max_logit_diff": 0.4,
        "pass.noop_elimination.matches": 16.0,
        "pass.noop_elimination.time_s": 0.01,
    }


def test_tags_follow_the_reports_outputs_changed_rule():
    assert tags_of(RESULT)["outputs_changed"] == "true"
    assert tags_of({**RESULT, "agreement": {"token_agreement": 1.0}})["outputs_changed"] == "false"
    assert tags_of({**RESULT, "agreement": None})["outputs_changed"] == "unknown"
    assert tags_of(RESULT)["overrides"] == "compile=O2 experiment=ablate_levels"


def test_require_tracking_rejects_unknown_values():
    require_tracking("none")
    with pytest.raises(ValueError, match="tracking: unknown value 'wandb'"):
        require_tracking("wandb")


@pytest.fixture
def mlflow(monkeypatch):
    """The real mlflow package (the `tracking` extra, installed by `dev`)."""
    module = pytest.importorskip(
        "mlflow", reason="mlflow is not installed: pip install -e '.[tracking]'"
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return module


def test_log_mlflow_logs_one_run_per_job_into_one_store(mlflow, tmp_path):
    sweep = tmp_path / "sweep"
    run_ids = []
    for num in (0, 1):
        job = sweep / str(num)
        job.mkdir(parents=True)
        (job / "results.json").write_text("{}")
        run_ids.append(log_mlflow(RESULT, job, store_root=sweep))
    assert len(set(run_ids)) == 2
    client = mlflow.MlflowClient(tracking_uri=(sweep / "mlruns").resolve().as_uri())
    experiments = [e for e in client.search_experiments() if e.name == "ablate_levels"]
    assert len(experiments) == 1  # the second job reused it
    runs = client.search_runs([experiments[0].experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(run_ids)
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.info.run_name == "compile=O2 experiment=ablate_levels"
        assert run.data.tags["baseline"] == "false"
        assert run.data.tags["outputs_changed"] == "true"
        assert run.data.params == params_of(RESULT)
        assert run.data.metrics == metrics_of(RESULT)
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["results.json"]


def test_log_mlflow_uses_an_explicit_uri_and_marks_failed_runs(mlflow, tmp_path, monkeypatch):
    uri = (tmp_path / "explicit").resolve().as_uri()

    def broken_log_batch(self, *args, **kwargs):
        raise RuntimeError("store is down")

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", broken_log_batch)
    with pytest.raises(RuntimeError, match="store is down"):
        log_mlflow(RESULT, tmp_path / "job", tracking_uri=uri)
    monkeypatch.undo()
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("ablate_levels")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert not (tmp_path / "job" / "mlruns").exists()  # the explicit store, not the default


def test_missing_mlflow_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    with pytest.raises(ImportError, match="pip install mlflow"):
        require_tracking("mlflow")
