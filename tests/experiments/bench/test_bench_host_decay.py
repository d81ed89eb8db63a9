"""The host-call-after-a-gap bench (experiments/bench/host_decay.py)."""

from __future__ import annotations

import time

from experiments.bench import host_decay


def test_time_after_runs_the_gap_before_every_timed_call():
    seen = []
    t = host_decay.time_after(lambda: seen.append("before"), lambda: seen.append("call"), 3)
    assert seen == ["before", "call"] * 3
    assert t >= 0


def test_a_sleep_is_not_timed():
    t = host_decay.time_after(lambda: time.sleep(0.01), lambda: None, 3)
    assert t < 0.005


def test_every_case_is_timed_and_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(host_decay, "READ_MB", (1,))
    monkeypatch.setattr(host_decay, "SLEEP_MS", (1,))
    out = tmp_path / "decay.md"
    rows = host_decay.main(["--reps", "2", "--rounds", "1", "--out", str(out)])
    assert [r["before"] for r in rows] == [
        "the same call, back to back",
        "a read of 1 MB",
        "a sleep of 1 ms",
        "a busy Python loop of 3 ms",
    ]
    assert rows[0]["vs_back_to_back"] == 1.0
    assert all(r["us"] > 0 for r in rows)
    assert out.read_text().count("\n| ") == 4 + 1  # the header row and one row a case
