"""experiments/bench/pytest_bench.py: the pytest command it builds and the baseline it writes."""

from __future__ import annotations

import json

from experiments.bench import pytest_bench as bench


def test_compare_only_when_the_baseline_exists(tmp_path):
    args, extra = bench.parse_args(
        ["--baseline", str(tmp_path / "b.json"), "--fail-over", "20", "--", "-k", "overhead"]
    )
    cmd = bench.pytest_command(args, extra, None)
    assert cmd[-2:] == ["-k", "overhead"]
    assert any(c.endswith("experiments/bench/pytest_suite") for c in cmd)
    assert not any(c.startswith("--benchmark-compare") for c in cmd)
    (tmp_path / "b.json").write_text("{}")
    cmd = bench.pytest_command(args, extra, tmp_path / "run.json")
    assert f"--benchmark-compare={(tmp_path / 'b.json').resolve()}" in cmd
    assert "--benchmark-compare-fail=median:20.0%" in cmd
    assert f"--benchmark-json={tmp_path / 'run.json'}" in cmd


def test_env_carries_the_model_choice():
    args, _ = bench.parse_args(
        [
            "--preset",
            "test-llama",
            "--dtype",
            "float32",
            "--level",
            "1",
            "--threads",
            "1",
            "--cache-dir",
            "/tmp/x",
        ]
    )
    env = bench.bench_env(args)
    assert (
        env["PIECEWISE_BENCH_PRESET"],
        env["PIECEWISE_BENCH_DTYPE"],
        env["PIECEWISE_BENCH_LEVEL"],
        env["PIECEWISE_BENCH_THREADS"],
        env["PIECEWISE_BENCH_CACHE_DIR"],
    ) == ("test-llama", "float32", "1", "1", "/tmp/x")


def test_baseline_drops_raw_timings(tmp_path):
    raw = tmp_path / "raw.json"
    raw.write_text(
        json.dumps(
            {
                "machine_info": {"node": "n"},
                "benchmarks": [{"fullname": "t::a", "stats": {"median": 1.0, "data": [1.0, 1.0]}}],
            }
        )
    )
    out = tmp_path / "sub" / "baseline.json"
    bench.write_baseline(raw, out)
    data = json.loads(out.read_text())
    assert data["benchmarks"][0]["stats"] == {"median": 1.0}
    assert data["machine_info"] == {"node": "n"}
    assert [p.name for p in out.parent.iterdir()] == ["baseline.json"]
