"""Smoke tests of the side-by-side benchmark harness (experiments/bench/vs_hf.py) on the
2-layer test checkpoint; the compiled contenders and the startup subprocesses are slow."""

from __future__ import annotations

import json

import pytest

from experiments.bench import targets as bench_targets
from experiments.bench import vs_hf as bvh


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
            "--generate-tokens",
            "11",
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
        "--long-batch",
        "3",
        "--long-prompt-len",
        "20",
        "--skip-startup",
        "--skip-attention",
    )
    rows = result["latency"]
    assert [(r["batch"], r["prompt_len"], r["contender"]) for r in rows] == [
        (1, 8, "hf_eager"),
        (1, 8, "O0"),
        (2, 8, "hf_eager"),
        (2, 8, "O0"),
        (3, 20, "hf_eager"),
        (3, 20, "O0"),
    ]
    for r in rows:
        # 2 rounds x (3 steps - 1 warm-up step) kept per contender
        assert r["samples"] == 4 and 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert len(r["tokens"]) == r["batch"] and all(len(t) == 4 for t in r["tokens"])
        # fp32: the project's loader + model must produce transformers' greedy tokens
        assert r["token_agreement"] == 1.0 and r["tokens_stable_across_rounds"]
    assert "fp32 greedy-token agreement: all contenders agree" in result["markdown"]
    # per generated token through LLM.generate: the project's contenders only, 2 rounds
    (pt,) = result["per_token"]
    assert pt["contender"] == "O0" and pt["new_tokens"] == [8, 11]
    assert len(pt["per_token_ms_all"]) == 2 and pt["per_token_ms"] > 0
    assert "per generated token through LLM.generate" in result["markdown"]
    assert result["startup"] == [] and result["targets"] == [] and result["attention"] == []


def test_targets_are_ratios_of_one_run():
    def row(c, batch, plen, ms):
        return {"dtype": "bfloat16", "batch": batch, "prompt_len": plen, "contender": c,
                "median_ms": ms}  # fmt: skip

    lat = [
        row(c, 1, 64, ms)
        for c, ms in [("hf_eager", 12.0), ("hf_compile", 8.0), ("hf_static", 6.0), ("O2", 4.0)]
    ]
    lat += [row("hf_static", 8, 64, 7.0), row("O2", 8, 64, 5.0)]
    lat += [row("hf_static", 32, 400, 80.0), row("O2", 32, 400, 30.0)]
    startup = [
        {"dtype": "bfloat16", "contender": "hf_compile", "cold_s": 30.0},
        {
            "dtype": "bfloat16",
            "contender": "O2",
            "cold_s": 12.0,
            "warm_s": 0.5,
            "warm": {"after_torch_s": 0.9},
        },
    ]
    per_token = [
        {"dtype": "bfloat16", "batch": 1, "prompt_len": 64, "contender": "O2", "per_token_ms": 5.0}
    ]
    attention = [
        {"case": "decode b1 ctx 80", "cpu_paged_us": 20.0, "kv_read_frac": 0.1},
        {"case": "decode b1 ctx 128", "cpu_paged_us": 31.0, "kv_read_frac": 0.1},
        {"case": "decode b1 ctx 4096", "cpu_paged_us": 300.0, "kv_read_frac": 0.6},
    ]
    floor = {"floor_ms": 2.0, "prompt_len": 64}
    got = {
        t["target"]: (round(t["got"], 4), t["met"])
        for t in bench_targets.targets(
            lat,
            startup,
            per_token=per_token,
            attention=attention,
            floor=floor,
            long_prompt_len=400,
        )
    }
    assert got == {
        "O2 bf16 b1 decode step speed-up vs (c) StaticCache+compile+freezing": (1.5, True),
        "O2 bf16 b1 decode step speed-up vs (b) torch.compile(hf, dynamic)": (2.0, True),
        "O2 bf16 b8 decode step speed-up vs (c) StaticCache+compile+freezing": (1.4, True),
        "O2 bf16 b32 400-token prompts speed-up vs (c) StaticCache+compile+freezing": (
            round(80 / 30, 4),
            True,
        ),
        "O2 bf16 b1 decode step speed-up vs (a) transformers eager": (3.0, True),
        "O2 bf16 b1 per generated token through LLM.generate vs (c) StaticCache+compile+"
        "freezing's decode step": (1.2, False),
        "O2 bf16 b1 whole decode step / weights' streaming floor": (2.0, False),
        "attention b1 <= 128 tokens of context, per layer call (µs)": (31.0, False),
        "attention 4k context: KV read rate / measured bandwidth": (0.6, True),
        "O2 cold start / (b) cold start (bf16)": (0.4, False),
        "O2 warm LLM(...) in a fresh process after import torch (s)": (0.9, True),
        "O2 warm start / O2 cold start (bf16)": (0.075, False),  # above the 5% target
    }
    lines = bench_targets.markdown(bench_targets.targets(lat, startup))
    assert any("| NOT met |" in ln for ln in lines) and any("| met |" in ln for ln in lines)


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
        (["--generate-tokens", "8"], "--generate-tokens must be > 8"),
        (["--long-batch", "-1"], "--long-batch must be >= 0"),
    ],
)
def test_bad_flags_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        bvh.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_all_contenders_with_startup(tmp_path, llama_checkpoint):
    result = _run(
        tmp_path,
        llama_checkpoint,
        "--dtypes",
        "float32",
        "--batches",
        "1",
        "--threads",
        "1",
        "--long-batch",
        "2",
        "--long-prompt-len",
        "16",
    )
    rows = {r["contender"]: r for r in result["latency"] if r["batch"] == 1}
    assert set(rows) == set(bvh.ALL_CONTENDERS)
    assert {r["contender"] for r in result["per_token"]} == set(bvh.LEVELS)
    assert result["attention"] and result["floor"] is None  # the floor is a bf16 figure
    assert all(r["token_agreement"] == 1.0 for r in rows.values()), {
        c: r["token_agreement"] for c, r in rows.items()
    }
    startup = {r["contender"]: r for r in result["startup"]}
    assert set(startup) == set(bvh.COLD_CONTENDERS)
    o2 = startup["O2"]
    assert o2["cold"]["compiles"] > 0 and o2["cold"]["cache_hits"] == 0
    assert o2["warm"]["compiles"] == 0 and o2["warm"]["loads"] > 0
    assert o2["warm"]["dynamo_skipped"] is True
    assert 0 < o2["warm"]["construct_s"] <= o2["warm"]["after_torch_s"]
    assert "warm_s" in startup["hf_compile"] and "warm_s" not in startup["hf_static"]
