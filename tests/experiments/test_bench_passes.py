"""Smoke test of the pass/quantization side-by-side benchmark on the tiny test model."""
from experiments import bench_passes


def test_round_robin_table(monkeypatch, compile_cache_dir, capsys):
    monkeypatch.setattr(bench_passes, "VARIANTS", {
        "O2 (bf16)": {}, "O2 + int8_per_channel_weight_only": {
            "quant": "int8_per_channel_weight_only"}})
    bench_passes.main(["--preset", "test-llama", "--dtype", "float32", "--rounds", "2",
                       "--new-tokens", "4", "--prompt-len", "8",
                       "--cache-dir", compile_cache_dir])
    out = capsys.readouterr().out
    assert "| O2 (bf16) |" in out and "1.00x" in out
    assert "int8_per_channel_weight_only" in out
