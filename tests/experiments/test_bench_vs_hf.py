"""Smoke tests of the side-by-side benchmark harness (experiments/bench_vs_hf.py) on the
2-layer test checkpoint; the compiled contenders and the startup subprocesses are slow."""

from __future__ import annotations

import json

import pytest

from experiments import bench_vs_hf as bvh


def _run(tmp_path, ckpt, *extra):
    out = tmp_path / "bench.json"
    result = bvh.main(
        [
            "--model-dir",
            str(ckpt),
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--rounds",
            "2",
            "--prompt-len",
            "8",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert json.loads(out.read_text())["latency"] == result["latency"]
    return result


def test_eager_contenders_agree_and_report(tmp_path, llama_checkpoint):
    result = _run(
        tmp_path,
        llama_checkpoint,
        "--contenders",
        "hf_eager",
        "O0",
        "--dtypes",
        "float32",
        "--batches",
        "1",
        "2",
        "--skip-startup",
    )
    rows = result["latency"]
    assert [(r["batch"], r["contender"]) for r in rows] == [
        (1, "hf_eager"),
        (1, "O0"),
        (2, "hf_eager"),
        (2, "O0"),
    ]
    for r in rows:
        # 2 rounds x (3 steps - 1 warm-up step) kept per contender
        assert r["samples"] == 4 and 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert len(r["tokens"]) == r["batch"] and all(len(t) == 4 for t in r["tokens"])
        # fp32: the project's loader + model must produce transformers' greedy tokens
        assert r["token_agreement"] == 1.0 and r["tokens_stable_across_rounds"]
    assert "fp32 greedy-token agreement: all contenders agree" in result["markdown"]
    assert result["startup"] == [] and result["targets"] == []


def test_targets_are_ratios_of_one_run():
    lat = [
        {"dtype": "bfloat16", "batch": 1, "contender": c, "median_ms": ms}
        for c, ms in [("hf_eager", 12.0), ("hf_compile", 8.0), ("hf_static", 6.0), ("O2", 4.0)]
    ]
    startup = [
        {"dtype": "bfloat16", "contender": "hf_compile", "cold_s": 30.0},
        {"dtype": "bfloat16", "contender": "O2", "cold_s": 12.0, "warm_s": 0.5},
    ]
    got = {t["target"]: (round(t["got"], 4), t["met"]) for t in bvh.targets(lat, startup)}
    assert got == {
        "O2 bf16 b1 decode speed-up vs (b) torch.compile(hf, dynamic)": (2.0, True),
        "O2 bf16 b1 decode speed-up vs (c) StaticCache+compile+freezing": (1.5, True),
        "O2 bf16 b1 decode speed-up vs (a) transformers eager": (3.0, True),
        "O2 cold compile / (b) cold compile (bf16)": (0.4, False),
        "O2 warm start / O2 cold compile (bf16)": (round(0.5 / 12, 4), True),
    }


def test_agreement_and_percentile():
    assert bvh.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 0], [4, 5, 6]]) == 5 / 6
    assert bvh.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.9) == 5.0
    assert bvh.percentile([1.0, 2.0], 0.0) == 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be positive"),
        (["--steps", "4", "--warmup-steps", "4"], "--warmup-steps must be in"),
        (["--batches", "0"], "--batches must be positive"),
        (["--threads", "0"], "--threads must be positive"),
    ],
)
def test_bad_flags_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        bvh.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_all_contenders_with_startup(tmp_path, llama_checkpoint):
    result = _run(
        tmp_path, llama_checkpoint, "--dtypes", "float32", "--batches", "1", "--threads", "1"
    )
    rows = {r["contender"]: r for r in result["latency"]}
    assert set(rows) == set(bvh.ALL_CONTENDERS)
    assert all(r["token_agreement"] == 1.0 for r in rows.values()), {
        c: r["token_agreement"] for c, r in rows.items()
    }
    startup = {r["contender"]: r for r in result["startup"]}
    assert set(startup) == set(bvh.COLD_CONTENDERS)
    o2 = startup["O2"]
    assert o2["cold"]["compiles"] > 0 and o2["cold"]["cache_hits"] == 0
    assert o2["warm"]["compiles"] == 0 and o2["warm"]["loads"] > 0
    assert o2["warm"]["dynamo_skipped"] is True
    assert "warm_s" in startup["hf_compile"] and "warm_s" not in startup["hf_static"]
