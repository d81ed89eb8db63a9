"""The sweep report on a real multirun: ``python -m experiments.run -m`` launches three tiny
jobs of ablate_quant (no quantization = baseline, int8, fp8), then ``python -m
experiments.report`` writes report.md and the PNG plots from what those jobs wrote."""

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from hydra_job_harness import TINY

ROOT = Path(__file__).resolve().parents[3]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUANTS = ["null", "int8_per_token", "fp8_per_tensor"]


def _run(args, timeout):
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def multirun(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("multirun") / "sweep"
    _run(
        [
            "experiments.run",
            "-m",
            "experiment=ablate_quant",
            *TINY,
            "compile=O0",
            f"quantization={','.join(QUANTS)}",
            f"hydra.sweep.dir={sweep}",
        ],
        timeout=600,
    )
    _run(["experiments.report", str(sweep)], timeout=120)
    jobs = {}
    for num in range(len(QUANTS)):
        results = json.loads((sweep / str(num) / "results.json").read_text())
        overrides = yaml.safe_load((sweep / str(num) / ".hydra" / "overrides.yaml").read_text())
        quant = next(o.split("=", 1)[1] for o in overrides if o.startswith("quantization="))
        jobs[quant] = (num, results)
    return sweep, (sweep / "report.md").read_text(), jobs


def _table_rows(report: str) -> list[list[str]]:
    section = report.split("## Sweep: ablate_quant", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2 : 2 + len(QUANTS)]]
    return [dict(zip(header, row)) for row in rows]


def test_every_job_wrote_results_with_one_baseline(multirun):
    _, _, jobs = multirun
    assert sorted(jobs) == sorted(QUANTS)
    assert [q for q, (_, r) in jobs.items() if r["baseline"]] == ["null"]
    assert all(r["experiment"] == "ablate_quant" for _, r in jobs.values())


def test_jobs_were_timed_in_interleaved_rounds_and_compared_with_the_baseline(multirun):
    """The basic launcher ran the jobs in one process: all were built first, then timed
    round-robin (experiments.run.sweep.InterleavedRounds), then compared with the baseline."""
    _, _, jobs = multirun
    base_outputs = jobs["null"][1]["outputs"]
    for quant, (_, r) in jobs.items():
        assert r["rounds"]["interleaved"] is True and r["rounds"]["n"] == 5
        samples = r["rounds"]["samples"]
        assert len(samples["decode_median_ms"]) == len(samples["wall_s"]) == 5
        # builds default to rounds: every round timed a fresh build of its configuration
        assert r["rounds"]["builds"] == 5 and samples["build"] == [0, 1, 2, 3, 4]
        assert r["latency_ms"]["decode"]["rounds"] == 5
        lo, hi = r["latency_ms"]["decode"]["ci95"]
        assert lo <= r["latency_ms"]["decode"]["median"] <= hi
        ab = r["agreement_baseline"]
        assert ab["outputs_equal"] == (r["outputs"] == base_outputs), quant
    assert jobs["null"][1]["agreement_baseline"]["token_agreement"] == 1.0


def test_report_table_marks_baseline_best_and_deltas(multirun):
    _, report, jobs = multirun
    rows = {row["quantization"]: row for row in _table_rows(report)}
    assert sorted(rows) == sorted(QUANTS)
    assert "baseline" in rows["null"][""]
    assert not any("baseline" in rows[q][""] for q in QUANTS[1:])
    assert rows["null"]["job"] == str(jobs["null"][0])
    # every other row shows its delta against the baseline decode median, with a verdict
    for quant in QUANTS[1:]:
        assert re.search(
            r"\([+-]\d+\.\d% \[[+-]\d+\.\d, [+-]\d+\.\d\] q=[0-9.e-]+ "
            r"(significant|within noise)[^)]*\)",
            rows[quant]["decode median ms"],
        ), rows[quant]
    # ★ only for a significant improvement with outputs equal to the baseline's
    best = [q for q, row in rows.items() if "★" in row[""]]
    assert len(best) <= 1
    for q in best:
        assert jobs[q][1]["agreement_baseline"]["outputs_equal"]
        assert "significant" in rows[q]["decode median ms"]
        assert "within noise" not in rows[q]["decode median ms"]


def test_report_says_where_outputs_changed(multirun):
    _, report, jobs = multirun
    for quant, (num, results) in jobs.items():
        line = f"`quantization={quant}` (job {num})"
        changed = results["agreement_baseline"]["token_agreement"] < 1.0
        assert (f"⚠ outputs changed: {line}" in report) == changed, quant


def test_report_pngs_are_valid_images(multirun):
    sweep, report, _ = multirun
    for kind in ("latency", "compile", "padding"):
        path = sweep / f"ablate_quant_{kind}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert f"]({path.name})" in report  # embedded in report.md
