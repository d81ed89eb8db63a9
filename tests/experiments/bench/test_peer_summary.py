"""experiments/bench/peer_summary.py: a results file read back into medians, spreads, ratios
and floors, on a hand-made results dict (no contender runs)."""

from __future__ import annotations

import pytest

from experiments.bench import peer_summary


def _run(contender: str, round_: int, step_ms: dict[int, float], *, timed: bool = True) -> dict:
    return {
        "size": "tiny",
        "contender": contender,
        "round": round_,
        "start_s": 1.0 + round_,
        "warm_after_torch_s": 0.5,
        "rss_end": {"VmHWM": int(2e9) + round_},
        "load": {"others_frac": 0.01, "steal_frac": 0.0},
        "batches": {
            str(b): {
                "timed": timed,
                "step_ms": ms,
                "tokens_match": True if contender != "project_bf16" else None,
                "first_divergence": None,
                "why_not_timed": None if timed else "tokens differ",
                "rss_after": {"VmHWM": int(1e9)},
            }
            for b, ms in step_ms.items()
        },
    }


@pytest.fixture
def data() -> dict:
    runs = []
    for r, (ours, peer, variant) in enumerate([(2.0, 3.0, 2.5), (4.0, 3.3, 2.0), (3.0, 2.7, 3.0)]):
        runs.append(_run("project_bf16", r, {1: ours, 8: 2 * ours}))
        runs.append(_run("llamacpp_bf16", r, {1: peer, 8: 3 * peer}))
        runs.append(_run("project_bf16@head", r, {1: variant}))
    return {
        "runs": runs,
        "probes": [{"best_gb_s": 40.0}],
        "models": {"tiny": {"streamed_bytes": {"bf16": int(80e6), "q8_0": int(43e6)}}},
        "skipped": {"ct2_int8": "ctranslate2 is not installed"},
    }


def test_medians_spreads_and_ratios_of_medians(data):
    summary = peer_summary.summarize(data)
    ours = summary["tiny/project_bf16"]["batches"]["1"]["stats"]
    assert (ours["median"], ours["min"], ours["max"], ours["spread"], ours["n"]) == (
        3.0,
        2.0,
        4.0,
        2.0,
        3,
    )
    assert summary["tiny/project_bf16"]["start_s"]["median"] == 2.0
    rat = {
        (r["batch"], r["ratio"]): r["speedup"]
        for r in peer_summary.ratios(summary, ["tiny"], [1, 8])
    }
    assert rat[(1, "project bf16 vs llama.cpp bf16")] == pytest.approx(3.0 / 3.0)
    assert rat[(8, "project bf16 vs llama.cpp bf16")] == pytest.approx(9.0 / 6.0)
    # a variant is compared with the contender it varies, where both ran that batch
    assert rat[(1, "project_bf16@head vs project_bf16")] == pytest.approx(3.0 / 2.5)
    assert (8, "project_bf16@head vs project_bf16") not in rat
    # pairs with a contender that never ran are left out, not reported as 0 or inf
    assert not any("CTranslate2" in label for _, label in rat)


def test_ratios_within_each_round_beside_the_ratio_of_medians(data):
    # rounds: ours 2.0 / 4.0 / 3.0, the peer 3.0 / 3.3 / 2.7 ms at b1: per round 1.5, 0.825, 0.9
    summary = peer_summary.summarize(data)
    rows = peer_summary.ratios(summary, ["tiny"], [1], data["runs"])
    row = next(r for r in rows if r["ratio"] == "project bf16 vs llama.cpp bf16")
    assert row["speedup"] == pytest.approx(1.0)  # the targets' number is unchanged
    p = row["paired"]
    assert (p["median"], p["min"], p["max"], p["n"]) == pytest.approx((0.9, 0.825, 1.5, 3))
    # a drift that slows every contender of a round alike leaves the round's ratio alone
    for r in data["runs"]:
        if r["round"] == 1:
            r["batches"]["1"]["step_ms"] *= 3
    drifted = peer_summary.paired(data["runs"], "tiny", "llamacpp_bf16", "project_bf16", 1)
    assert drifted == pytest.approx(p)
    # a round where one of the two was not timed is left out
    data["runs"][0]["batches"]["1"]["timed"] = False
    assert peer_summary.paired(data["runs"], "tiny", "llamacpp_bf16", "project_bf16", 1)["n"] == 2
    assert peer_summary.paired(data["runs"], "tiny", "ct2_int8", "project_bf16", 1) is None
    md = peer_summary.markdown(data, summary, rows, {})
    assert "| tiny | 1 | project bf16 vs llama.cpp bf16 | 1.00x | 0.90x [0.82, 1.50] |" in md


