"""KV cache allocation: one zeroed ``[2, blocks, block_size, Hkv, D]`` tensor per layer; on CPU
in huge-page mappings of their own (2 MB aligned, advised), on torch's allocator where huge
pages are off; and an engine's caches are placed that way."""

from __future__ import annotations

import sys

import pytest
import torch

from framework.core import huge_pages as hp
from framework.engine.kv_cache import KVCacheSpec, allocate_kv_caches

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and THP")
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16, block_size=16)
NUM_BLOCKS = 600  # 2 x 600 x 16 x 4 x 64 x 2 B = 9.4 MB a layer


def test_one_zeroed_cache_per_layer_of_the_paged_shape():
    caches = allocate_kv_caches(SPEC, ["a", "b"], NUM_BLOCKS, "cpu")
    assert list(caches) == ["a", "b"]
    for t in caches.values():
        assert t.shape == (2, NUM_BLOCKS, 16, 4, 64) and t.dtype == torch.bfloat16
        assert t.is_contiguous() and not t.any()
    caches["a"][1, 3] = 1.0  # the layers do not share memory
    assert not caches["b"].any()


@linux
def test_cpu_caches_live_in_advised_huge_page_mappings():
    alloc = hp.HugePageAllocator(mode="madvise")
    caches = allocate_kv_caches(SPEC, ["a", "b"], NUM_BLOCKS, "cpu", huge_pages=alloc)
    nbytes = caches["a"].numel() * caches["a"].element_size()
    assert alloc.huge_bytes == 2 * nbytes and alloc.plain_bytes == 0
    for t in caches.values():
        assert t.data_ptr() % hp.HUGE_PAGE == 0
        backing = hp.page_backing(t)
        assert backing.rss >= nbytes  # zeroed: every page touched
        assert backing.advised >= 1
        if hp.thp_mode() in ("madvise", "always"):
            assert backing.anon_huge >= hp.HUGE_PAGE, backing


def test_without_huge_pages_the_caches_come_from_torch():
    alloc = hp.HugePageAllocator(mode="never")
    caches = allocate_kv_caches(SPEC, ["a"], NUM_BLOCKS, "cpu", huge_pages=alloc)
    assert alloc.huge_bytes == 0 and alloc.plain_bytes > 0
    assert not caches["a"].any()


@linux
def test_an_engine_places_its_kv_caches_in_huge_pages(llama_checkpoint):
    if hp.thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {hp.thp_mode()}")
    from framework import LLM

    # a 16 MB budget over the layers: each cache over the huge-page allocator's 2 MB threshold
    llm = LLM(
        str(llama_checkpoint),
        optimization_level=0,
        max_num_seqs=4,
        max_model_len=64,
        kv_cache_memory_bytes=16 << 20,
    )
    caches = list(llm.runner.kv_caches.values())
    assert caches and all(t.numel() * t.element_size() >= hp.HUGE_PAGE for t in caches)
    assert all(t.data_ptr() % hp.HUGE_PAGE == 0 for t in caches)
    assert hp.page_backing(caches).advised >= 1
