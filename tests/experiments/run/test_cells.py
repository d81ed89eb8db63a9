"""One baseline per cell (experiments/run/cells.py) and the report's per-cell sections."""

import pytest
from test_report import _results, _write_job

from experiments.report.sweep_report import build_report
from experiments.run.cells import BaselineConflict, plan_cells


def _ov(level, toggle):
    return {"compile": f"O{level}", "toggle_passes": toggle}


def test_a_level_by_pass_sweep_has_one_baseline_per_level():
    jobs = [_ov(level, t) for level in (1, 2, 3) for t in ("[]", "[x]")]
    plan = plan_cells(jobs, [o["toggle_passes"] == "[]" for o in jobs])
    assert plan.keys == ("compile",)
    assert plan.baseline_of == (0, 0, 2, 2, 4, 4)
    assert plan.label(jobs[3]) == "compile=O2"


def test_zero_or_one_baseline_is_one_cell():
    jobs = [_ov(2, t) for t in ("[]", "[x]", "[y]")]
    assert plan_cells(jobs, [False] * 3).baseline_of == (0, 0, 0)
    assert plan_cells(jobs, [False, True, False]).baseline_of == (1, 1, 1)


def test_two_baselines_of_one_cell_is_an_error_naming_both():
    jobs = [_ov(2, "[]"), _ov(2, "[]"), _ov(3, "[]")]
    with pytest.raises(BaselineConflict, match=r"jobs a and b both claim .* compile=O2"):
        plan_cells(jobs, [True, True, True], ["a", "b", "c"])


def test_a_job_whose_cell_has_no_baseline_is_not_compared():
    jobs = [_ov(1, "[]"), _ov(2, "[]"), _ov(3, "[x]")]
    assert plan_cells(jobs, [True, True, False]).baseline_of == (0, 1, None)


def test_report_has_a_section_per_level_each_against_its_own_baseline(tmp_path):
    """compile=O1,O2,O3 'toggle_passes=[],[x]': the toggle slows O1 by 30% and does nothing
    at O2 and O3 (where the levels differ 2x from each other): each cell's delta is against
    its own level's baseline, not O1's."""
    jitter = (1.0, 1.01, 0.99, 1.005, 0.995)
    num = 0
    for level, base_ms in ((1, 10.0), (2, 5.0), (3, 2.5)):
        for toggle in ("[]", "[x]"):
            slow = 1.3 if (level == 1 and toggle == "[x]") else 1.0
            overrides = [f"compile=O{level}", f"toggle_passes={toggle}"]
            r = _results(
                "ablate_passes",
                overrides,
                baseline=toggle == "[]",
                decode=(base_ms * slow, base_ms * slow * 1.1),
            )
            r["rounds"]["samples"]["decode_median_ms"] = [base_ms * slow * j for j in jitter]
            _write_job(tmp_path, num, r, overrides=overrides)
            num += 1
    text = build_report(tmp_path, plots=False)
    assert "3 cells, each with its own baseline" in text
    sections = text.split("### Cell: ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["compile=O1", "compile=O2", "compile=O3"]
    for section, level in zip(sections, (1, 2, 3)):
        assert f"Baseline: `toggle_passes=[]` (job {2 * (level - 1)})" in section
        row = next(ln for ln in section.splitlines() if f"| {2 * level - 1} | " in ln)
        if level == 1:
            assert "(+30.0% [+30.0, +30.0] q=0 significant)" in row
        else:  # against its own level: no change (against O1 it would read -50% / -75%)
            assert "(+0.0% [+0.0, +0.0] q=1 within noise)" in row
    assert "Benjamini-Hochberg false discovery rate 5% over all" in text


def test_report_refuses_two_baselines_in_one_cell(tmp_path):
    """Jobs 0 and 1 both say baseline with the same level (say, a baseline flag written as
    ``${eq:${toggle_passes},[]}`` in a sweep that also varies something the flag ignores)."""
    for num, level in enumerate((2, 2, 3)):
        r = _results("aa", [f"compile=O{level}"], baseline=True)
        _write_job(tmp_path, num, r, overrides=[f"compile=O{level}", "toggle_passes=[]"])
    with pytest.raises(BaselineConflict, match="both claim"):
        build_report(tmp_path, plots=False)


def test_a_measure_whose_ranges_ran_the_baselines_code_says_it_measures_noise(tmp_path):
    """A decode-only pass: its prefill steps ran the baseline's code (equal digests of the
    prefill ranges), so its prefill delta is labelled noise and it is never ★ for prefill."""
    digests = {"range_1-1": "d1", "range_2-512": "p"}
    used = {"decode": ["range_1-1"], "prefill": ["range_2-512"]}
    for num, (toggle, decode_digest, factor) in enumerate(
        [("[]", "d1", 1.0), ("[decode_only]", "d1-changed", 0.8)]
    ):
        overrides = [f"toggle_passes={toggle}"]
        r = _results("ablate_passes", overrides, baseline=toggle == "[]")
        r["code_digests"] = {**digests, "range_1-1": decode_digest}
        r["ranges_used"] = used
        r["rounds"]["samples"]["prefill_median_ms"] = [
            40.0 * f * factor for f in (1.0, 1.01, 0.99, 1.005, 0.995)
        ]
        _write_job(tmp_path, num, r, overrides=overrides)
    text = build_report(tmp_path, plots=False, metric="prefill_median")
    line = next(ln for ln in text.splitlines() if ln.startswith("- `toggle_passes=[decode_only]`"))
    assert "same prefill code as the baseline: the prefill_median delta(s) measure noise" in line
    assert "Best: none" in text  # a significant -20% prefill, but on the baseline's code


def test_a_multirun_with_two_baselines_in_one_cell_fails_before_building(tmp_path):
    """The sweep check runs in the multirun's start callback, before any job: a sweep whose
    expansion has two baseline jobs in one cell is refused naming both."""
    from hydra import compose, initialize_config_dir
    from hydra_job_harness import CONF_DIR

    import experiments.run.job  # noqa: F401  (registers the resolvers)
    from experiments.run.sweep import check_baselines, sweep_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="t"):
        cfg = compose("config", overrides=["experiment=aa_noise"], return_hydra_config=True)
        cfg.hydra.overrides.task = ["experiment=aa_noise", "compile=O1,O2"]
        jobs = sweep_overrides(cfg)
        assert len(jobs) == 4  # seed 0,1 (the experiment's params) x compile O1,O2
        check_baselines(cfg)  # one baseline (seed=0) per level: fine
        cfg.hydra.sweeper.params = {"seed": "0,0"}  # two identical baseline jobs per level
        with pytest.raises(BaselineConflict, match="both claim to be the baseline"):
            check_baselines(cfg)
