"""experiments/tracking.py: the MLflow mapping of a results.json, against a recording stand-in
for the mlflow client (mlflow itself is optional and not installed here)."""
import sys
import types

import pytest

from experiments.tracking import (flatten, log_mlflow, metrics_of, params_of,
                                  require_tracking, tags_of)

RESULT = {
    "experiment": "ablate_levels", "overrides": ["compile=O2", "experiment=ablate_levels"],
    "baseline": False,
    "config": {"compile": {"level": 2, "compile_sizes": [1, 8]}, "quantization": None,
               "dtype": "float32"},
    "compile": {"cold_s": 30.5, "warm_s": None, "cache_hits": 0, "cache_misses": 3},
    "latency_ms": {"prefill": {"median": 40.0, "p90": 48.0}, "decode": None},
    "tokens_per_s": 95.0,
    "passes": {"noop_elimination": {"matches": 16, "time_s": 0.01}},
    "agreement": {"token_agreement": 0.97, "max_logit_diff": 0.4, "outputs_equal": False},
    "accuracy": None, "padding_waste": float("nan"),
}


def test_flatten_and_params_are_dotted_text():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": [1, 2],
                                                                 "d": None}
    assert params_of(RESULT) == {"compile.level": "2", "compile.compile_sizes": "[1, 8]",
                                 "quantization": "null", "dtype": "float32"}


def test_metrics_keep_only_finite_numbers():
    assert metrics_of(RESULT) == {
        "prefill_ms_median": 40.0, "prefill_ms_p90": 48.0, "tokens_per_s": 95.0,
        "compile_cold_s": 30.5, "cache_hits": 0.0, "cache_misses": 3.0,
        "token_agreement": 0.97, "max_logit_diff": 0.4,
        "pass.noop_elimination.matches": 16.0, "pass.noop_elimination.time_s": 0.01}


def test_tags_follow_the_reports_outputs_changed_rule():
    assert tags_of(RESULT)["outputs_changed"] == "true"
    assert tags_of({**RESULT, "agreement": {"token_agreement": 1.0}})["outputs_changed"] == "false"
    assert tags_of({**RESULT, "agreement": None})["outputs_changed"] == "unknown"
    assert tags_of(RESULT)["overrides"] == "compile=O2 experiment=ablate_levels"


def test_require_tracking_rejects_unknown_values():
    require_tracking("none")
    with pytest.raises(ValueError, match="tracking: unknown value 'wandb'"):
        require_tracking("wandb")


class RecordingClient:
    """The subset of mlflow.MlflowClient that log_mlflow uses, recording every call."""

    calls: list = []
    experiments: dict = {}

    def __init__(self, tracking_uri):
        self.calls.append(("client", tracking_uri))

    def get_experiment_by_name(self, name):
        exp_id = self.experiments.get(name)
        return None if exp_id is None else types.SimpleNamespace(experiment_id=exp_id)

    def create_experiment(self, name):
        self.experiments[name] = str(len(self.experiments))
        self.calls.append(("create_experiment", name))
        return self.experiments[name]

    def create_run(self, experiment_id, run_name, tags):
        self.calls.append(("create_run", experiment_id, run_name, tags))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1", start_time=5))

    def log_batch(self, run_id, metrics=(), params=()):
        self.calls.append(("log_batch", run_id, list(metrics), list(params)))

    def log_artifact(self, run_id, path):
        self.calls.append(("log_artifact", run_id, path))

    def set_terminated(self, run_id, status="FINISHED"):
        self.calls.append(("set_terminated", run_id, status))


@pytest.fixture
def fake_mlflow(monkeypatch):
    RecordingClient.calls, RecordingClient.experiments = [], {}
    mlflow = types.ModuleType("mlflow")
    mlflow.MlflowClient = RecordingClient
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: ("metric", key, value, timestamp, step)
    entities.Param = lambda key, value: ("param", key, value)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    return RecordingClient


def test_log_mlflow_logs_one_run_per_job_into_one_store(fake_mlflow, tmp_path):
    sweep = tmp_path / "sweep"
    for num in (0, 1):
        job = sweep / str(num)
        job.mkdir(parents=True)
        (job / "results.json").write_text("{}")
        assert log_mlflow(RESULT, job, store_root=sweep) == "r1"
    calls = fake_mlflow.calls
    assert calls[0] == ("client", (sweep / "mlruns").resolve().as_uri())
    assert [c for c in calls if c[0] == "create_experiment"] == [
        ("create_experiment", "ablate_levels")]  # the second job reuses the experiment
    run = next(c for c in calls if c[0] == "create_run")
    assert run[2] == "compile=O2 experiment=ablate_levels"
    assert run[3]["baseline"] == "false" and run[3]["outputs_changed"] == "true"
    batches = [c for c in calls if c[0] == "log_batch"]
    params = {p[1]: p[2] for c in batches for p in c[3]}
    metrics = {m[1]: m[2] for c in batches for m in c[2]}
    assert params == params_of(RESULT) and metrics == metrics_of(RESULT)
    artifacts = [c[2] for c in calls if c[0] == "log_artifact"]
    assert artifacts == [str(sweep / "0" / "results.json"), str(sweep / "1" / "results.json")]
    assert calls[-1] == ("set_terminated", "r1", "FINISHED")


def test_log_mlflow_uses_an_explicit_uri_and_marks_failed_runs(fake_mlflow, tmp_path,
                                                                monkeypatch):
    def broken_log_batch(self, *args, **kwargs):
        raise RuntimeError("store is down")

    monkeypatch.setattr(fake_mlflow, "log_batch", broken_log_batch)
    with pytest.raises(RuntimeError, match="store is down"):
        log_mlflow(RESULT, tmp_path, tracking_uri="sqlite:///x.db")
    assert fake_mlflow.calls[0] == ("client", "sqlite:///x.db")
    assert fake_mlflow.calls[-1] == ("set_terminated", "r1", "FAILED")


def test_missing_mlflow_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    with pytest.raises(ImportError, match="pip install mlflow"):
        require_tracking("mlflow")
