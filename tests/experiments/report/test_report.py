"""Report on a fake-but-realistic Hydra multirun folder (the layout Hydra writes)."""

import json

import matplotlib.image
import pytest

from experiments.report.sweep_report import build_report, main, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _results(
    experiment,
    overrides,
    *,
    baseline=False,
    decode=(10.0, 12.0),
    prefill=(40.0, 48.0),
    tps=95.0,
    cold=30.0,
    warm=4.0,
    hits=0,
    misses=5,
    agreement=1.0,
    logit_diff=0.0,
    passes=None,
    padding=None,
    sizes=None,
    agreement_baseline=None,
    unmatched=(),
):
    """Fake results of a job timed in 5 interleaved rounds (a fixed +-1% jitter around the
    medians, so a 20% difference is significant)."""
    jitter = (0.99, 1.0, 1.01, 0.995, 1.005)
    return {
        "experiment": experiment,
        "overrides": overrides,
        "baseline": baseline,
        "config": {"compile": {"level": 2}},
        "versions": {"torch": "2.13.0", "piecewise": "0.1.0", "python": "3.11.7"},
        "compile": {
            "cold_s": cold,
            "warm_s": warm,
            "pieces": 9,
            "unique_artifacts": 3,
            "cache_hits": hits,
            "cache_misses": misses,
        },
        "latency_ms": {
            "prefill": {"median": prefill[0], "p90": prefill[1]},
            "decode": {"median": decode[0], "p90": decode[1]},
        },
        "tokens_per_s": tps,
        "rounds": {
            "interleaved": True,
            "n": 5,
            "samples": {
                "decode_median_ms": [decode[0] * f for f in jitter],
                "prefill_median_ms": [prefill[0] * f for f in jitter],
                "tokens_per_s": [tps * f for f in jitter],
            },
        },
        "passes": passes or {},
        "unmatched_fusions": list(unmatched),
        "agreement_baseline": agreement_baseline,
        "agreement": {
            "token_agreement": agreement,
            "max_logit_diff": logit_diff,
            "outputs_equal": agreement == 1.0,
        },
        "accuracy": None,
        "padding_waste": padding,
        "capture_sizes": sizes,
    }


def _write_job(root, num, results, overrides=None):
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    overrides = results.get("overrides", []) if overrides is None else overrides
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / ".hydra" / "config.yaml").write_text("compile:\n  level: 2\n")
    (job / "results.json").write_text(json.dumps(results))
    return job


@pytest.fixture
def levels_multirun(tmp_path):
    """ablate_levels: O0 baseline, O1, and an O2 that is fastest but changed outputs."""
    root = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    ov = lambda level: ["experiment=ablate_levels", f"compile=O{level}"]  # noqa: E731
    _write_job(
        root,
        0,
        _results(
            "ablate_levels",
            ov(0),
            baseline=True,
            decode=(11.0, 13.5),
            prefill=(52.0, 60.0),
            tps=80.0,
            cold=0.0,
            warm=None,
            misses=0,
        ),
    )
    _write_job(
        root,
        1,
        _results(
            "ablate_levels",
            ov(1),
            decode=(8.8, 9.9),
            tps=100.0,
            cold=35.0,
            warm=5.0,
            hits=0,
            misses=9,
            passes={"noop_elimination": {"matches": 16, "time_s": 0.012}},
        ),
    )
    _write_job(
        root,
        2,
        _results(
            "ablate_levels",
            ov(2),
            decode=(7.5, 8.1),
            tps=120.0,
            cold=41.0,
            warm=5.5,
            agreement=0.9725,
            logit_diff=0.41,
            passes={
                "noop_elimination": {"matches": 16, "time_s": 0.011},
                "fuse_add_rmsnorm": {"matches": 15, "time_s": 0.034},
            },
        ),
    )
    return root


def _row(text, job):
    return next(
        line for line in text.splitlines() if line.startswith("|") and f"| {job} | O{job} |" in line
    )


