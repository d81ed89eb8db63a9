"""The drift bench (experiments/bench/drift.py): long-lived contender processes alternated
window by window, the project's weights read where they lie after each of its windows, and
spreads and correlations over the windows.  Runs the real project worker on the test model;
llama.cpp needs the optional ``peers`` extra and is not used here."""

from __future__ import annotations

import pytest

from experiments.bench import drift


def _windows(project_ms, read_gb_s, other_ms):
    return [
        {
            "project_bf16": {"step_ms": p},
            "project_bf16@b": {"step_ms": o},
            "probe": {"weights_read_gb_s": r, "compute_gflop_s": 100.0 + i},
        }
        for i, (p, r, o) in enumerate(zip(project_ms, read_gb_s, other_ms))
    ]


def test_summary_spreads_and_correlations():
    # step time inversely proportional to the read rate: the step's rate follows it exactly, at
    # half of it (2 GB in 50 ms is 40 GB/s, read at 80): every window twice its floor
    windows = _windows([50.0, 100.0, 80.0, 40.0], [80.0, 40.0, 50.0, 100.0], [60, 60, 61, 60])
    out = drift.summarize(windows, {"bf16": 2_000_000_000, "q8_0": 1})
    s = out["series"]["project_bf16 step ms"]
    assert (s["min"], s["max"], s["spread"]) == (40.0, 100.0, 2.5)
    assert s["median"] == 65.0
    assert out["series"]["weights read GB/s"]["spread"] == 2.5
    corr = out["correlations"]
    assert corr["project_bf16 step rate ~ weights read rate"] == pytest.approx(1.0)
    assert abs(corr["project_bf16 step rate ~ compute rate"]) < 0.9
    assert "project_bf16 step rate ~ project_bf16@b step rate" in corr
    floor = out["series"]["project_bf16 step / floor at the window's read rate"]
    assert floor["min"] == floor["max"] == pytest.approx(2.0)
    paired = out["paired"]["project_bf16@b / project_bf16"]
    assert paired["median"] == pytest.approx((60 / 50 + 61 / 80) / 2)  # ratios 0.6 .. 1.5
    assert (paired["faster_windows"], paired["windows"]) == (2, 4)
    md = drift.markdown(
        {
            "settings": {"size": "t", "threads": 1, "new_tokens": [2, 4]},
            "windows": windows,
            "summary": out,
        }
    )
    assert "| project_bf16 step ms | 65.00 | 40.00 | 100.00 | 2.500 |" in md
    assert "| project_bf16@b / project_bf16 | 0.981 | 0.600 | 1.500 | 2 of 4 |" in md


def test_spread_of_a_non_positive_window_is_none():
    assert drift.spread([-1.3, 0.1, 0.2])["spread"] is None
    assert drift.spread([1.0, 2.0])["spread"] == 2.0


def test_correlation_needs_variation():
    assert drift.correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    assert drift.correlation([1.0, 2.0], [1.0, 2.0]) is None


def test_windows_alternate_two_project_processes(llama_checkpoint, compile_cache_dir, tmp_path):
    out = drift.main(
        ["--model-dir", str(llama_checkpoint), "--cache-dir", compile_cache_dir]
        + ["--contenders", "project_bf16", "--variant", "one=OMP_PROC_BIND=true"]
        + ["--windows", "3", "--new-tokens", "2", "12", "--prompt-len", "4", "--threads", "1"]
        + ["--work-dir", str(tmp_path), "--out", str(tmp_path / "d.json")]
    )
    assert len(out["windows"]) == 3
    assert out["env"]["project_bf16@one"] == {"OMP_PROC_BIND": "true"}
    for w in out["windows"]:
        for name in ("project_bf16", "project_bf16@one"):
            # t(12) - t(2) over 10 steps may still be swamped by a loaded machine's noise: the
            # runner's own step timer is the positive one
            assert w[name]["tokens_same"] and w[name]["timer_median_ms"] > 0
            assert isinstance(w[name]["step_ms"], float)
        assert w["probe"]["weights_read_gb_s"] > 0 and w["probe"]["compute_gflop_s"] > 0
        assert w["probe"]["file_pmd_mapped_mb"] >= 0 and w["probe"]["anon_huge_mb"] >= 0
    series = out["summary"]["series"]["project_bf16@one step ms"]
    assert series["spread"] is None or series["spread"] >= 1.0
    assert (tmp_path / "d.json").exists()
