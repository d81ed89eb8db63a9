"""The huge-page allocator: a tensor of its own mapping, 2 MB aligned, backed by huge pages
where the kernel gives them (``/proc/self/smaps``), unmapped when the tensor is freed; and
normal torch memory, with one log line, where transparent huge pages are off."""

from __future__ import annotations

import gc
import logging
import sys

import pytest
import torch

from framework.core import huge_pages as hp

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and THP")
MB = 1 << 20


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(f) == "madvise"
    f.write_text("always madvise [never]\n")
    assert hp.thp_mode(f) == "never"
    assert hp.thp_mode(tmp_path / "absent") is None


@linux
def test_large_tensor_is_huge_page_aligned_and_in_its_own_advised_mapping():
    alloc = hp.HugePageAllocator(mode="madvise")
    t = alloc.empty((3, 1024, 1024), torch.bfloat16)  # 6 MB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hp.HUGE_PAGE == 0
    assert alloc.huge_bytes == 6 * MB and alloc.plain_bytes == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()
    backing = hp.page_backing(t)
    assert backing.rss >= 6 * MB  # the mapping holds the tensor, touched
    assert backing.advised >= 1  # its 2 MB blocks' mapping carries MADV_HUGEPAGE ("hg")
    if hp.thp_mode() in ("madvise", "always"):
        # Whether the kernel had a free 2 MB block is the machine's; 3 advised blocks and
        # none huge would mean the advice did not reach the kernel.
        assert backing.anon_huge >= hp.HUGE_PAGE, backing


@linux
def test_the_mapping_is_freed_with_the_last_tensor_using_it():
    alloc = hp.HugePageAllocator(mode="madvise")
    t = alloc.empty((4 * MB,), torch.uint8)
    view = t[MB:]
    address = t.data_ptr()
    t.fill_(7)
    assert mapped(address)
    del t
    gc.collect()
    assert mapped(address)  # the view still holds it
    assert int(view[-1]) == 7
    del view
    gc.collect()
    assert not mapped(address)


def test_copy_and_place_keep_values():
    alloc = hp.HugePageAllocator(mode="madvise")
    src = torch.randn(512, 2048).to(torch.bfloat16)  # 2 MB
    out = alloc.copy(src)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    placed = alloc.place(src)
    assert placed is not src and torch.equal(placed, src)
    small = torch.randn(16, 16)
    assert alloc.place(small) is small  # under min_bytes: stays where it is


def test_never_fails_closed_to_torch_memory_with_one_log_line(caplog, monkeypatch):
    # What the allocator itself does: no mapping of its own and no madvise at all.  (Whether
    # the pages torch's allocator hands out lie in some earlier-advised mapping of this
    # process is malloc's and the kernel's business, not this allocator's.)
    calls = []
    monkeypatch.setattr(hp, "fresh_mapping", lambda *a: calls.append(("map", a)))
    monkeypatch.setattr(hp, "madvise", lambda *a: calls.append(("madvise", a)))
    alloc = hp.HugePageAllocator(mode="never")
    src = torch.randn(1024, 1024)  # 4 MB
    with caplog.at_level(logging.INFO, logger=hp.__name__):
        t = alloc.empty((1024, 1024), torch.float32)
        u = alloc.empty((2048, 1024), torch.float32)
        placed = alloc.place(src)
    assert placed is src  # no pointless copy
    assert t.shape == (1024, 1024) and u.shape == (2048, 1024)
    assert alloc.huge_bytes == 0 and alloc.plain_bytes == 12 * MB
    assert calls == []
    lines = [r.getMessage() for r in caplog.records if r.name == hp.__name__]
    assert len(lines) == 1 and "never" in lines[0] and "normal pages" in lines[0]


def test_unknown_mode_fails_closed():
    alloc = hp.HugePageAllocator(mode=None)
    assert not alloc.enabled
    t = alloc.empty((4 * MB,), torch.uint8)
    assert t.numel() == 4 * MB and alloc.plain_bytes == 4 * MB


@linux
def test_refused_mapping_fails_closed(monkeypatch, caplog):
    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hp.mmap, "mmap", refuse)
    alloc = hp.HugePageAllocator(mode="madvise")
    with caplog.at_level(logging.INFO, logger=hp.__name__):
        t = alloc.empty((4 * MB,), torch.uint8)
    assert t.numel() == 4 * MB and alloc.failures == 1 and alloc.plain_bytes == 4 * MB
    assert any("refused" in r.getMessage() for r in caplog.records)


@linux
def test_weight_slabs_share_advised_huge_page_mappings():
    """``for_weights``: small tensors and the tails of large ones share slabs, each wholly
    advised MADV_HUGEPAGE; a tensor larger than a slab gets one of its own size (rounded up to
    2 MB) whose rest later tensors use; nothing is 2 MB aligned per tensor any more."""
    alloc = hp.HugePageAllocator.for_weights(mode="madvise", slab_bytes=4 * MB)
    assert alloc.min_bytes == hp.SLAB_ALIGN
    small = [alloc.empty((n,), torch.uint8) for n in (MB, MB // 2 + 5, 16 << 10)]
    starts = [t.data_ptr() for t in small]
    assert starts[1] == starts[0] + MB  # one after another ...
    assert starts[2] == starts[1] + MB // 2 + hp.SLAB_ALIGN  # ... at small-page boundaries
    assert all(s % hp.SLAB_ALIGN == 0 for s in starts) and alloc.slabs == 1
    big = alloc.empty((5 * MB,), torch.uint8)  # over the slab size: a slab of 6 MB
    assert alloc.slabs == 2 and big.data_ptr() % hp.HUGE_PAGE == 0
    after = alloc.empty((3 * MB,), torch.uint8)  # fits neither slab's rest: a new one
    tail = alloc.empty((MB // 2,), torch.uint8)  # fits the first slab's rest
    assert alloc.slabs == 3 and tail.data_ptr() > starts[2] and tail.data_ptr() < starts[0] + 4 * MB
    assert alloc.huge_bytes == MB + MB // 2 + 5 + (16 << 10) + 5 * MB + 3 * MB + MB // 2
    tiny = alloc.empty((100,), torch.uint8)  # under a small page: torch's allocator
    assert alloc.plain_bytes == 100 and tiny.numel() == 100
    for i, t in enumerate(small + [big, after, tail]):
        t.fill_(i + 1)
    for i, t in enumerate(small + [big, after, tail]):  # no overlap
        assert int(t.min()) == int(t.max()) == i + 1
    backing = hp.page_backing(small[0])
    assert backing.mappings == 1 and backing.advised == 1 and backing.size >= 4 * MB
    if hp.thp_mode() in ("madvise", "always"):
        assert backing.anon_huge >= hp.HUGE_PAGE, backing  # the 16 KB tensor's page too
    placed = alloc.place(torch.full((3000,), 2.5))
    assert placed.dtype == torch.float32 and bool((placed == 2.5).all())
    assert placed.data_ptr() % hp.SLAB_ALIGN == 0


@linux
def test_a_slab_is_freed_with_its_allocator_and_last_tensor():
    alloc = hp.HugePageAllocator.for_weights(mode="madvise", slab_bytes=2 * MB)
    t = alloc.empty((MB,), torch.uint8)
    address = t.data_ptr()
    t.fill_(3)
    del alloc
    gc.collect()
    assert mapped(address) and int(t[-1]) == 3  # the tensor holds it
    del t
    gc.collect()
    assert not mapped(address)
