"""The small-M linear benchmarks (experiments/bench/small_m_linear.py, small_m_step.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.bench import small_m_linear as bml
from experiments.bench import small_m_step as bms
from passes import small_m_linear as small_m

pytestmark = pytest.mark.skipif(
    not small_m.kernel_available(), reason="the small-M kernel needs a C++ compiler"
)


def test_microbenchmark_reports_every_family_shape_and_row_count(capsys, tmp_path):
    out = tmp_path / "rows.json"
    rows = bml.main(
        ["--threads", "1", "--kernels", "bf16", "int8", "int8_wo", "--rows", "1", "3", "20"]
        + ["--shapes", "96x64", "--rounds", "1", "--sweep-mb", "1", "--json", str(out)]
    )
    assert [(r["family"], r["shape"], r["M"]) for r in rows] == [
        (f, "96x64", m) for f in ("bf16", "int8", "int8_wo") for m in (1, 3, 20)
    ]
    for r in rows:
        for impl in bml.family_spec(r["family"])[0]:
            us, gbs, best = r[impl]
            assert us > 0 and 0 < gbs <= best
    text = capsys.readouterr().out
    assert f"kernel vs {bml.family_spec('bf16')[1]}" in text and "kernel vs _int_mm" in text
    assert "bf16: crossover" in text and "int8_wo: crossover" in text
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"bf16", "int8", "int8_wo"}


def test_crossover_is_the_last_row_count_before_the_kernel_loses():
    def row(m, shape, kernel, base):
        return {"family": "bf16", "shape": shape, "M": m, "kernel": (kernel,), "oneDNN": (base,)}

    rows = [row(1, "a", 1, 2), row(1, "b", 1, 1), row(8, "a", 2, 2), row(8, "b", 1, 1)]
    rows += [row(16, "a", 4, 2), row(16, "b", 1, 1), row(32, "a", 1, 9), row(32, "b", 1, 1)]
    gmean, best = bml.crossover(rows, "bf16")
    assert gmean[1] == pytest.approx(2**0.5) and gmean[8] == 1.0
    assert gmean[16] == pytest.approx(0.5**0.5)
    assert best == 8  # M=32 wins again, but M=16 in between loses


@pytest.mark.slow(reason="an Inductor compile of the 2-layer model at O2")
def test_step_benchmark_compares_both_variants(llama_checkpoint, compile_cache_dir, capsys):
    rows = bms.main(
        [
            "--model-dir",
            str(llama_checkpoint),
            "--batches",
            "1",
            "--steps",
            "4",
            "--rounds",
            "1",
            "--prompt-len",
            "8",
            "--threads",
            "1",
            "--cache-dir",
            str(compile_cache_dir),
        ]
    )
    assert [r["variant"] for r in rows] == ["oneDNN", "small-M"]
    assert rows[0]["speedup"] == 1.0 and all(r["median_ms"] > 0 for r in rows)
    assert bms.VARIANTS["small-M"] == small_m.DEFAULT_MAX_ROWS
    assert "| 1 | small-M |" in capsys.readouterr().out


def test_cpu_clock_needs_one_thread_and_runs_with_one():
    """``--clock cpu`` times one thread's CPU time: refused with two threads (the benchmarks of
    the kernels and of the verify step), and a real measurement with one."""
    from experiments.bench import verify_step as bench_verify_step

    with pytest.raises(SystemExit):
        bml.main(["--clock", "cpu", "--threads", "2", "--shapes", "96x64"])
    with pytest.raises(SystemExit):
        bench_verify_step.main(["--clock", "cpu", "--threads", "2"])
    rows = bml.main(
        ["--clock", "cpu", "--threads", "1", "--kernels", "bf16", "--shapes", "96x64"]
        + ["--rows", "8", "--rounds", "1", "--sweep-mb", "1"]
    )
    assert rows[0]["M"] == 8 and rows[0]["kernel"][0] > 0


REPO = Path(__file__).resolve().parents[3]


def _kernels_as_committed() -> bool:
    """The kernels' sources equal HEAD's (a clean clone; the A/B's same-bits check needs it)."""
    return (
        subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", *bml.BASELINE_SOURCES], cwd=REPO
        ).returncode
        == 0
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_baseline_ab_times_both_builds_and_compares_their_bits(capsys):
    """``--baseline HEAD``: the kernels at HEAD are built beside the current ones and timed
    against them, every family through ctypes; one row pass (3 rows) and several (20 rows:
    the driver's row passes over k-blocks)."""
    rows = bml.main(
        ["--threads", "1", "--kernels", "bf16", "int8", "int8_wo", "--rows", "1", "3", "20"]
        + ["--shapes", "96x64", "200x64", "--rounds", "1", "--sweep-mb", "1"]
        + ["--baseline", "HEAD"]
    )
    assert [(r["family"], r["shape"], r["M"]) for r in rows] == [
        (f, s, m)
        for f in ("bf16", "int8", "int8_wo")
        for s in ("96x64", "200x64")
        for m in (1, 3, 20)
    ]
    for r in rows:
        assert r["baseline"] == "revision" and isinstance(r["same_bits"], bool)
        for impl in ("kernel", "revision"):
            us, gbs, best = r[impl]
            assert us > 0 and 0 < gbs <= best
    if _kernels_as_committed():
        assert all(r["same_bits"] for r in rows)
    text = capsys.readouterr().out
    assert "kernels at HEAD (revision)" in text and "| kernel vs revision | same bits |" in text
    assert "crossover" not in text


def test_a_bad_baseline_revision_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no-such-revision"):
        bml.baseline_libraries("no-such-revision", tmp_path)