def test_start_reports_first_tokens_and_the_page_cache_share(data):
    """The project's share is its mapped weights file's (``LLM.stats``) on a cache hit, else
    its weight files' as the worker measured them; runs from before either was kept count
    as absent, not as 0."""
    for run in data["runs"]:
        if run["round"] == 2 or run["contender"] == "project_bf16@head":
            continue  # a run from before these were kept
        peer = run["contender"] == "llamacpp_bf16"
        run["to_first_tokens_s"] = run["start_s"] + 0.5
        held = 0.5 + 0.25 * run["round"] if peer else 0.0
        run["page_cache_before_load"] = {"files": {"w": held}, "fraction": held}
        if not peer and run["round"] == 1:  # a hit: the mapped cache file's share counts
            run["project_stats"] = {"weights_cache": "hit", "weights_page_cache_frac": 1.0}
    summary = peer_summary.summarize(data)
    ours, peer = summary["tiny/project_bf16"], summary["tiny/llamacpp_bf16"]
    assert ours["to_first_tokens_s"]["all"] == [1.5, 2.5]
    assert ours["page_cache_frac"]["all"] == [0.0, 1.0]
    assert peer["page_cache_frac"]["all"] == [0.5, 0.75]
    assert summary["tiny/project_bf16@head"]["page_cache_frac"] is None
    text = peer_summary.markdown(data, summary, [], {})
    assert "| tiny | project_bf16 | 2.00 | 2.00 | 0%, 100% |" in text
    assert "| tiny | project_bf16@head | 2.00 | - | - |" in text


def test_untimed_batches_have_no_stats_and_say_why(data):
    data["runs"].append(_run("llamacpp_q8_0", 0, {1: 1.0}, timed=False))
    summary = peer_summary.summarize(data)
    q8 = summary["tiny/llamacpp_q8_0"]["batches"]["1"]
    assert q8["stats"] is None and q8["checks"][0]["why_not_timed"] == "tokens differ"
    assert peer_summary.median_step(summary, "tiny", "llamacpp_q8_0", 1) is None
    assert "| tiny | llamacpp_q8_0 | 1 | - | - | - | 0 | = ref |" in peer_summary.markdown(
        data, summary, [], {}
    )


def test_the_floor_uses_the_best_bandwidth_seen_in_the_run(data):
    summary = peer_summary.summarize(data)
    fl = peer_summary.floors(summary, data, ["tiny"])["tiny"]
    # llama.cpp's best round streamed 80 MB in 2.7 ms = 29.6 GB/s; ours 80 MB in 2.0 ms = 40
    assert fl["contender_best_gb_s"]["project_bf16"] == pytest.approx(40.0)
    assert fl["contender_best_gb_s"]["llamacpp_bf16"] == pytest.approx(80e6 / 2.7e-3 / 1e9)
    assert fl["best_gb_s"] == pytest.approx(40.0) and fl["probe_is_best"]
    assert fl["floor_ms"]["bf16"] == pytest.approx(2.0)
    data["probes"] = [{"best_gb_s": 30.0}]
    fl = peer_summary.floors(summary, data, ["tiny"])["tiny"]
    assert not fl["probe_is_best"] and fl["best_gb_s"] == pytest.approx(40.0)
    text = peer_summary.markdown(data, summary, [], {"tiny": fl})
    assert "the probe is below a contender's rate" in text
    assert "left out: ct2_int8: ctranslate2 is not installed" in text