def test_report_tables_marks_and_outputs_changed(levels_multirun):
    out = write_report(levels_multirun)
    assert out == levels_multirun / "report.md"
    text = out.read_text()
    assert "## Sweep: ablate_levels" in text
    assert "3 job(s) in 1 sweep(s)" in text
    header = next(line for line in text.splitlines() if line.startswith("|  | job |"))
    for column in (
        "compile",
        "decode median ms",
        "decode p90 ms",
        "prefill median ms",
        "tokens/s",
        "compile cold s",
        "warm s",
        "cache hits/misses",
        "token agreement vs baseline",
        "max logit diff vs baseline",
        "token agreement vs O0",
        "max logit diff vs O0",
    ):
        assert f"| {column} |" in header
    # the varying override is a column; the constant one (experiment=) is not
    assert "| experiment |" not in header
    rows = [_row(text, job) for job in (0, 1, 2)]
    assert rows[0].startswith("| baseline | 0 | O0 |")
    # O2 is fastest but changed outputs, so the best row is O1
    assert rows[1].startswith("| ★ best | 1 | O1 |")
    assert rows[2].startswith("| ⚠ | 2 | O2 |")
    # paired rounds with the same jitter: the ratio is the same in every round
    assert "8.80 [8.71, 8.89] (-20.0% [-20.0, -20.0] q=0 significant)" in rows[1]
    assert "100.0 [99.0, 101.0] (+25.0% [+25.0, +25.0] q=0 significant)" in rows[1]
    assert "Timed in 5 round(s) per configuration, interleaved round-robin" in text
    assert "| 0/9 |" in rows[1]
    assert "| — |" in rows[0]  # warm_s is null for O0
    assert (
        "⚠ outputs changed: `compile=O2` (job 2) — token agreement 0.9725 vs O0, "
        "max logit diff 0.41" in text
    )
    assert "**1 configuration(s) changed outputs versus their sweep's baseline" in text
    assert "Versions: torch 2.13.0, piecewise 0.1.0, python 3.11.7" in text
    assert "| fuse_add_rmsnorm |" in text and "15 (34.0 ms)" in text


def test_report_pngs_are_valid_images(levels_multirun):
    text = write_report(levels_multirun).read_text()
    pngs = sorted(levels_multirun.glob("*.png"))
    assert {p.name for p in pngs} == {"ablate_levels_latency.png", "ablate_levels_compile.png"}
    for png in pngs:
        assert f"]({png.name})" in text
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # something was drawn


def test_padding_plot_baseline_flag_and_second_sweep(levels_multirun):
    root = levels_multirun
    sizes_default = [1, 2, 4] + list(range(8, 257, 8))
    _write_job(
        root,
        3,
        _results(
            "sweep_sizes",
            ["experiment=sweep_sizes", "sizes=chosen"],
            padding=0.031,
            sizes=[3, 6, 15, 23, 62, 136, 313, 440],
        ),
    )
    _write_job(
        root,
        4,
        _results(
            "sweep_sizes",
            ["experiment=sweep_sizes", "sizes=default"],
            baseline=True,
            padding=0.42,
            sizes=sizes_default,
        ),
    )
    text = write_report(root).read_text()
    assert "## Sweep: sweep_sizes" in text and "5 job(s) in 2 sweep(s)" in text
    assert "Baseline: `sizes=default` (job 4)" in text
    assert "| padding waste |" in text and "3.10%" in text
    padding = root / "sweep_sizes_padding.png"
    assert padding.read_bytes().startswith(PNG_SIGNATURE)
    assert matplotlib.image.imread(padding).shape[2] in (3, 4)
    assert "Outputs unchanged in every configuration of this sweep" in text


