"""The small-M linear benchmarks (experiments/bench/small_m_linear.py, small_m_step.py)."""

from __future__ import annotations

import pytest

from experiments.bench import small_m_linear as bml
from experiments.bench import small_m_step as bms
from passes import small_m_linear as small_m

pytestmark = pytest.mark.skipif(
    not small_m.kernel_available(), reason="the small-M kernel needs a C++ compiler"
)


def test_microbenchmark_reports_every_shape_and_row_count(capsys):
    rows = bml.main(
        [
            "--threads",
            "1",
            "--rows",
            "1",
            "3",
            "--shapes",
            "96x64",
            "--rounds",
            "1",
            "--sweep-mb",
            "1",
        ]
    )
    assert [(r["shape"], r["M"]) for r in rows] == [("96x64", 1), ("96x64", 3)]
    for r in rows:
        for impl in ("kernel", "mkldnn", "F.linear"):
            us, gbs, best = r[impl]
            assert us > 0 and 0 < gbs <= best
    assert "kernel vs mkldnn" in capsys.readouterr().out


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
