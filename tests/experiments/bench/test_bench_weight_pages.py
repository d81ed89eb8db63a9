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
    if hp.thp_mode() in ("madvise", "always"):
        # the test model's weights are all under 2 MB: per tensor, the allocator places none in
        # huge-page memory (they stay in torch's heap, whose mappings' pages are the process's,
        # not the bench's: smaps figures for them are not asserted); in slabs it places every
        # one, and their own mappings hold huge pages (how many is the kernel's: some)
        assert rows["anon_2m"]["placed_huge_gb"] == 0
        assert rows["anon_slabs"]["placed_huge_gb"] == pytest.approx(out["bytes"] / 1e9)
        assert rows["anon_slabs"]["anon_huge_gb"] > 0
    assert "| anon_slabs |" in capsys.readouterr().out