def test_missing_keys_show_dashes_and_bad_jobs_are_listed(tmp_path, capsys):
    _write_job(tmp_path, 0, {"experiment": "sparse"}, overrides=["compile=O1"])
    _write_job(
        tmp_path,
        1,
        {
            "experiment": "sparse",
            "latency_ms": {"decode": {"median": 5}},
            "compile": {"cache_hits": 3},
            "agreement": {"outputs_equal": False},
        },
        overrides=["compile=O2"],
    )
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "results.json").write_text("{truncated")
    assert main([str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    text = (tmp_path / "report.md").read_text()
    row0 = next(line for line in text.splitlines() if "| 0 | O1 |" in line)
    assert [c.strip() for c in row0.split("|")[4:-1]] == ["—"] * 11  # every metric missing
    assert "| 3/— |" in text
    assert "⚠ outputs changed: `compile=O2` (job 1) — outputs differ from O0" in text
    assert "skipped: job `2`" in text and "not readable JSON" in text
    assert (tmp_path / "sparse_latency.png").exists()
    assert not (tmp_path / "sparse_padding.png").exists()


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json under"):
        build_report(tmp_path)


def test_a_plot_with_no_information_is_not_drawn(tmp_path):
    """On CPU nothing is padded (no CUDA graphs): an all-0 % padding plot is skipped, while the
    latency and compile plots are drawn."""
    for num, level in enumerate(("O1", "O2")):
        _write_job(
            tmp_path,
            num,
            _results("cpu_sweep", [f"compile={level}"], baseline=num == 0, padding=0.0),
            overrides=[f"compile={level}"],
        )
    build_report(tmp_path)
    assert (tmp_path / "cpu_sweep_latency.png").exists()
    assert (tmp_path / "cpu_sweep_compile.png").exists()
    assert not (tmp_path / "cpu_sweep_padding.png").exists()


def test_break_even_of_compiling_against_eager(tmp_path):
    """ablate_compile: O0 starts in 1 s at 100 tokens/s; O2 starts cold in 21 s (warm 1.5 s)
    at 200 tokens/s, i.e. saves 5 ms per token: the cold compile pays off after 20 s / 5 ms =
    4,000 tokens, the warm start after 0.5 s / 5 ms = 100; O1 is not faster: never."""
    specs = [(0, 1.0, None, 100.0), (1, 11.0, 1.2, 100.0), (2, 21.0, 1.5, 200.0)]
    for num, (level, cold, warm, tps) in enumerate(specs):
        r = _results(
            "ablate_compile",
            [f"compile=O{level}"],
            baseline=level == 0,
            cold=cold,
            warm=warm,
            tps=tps,
        )
        r["resolved_compilation"] = {"level": level}
        _write_job(tmp_path, num, r, overrides=[f"compile=O{level}"])
    text = build_report(tmp_path, plots=False)
    assert "#### Does compiling pay off?" in text
    o2 = next(ln for ln in text.splitlines() if ln.startswith("| `compile=O2` |"))
    assert o2.endswith("| +5.000 | 4,000 | 100 |"), o2
    o1 = next(ln for ln in text.splitlines() if ln.startswith("| `compile=O1` |"))
    assert "never (not faster than O0)" in o1


def test_a_failed_job_gets_its_own_section_and_stays_out_of_the_tables(levels_multirun):
    root = levels_multirun
    failed = {
        "status": "failed",
        "error": "ValueError: LLM.max_model_len: must be a positive int, got 0",
        "failed_at": "build",
        "traceback": "Traceback (most recent call last): ...",
        "experiment": "ablate_levels",
        "overrides": ["experiment=ablate_levels", "compile=O3"],
        "baseline": False,
        "job_dir": str(root / "3"),
    }
    _write_job(root, 3, failed)
    (root / "3" / "run.log").write_text("[ERROR] job failed\nTraceback ...\n")
    text = build_report(root, plots=False)
    assert "3 job(s) in 1 sweep(s), **1 failed** (see Failed jobs)" in text
    section = text.split("## Failed jobs", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| 3 |"))
    assert "compile=O3" in row and "| build |" in row and "3/run.log" in row
    assert "must be a positive int, got 0" in row
    sweep = text.split("## Sweep: ablate_levels", 1)[1]
    assert "O3" not in sweep
