"""The report's verdicts on a quantized ablation: outputs compared with the sweep's baseline
(not O0), "significant" vs "within noise" from the rounds, ★ only to a significant
improvement with unchanged outputs, zero-match warnings."""

import pytest
from test_report import _results, _write_job

from experiments.report.sweep_report import build_report


def _with_rounds(results, decode_rounds):
    results["rounds"]["samples"]["decode_median_ms"] = decode_rounds
    return results


@pytest.fixture
def quantized_sweep(tmp_path):
    """ablate_passes at int8: every job differs from O0 (agreement 0.97 with O0) as the
    quantization changes outputs; only one pass changes them against the baseline."""
    ov = lambda t: ["experiment=ablate_passes", f"toggle_passes={t}"]  # noqa: E731
    base_rounds = [10.0, 10.4, 9.8, 10.9, 10.1]
    jobs = [
        # baseline
        (ov("[]"), dict(baseline=True), base_rounds),
        # noise: rounds on both sides of the baseline's
        (ov("[fix_functionalization]"), {}, [10.2, 10.1, 10.0, 10.7, 10.3]),
        # a real 1.26x slowdown (prepack_linear off on CPU)
        (ov("[prepack_linear]"), {}, [r * 1.26 for r in base_rounds]),
        # faster, unchanged outputs: the best
        (ov("[fuse_add_rmsnorm]"), {}, [r * 0.9 for r in base_rounds]),
        # fastest, but it changes outputs against the baseline: never best
        (ov("[fuse_qk_norm_rope]"), dict(ab=0.8), [r * 0.7 for r in base_rounds]),
    ]
    for num, (overrides, extra, rounds) in enumerate(jobs):
        ab = extra.pop("ab", 1.0)
        results = _results(
            "ablate_passes",
            overrides,
            decode=(sorted(rounds)[2], 99.0),
            agreement=0.97,
            logit_diff=0.3,
            agreement_baseline={
                "token_agreement": ab,
                "max_logit_diff": 0.0 if ab == 1.0 else 0.5,
                "outputs_equal": ab == 1.0,
            },
            unmatched=["fuse_qk_norm_rope"] if "fuse_qk_norm_rope" in overrides[1] else (),
            **extra,
        )
        _write_job(tmp_path, num, _with_rounds(results, rounds))
    return tmp_path


def _row(text, toggles):
    return next(ln for ln in text.splitlines() if ln.startswith("|") and f"| {toggles} |" in ln)


def test_outputs_are_compared_with_the_sweeps_baseline_not_O0(quantized_sweep):
    text = build_report(quantized_sweep, plots=False)
    assert "**1 configuration(s) changed outputs versus their sweep's baseline" in text
    assert "⚠ outputs changed: `toggle_passes=[fuse_qk_norm_rope]` (job 4) — token " in text
    assert "token agreement 0.8000 vs the baseline, max logit diff 0.5" in text
    assert not _row(text, "[]").startswith("| baseline, ⚠")
    # agreement with O0 stays a column
    assert "| token agreement vs O0 |" in text and "| 0.9700 |" in _row(text, "[]")


def test_noise_is_within_noise_and_a_real_effect_is_significant(quantized_sweep):
    text = build_report(quantized_sweep, plots=False)
    noise = _row(text, "[fix_functionalization]")
    assert "within noise" in noise and "significant" not in noise.split("|")[4]
    slow = _row(text, "[prepack_linear]")
    assert "(+26.0% [+26.0, +26.0] q=0 significant)" in slow
    lines = [ln for ln in text.splitlines() if ln.startswith("- `toggle_passes=[prepack_linear]")]
    assert lines and "decode median ms +26.0% [+26.0, +26.0] q=0 significant" in lines[0]


def test_best_is_a_significant_improvement_with_unchanged_outputs(quantized_sweep):
    text = build_report(quantized_sweep, plots=False)
    assert _row(text, "[fuse_add_rmsnorm]").startswith("| ★ best |")
    assert not _row(text, "[fuse_qk_norm_rope]").startswith("| ★")  # faster, outputs changed
    assert "Best: `toggle_passes=[fuse_add_rmsnorm]` (job 3)." in text


def test_no_best_when_nothing_is_a_significant_improvement(quantized_sweep):
    import shutil

    for num in (3, 4):
        shutil.rmtree(quantized_sweep / str(num))
    text = build_report(quantized_sweep, plots=False)
    assert "★" not in text.split("## Sweep")[1]
    assert "Best: none (no configuration is a significant improvement" in text


def test_zero_match_warnings_are_listed(quantized_sweep):
    text = build_report(quantized_sweep, plots=False)
    assert "### Warnings" in text
    assert (
        "- ⚠ fusion `fuse_qk_norm_rope` matched nothing in the whole model: "
        "`toggle_passes=[fuse_qk_norm_rope]` (job 4)" in text
    )


def test_a_job_with_the_baselines_code_is_never_best(quantized_sweep):
    """A toggle that compiled to exactly the baseline's code (equal ``code_digest``) can only
    measure noise or a difference between builds: the report says so and keeps it out of ★,
    however significant its delta."""
    import json

    digests = {0: "same", 3: "same"}  # fuse_add_rmsnorm (job 3) compiled nothing new
    for num, digest in digests.items():
        path = quantized_sweep / str(num) / "results.json"
        results = json.loads(path.read_text())
        results["code_digest"] = digest
        path.write_text(json.dumps(results))
    text = build_report(quantized_sweep, plots=False)
    assert not _row(text, "[fuse_add_rmsnorm]").startswith("| ★")
    line = next(l for l in text.splitlines() if l.startswith("- `toggle_passes=[fuse_add_rmsnorm]"))
    assert "significant" in line and line.endswith(
        "— same compiled code as the baseline: these deltas measure noise"
    )
    assert "Best: none" in text
