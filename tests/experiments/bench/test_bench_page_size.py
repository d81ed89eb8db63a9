"""The page-size A/B (experiments/bench/page_size.py): memory advised MADV_HUGEPAGE before its
first touch is in huge pages, MADV_NOHUGEPAGE memory is not, and a step runs every linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.bench import page_size as bps
from framework.core import huge_pages as hp

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.is_file() or "[never]" in THP.read_text(), reason="no transparent huge pages"
)
def test_advice_before_first_touch_decides_the_page_size():
    # After other tests freed large tensors, torch's allocator would hand back pages already
    # faulted in (malloc's heap), whose page size no advice changes: each arena is a mapping of
    # its own.  Touching and dropping 24 MB tensors first makes that case happen here (glibc
    # raises its mmap threshold on the first free, so the next ones come from the heap).
    for _ in range(3):
        torch.empty(24 << 20, dtype=torch.uint8).fill_(0)
    huge = bps.arena(16 << 20, True)
    small = bps.arena(16 << 20, False)
    assert huge.data_ptr() % hp.HUGE_PAGE == 0
    assert hp.page_backing(huge).advised == 1 and hp.page_backing(small).advised == 0
    huge.fill_(1)
    small.fill_(1)
    assert bps.huge_bytes_in(huge) >= 8 << 20  # most of it (the kernel may split a page)
    assert bps.huge_bytes_in(small) == 0


def test_a_step_runs_every_packed_linear(monkeypatch):
    from passes import small_m_linear as sm

    if not sm.kernel_available():
        pytest.skip("small-M kernel unavailable")
    monkeypatch.setattr(bps, "SHAPES_1P1B", (("a", 64, 128), ("b", 128, 64)))
    calls = []
    real = sm.run_packed
    monkeypatch.setattr(sm, "run_packed", lambda x, w, b, n: calls.append(n) or real(x, w, b, n))
    weights, info = bps.build(2, huge=False)
    assert info["bytes"] == sum(w.numel() * 2 for w, _ in weights)
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in (64, 128, 2048)}
    assert bps.step(weights, xs) > 0
    assert calls == [64, 128, 64, 128, 32000]
