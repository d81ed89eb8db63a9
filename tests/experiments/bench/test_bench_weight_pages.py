"""The weight-placement bench: one engine's packed weights swapped between placements in one
process, alternated, the same tokens from each; the slab placement puts every streamed weight
in advised 2 MB pages, where the per-tensor one leaves the tiny model's weights in 4 KB."""

from __future__ import annotations

import sys

import pytest

from experiments.bench import weight_pages
from framework.core import huge_pages as hp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and THP")
def test_placements_alternate_with_the_same_tokens(llama_checkpoint, compile_cache_dir, capsys):
    out = weight_pages.main(
        ["--model-dir", str(llama_checkpoint), "--cache-dir", compile_cache_dir]
        + ["--variants", "as_loaded", "anon_4k", "anon_2m", "anon_slabs"]
        + ["--rounds", "2", "--steps", "3", "--prompt-len", "4", "--threads", "1"]
    )
    rows = out["variants"]
    assert out["tokens_equal"] and set(rows) == {"as_loaded", "anon_4k", "anon_2m", "anon_slabs"}
    assert all(len(r["all_ms"]) == 2 and r["median_ms"] > 0 for r in rows.values())
    assert rows["anon_4k"]["anon_huge_gb"] == 0
    if hp.thp_mode() == "madvise":  # ("always" gives torch's heap huge pages too)
        # the test model's weights are all under 2 MB: per tensor, none is placed huge; in
        # slabs every one is (whether the kernel had free 2 MB blocks is the machine's: any)
        assert rows["anon_2m"]["anon_huge_gb"] == 0
    if hp.thp_mode() in ("madvise", "always"):
        assert rows["anon_slabs"]["anon_huge_gb"] > 0
    assert "| anon_slabs |" in capsys.readouterr().out
