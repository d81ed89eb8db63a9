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
