"""Smoke test of the pass/quantization side-by-side benchmark on the tiny test model: the
table has one row per variant with a positive time and a ratio consistent with the times."""

import re

from experiments.bench import pass_variants as bench_passes


def test_round_robin_table(monkeypatch, compile_cache_dir, capsys):
    monkeypatch.setattr(
        bench_passes,
        "VARIANTS",
        {
            "O2 (bf16)": {},
            "O2 + int8_per_channel_weight_only": {"quant": "int8_per_channel_weight_only"},
        },
    )
    bench_passes.main(
        [
            "--preset",
            "test-llama",
            "--dtype",
            "float32",
            "--rounds",
            "2",
            "--new-tokens",
            "4",
            "--prompt-len",
            "8",
            "--cache-dir",
            compile_cache_dir,
        ]
    )
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    assert [name for name, _, _ in rows] == ["O2 (bf16)", "O2 + int8_per_channel_weight_only"]
    (_, base_ms, _), (_, quant_ms, ratio) = rows
    assert float(base_ms) > 0 and float(quant_ms) > 0
    # "vs first" is the first variant's time over this one's: consistent with the printed
    # times up to their rounding (0.005 ms) and its own (0.005)
    b, q, r = float(base_ms), float(quant_ms), float(ratio)
    assert (b - 0.005) / (q + 0.005) - 0.005 <= r <= (b + 0.005) / max(q - 0.005, 1e-9) + 0.005
