"""The report's speculative-decoding table on a fake ablate_spec multirun: two cells (one per
method, each with its k = 0 baseline), acceptance per position, speed-up over k = 0."""

from test_report import _results, _write_job

from experiments.report.sweep_report import build_report


def _spec_results(method, k, tps, acceptance=None, per_position=None, mean_len=None):
    over = ["experiment=ablate_spec", f"+spec_method={method}", f"spec_k={k}"]
    r = _results("ablate_spec", over, baseline=k == 0, tps=tps)
    if k:
        r["stats"] = {
            "spec_method": method,
            "spec_num_speculative_tokens": k,
            "spec_acceptance_rate": acceptance,
            "spec_acceptance_rate_per_position": per_position,
            "spec_mean_accepted_length": mean_len,
            "spec_propose_ms_per_step": 0.25,
            "spec_verify_ms_per_step": 3.5,
        }
    else:
        r["stats"] = {}
    return r


def test_spec_table_per_method_cell(tmp_path):
    root = tmp_path / "multirun"
    root.mkdir()
    jobs = [
        _spec_results("ngram", 0, 100.0),
        _spec_results("ngram", 2, 210.0, 0.9, [0.95, 0.85], 2.8),
        _spec_results("draft_model", 0, 50.0),
        _spec_results("draft_model", 4, 60.0, 0.75, [0.9, 0.8, 0.7, 0.6], 4.0),
    ]
    for i, r in enumerate(jobs):
        _write_job(root, i, r)
    text = build_report(root, plots=False)
    assert "### Cell: spec_method=ngram" in text and "### Cell: spec_method=draft_model" in text
    assert text.count("#### Speculative decoding") == 2
    rows = [line for line in text.splitlines() if line.startswith("| spec_k=")]
    ngram2 = next(r for r in rows if "spec_k=2" in r)
    assert "| ngram | 2 | 0.900 | 0.95 / 0.85 | 2.80 |" in ngram2
    assert "2.10x" in ngram2  # 210 / 100 tokens/s
    draft4 = next(r for r in rows if "spec_k=4" in r)
    assert "0.90 / 0.80 / 0.70 / 0.60" in draft4 and "1.20x" in draft4
    base = next(r for r in rows if "spec_k=0" in r and "| off |" in r)
    assert "1.00x" in base
