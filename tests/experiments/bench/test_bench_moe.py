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
            "O2_python_moe",
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
    assert {r["contender"] for r in result["rows"]} == {"hf_eager", "O2", "O2_python_moe"}
    assert [r["tokens"] for r in result["kernel_rows"]] == [1, 8, 2048]
    # the C++ MoE kernel and its Python body: the same bits, alone and in the model
    assert all(r["op_equals_python_body"] for r in result["kernel_rows"][:2])
    by = {r["contender"]: r for r in result["rows"]}
    assert by["O2_python_moe"]["token_agreement"] == by["O2"]["token_agreement"]
    # the floor's bandwidth: the native probe or a contender, never below the probe
    probes = result["bandwidth_probes_gb_s"]
    assert "native_read_probe" in probes and "torch_sum" not in probes
    assert result["bandwidth_gb_s"] == max(probes.values())
    w = result["active_weight_bytes"]
    assert 0 < w["top_k_experts"] < w["total"] and result["floor_ms"] > 0
    assert result["o2_b1_over_floor"] > 0
    assert "active weights per b1 step" in bench_moe.markdown(result)
