"""The O2 decode-step variants benchmark (experiments/bench/step_variants.py)."""

from __future__ import annotations

import pytest

from experiments.bench import step_variants as bsv


def test_bad_flags_are_rejected(capsys):
    with pytest.raises(SystemExit):
        bsv.main(["--steps", "2"])
    assert "--steps >= 3" in capsys.readouterr().err


@pytest.mark.slow  # two Inductor compiles of the 2-layer model
def test_unsplit_variant_gives_o2_tokens(llama_checkpoint, compile_cache_dir, capsys):
    rows = bsv.main(
        [
            "--model-dir",
            str(llama_checkpoint),
            "--dtype",
            "float32",
            "--variants",
            "O2",
            "O2-unsplit",
            "--steps",
            "4",
            "--rounds",
            "1",
            "--prompt-len",
            "8",
            "--cache-dir",
            str(compile_cache_dir),
        ]
    )
    assert [r["variant"] for r in rows] == ["O2", "O2-unsplit"]
    assert all(r["tokens_equal_first"] and 0 < r["min_ms"] <= r["median_ms"] for r in rows)
    assert "| O2-unsplit |" in capsys.readouterr().out
