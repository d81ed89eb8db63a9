"""experiments/bench/warm_start.py: with ``--evict`` (the files a warm start reads dropped from
the page cache) the warm start reports that it found its mapped weights on disk."""

from __future__ import annotations

import sys

import pytest

from experiments.bench import warm_start

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page cache")


@pytest.mark.slow
def test_an_evicted_warm_start_finds_its_weights_on_disk(capsys):
    got = warm_start.main(["--warm-only", "--rounds", "1", "--evict"])
    out = capsys.readouterr().out
    assert got["trees"] and all(t["evicted"] for t in got["trees"].values())
    if "the page cache kept" in out:
        pytest.skip("this filesystem keeps pages after DONTNEED")
    assert "[weights cache: hit, 0% in the page cache]" in out, out
