"""The attention micro-benchmark runs end to end on small shapes and reports both backends."""

import dataclasses

import pytest

from experiments.bench import attention as bench_attention


def test_runs_every_case_round_robin(monkeypatch, capsys):
    small = tuple(
        dataclasses.replace(
            c,
            ctx_lens=tuple(min(n, 64) for n in c.ctx_lens),
            q_lens=tuple(min(n, 16) for n in c.q_lens),
        )
        for c in bench_attention.CASES
    )
    monkeypatch.setattr(bench_attention, "CASES", small)
    monkeypatch.setattr(bench_attention, "measure_read_bandwidth", lambda: 1e10)
    rows = bench_attention.main(
        ["--rounds", "2", "--round-seconds", "0.002", "--threads", "1"]
        + ["--evict-mb", "4", "--cold-calls", "2"]
    )
    assert [r["case"] for r in rows] == [c.name for c in small]
    for r in rows:
        assert r["torch_us"] > 0 and r["cpu_paged_us"] > 0
        assert r["speedup"] == pytest.approx(r["torch_us"] / r["cpu_paged_us"])
        # cold: the decode cases only (a prefill reads its KV as it writes it)
        assert (r["cpu_paged_cold_us"] is not None) == r["case"].startswith("decode")
        assert r["cpu_paged_cold_us"] is None or r["cpu_paged_cold_us"] > 0
    out = capsys.readouterr().out
    assert "target: b1 decode <= 128 tokens <= 30 µs per call:" in out
    assert "target: 4k-context KV read >= 50% of bandwidth:" in out


def test_the_main_bench_runs_it_with_every_option_at_its_default(monkeypatch):
    """``python -m experiments.bench`` (vs_hf) measures attention through ``measure_attention``,
    which parses its settings with this bench's own parser: an option added here reaches it
    (a hand-built namespace once lacked ``evict_mb`` and the main bench died on it)."""
    import argparse

    from experiments.bench.measure import measure_attention

    monkeypatch.setattr(bench_attention, "CASES", bench_attention.CASES[:1])
    monkeypatch.setattr(bench_attention, "measure_read_bandwidth", lambda: 1e10)
    seen = []
    real_run = bench_attention.run
    monkeypatch.setattr(bench_attention, "run", lambda ns: seen.append(ns) or real_run(ns))
    rows = measure_attention("float32", argparse.Namespace(rounds=1))
    defaults = vars(bench_attention.parser().parse_args([]))
    assert vars(seen[0]) == dict(defaults, dtype="float32", rounds=1)
    assert [r["case"] for r in rows] == [bench_attention.CASES[0].name]
    assert rows[0]["dtype"] == "float32" and rows[0]["bandwidth_gb_s"] == 10.0
