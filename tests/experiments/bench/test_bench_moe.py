"""experiments.bench.moe end to end on the tiny Qwen3-MoE (bf16): every row, the kernel rows
and the active-weight floor are produced; O2 and transformers eager agree on the tokens."""

import pytest

from experiments.bench import moe as bench_moe


@pytest.mark.slow  # an O2 compile of the tiny MoE (~30 s here)
def test_bench_moe_runs_and_reports(tmp_path):
    out = tmp_path / "moe.json"
    result = bench_moe.main(
        [
            "--preset",
            "test-qwen3_moe",
            "--contenders",
            "hf_eager",
            "O2",
            "--batches",
            "1",
            "--rounds",
            "1",
            "--steps",
            "4",
            "--warmup-steps",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert out.is_file()
    assert {r["contender"] for r in result["rows"]} == {"hf_eager", "O2"}
    assert [r["tokens"] for r in result["kernel_rows"]] == [1, 8, 2048]
    w = result["active_weight_bytes"]
    assert 0 < w["top_k_experts"] < w["total"] and result["floor_ms"] > 0
    assert result["o2_b1_over_floor"] > 0
    assert "active weights per b1 step" in bench_moe.markdown(result)
