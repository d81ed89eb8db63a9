"""Prefix caching: hash-chained full blocks shared by reference count, an LRU of
unreferenced blocks evicted only under pressure, and identical tokens with and without."""

import random

import pytest
import torch

from framework import LLM
from framework.engine.block_manager import BlockManager, chain_hashes
from framework.engine.kv_cache import KVCacheSpec
from models.config import ModelConfig

BLOCK = 16


def rand_tokens(n, seed, vocab=256):
    g = random.Random(seed)
    return [g.randrange(vocab) for _ in range(n)]


def make(path, caching, blocks=None, **kw):
    if blocks is not None:
        mc = ModelConfig.from_hf_dir(str(path))
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, BLOCK)
        kw["kv_cache_memory_bytes"] = blocks * spec.bytes_per_block
    kw.setdefault("max_model_len", 160)
    return LLM(str(path), optimization_level=0, max_num_seqs=4, enable_prefix_caching=caching, **kw)


# ---------------------------------------------------------------------- block manager
def test_hash_chain_depends_on_the_whole_prefix():
    a = chain_hashes(list(range(48)), 16)
    b = chain_hashes([99] + list(range(1, 48)), 16)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # block 0 differs: all do
    assert chain_hashes(list(range(40)), 16) == a[:2]  # partial block: no hash


def test_block_manager_shares_caches_and_evicts_lru_first():
    bm = BlockManager(6, 16, enable_prefix_caching=True)
    h11, h12, h13, h14 = (bytes([i]) for i in (11, 12, 13, 14))
    blocks = bm.allocate(3)
    for b, h in zip(blocks, (h11, h12, h13)):
        bm.register(b, h)
    assert bm.lookup([h11, h12, h13, h14]) == blocks
    bm.take(blocks[:2])
    assert bm.ref_count(blocks[0]) == 2
    bm.free(blocks)  # request 1 done: block 3 goes to the LRU
    assert bm.num_free == 3 and bm.lookup([h11, h12, h13]) == blocks
    bm.free(blocks[:2])  # request 2 done: all cached, all free
    assert bm.num_free == 5 and bm.num_cached == 3
    bm.check()
    got = bm.allocate(3)  # 2 from the free list, then the LRU's oldest
    assert bm.stats.evictions == 1 and blocks[2] in got
    assert bm.lookup([h11, h12, h13]) == blocks[:2]
    bm.free(got)
    bm.check()
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free([got[0]])


# ---------------------------------------------------------------------- engine
def test_hits_on_a_shared_prefix_and_none_across_prefixes(llama_checkpoint):
    prefix = rand_tokens(40, 0)
    p1, p2 = prefix + rand_tokens(7, 1), prefix + rand_tokens(9, 2)
    other = rand_tokens(40, 3) + rand_tokens(7, 1)
    cached, plain = make(llama_checkpoint, True), make(llama_checkpoint, False)
    want = [plain.generate([p], 8, ignore_eos=True)[0] for p in (p1, p2, other)]
    assert cached.generate([p1], 8, ignore_eos=True)[0] == want[0]
    assert cached.stats["prefix_cache_hit_tokens"] == 0
    assert cached.generate([p2], 8, ignore_eos=True)[0] == want[1]
    s = cached.stats
    assert s["prefix_cache_hit_tokens"] == 32  # two full blocks of the prefix
    assert s["prefix_cache_queried_tokens"] == len(p1) + len(p2)
    assert cached.generate([other], 8, ignore_eos=True)[0] == want[2]
    assert cached.stats["prefix_cache_hit_tokens"] == 32  # a different prefix: no hit
    assert cached.block_manager.num_free == cached.block_manager.num_usable
    cached.block_manager.check()


def test_fully_cached_prompt_recomputes_its_last_token(llama_checkpoint):
    p = rand_tokens(48, 4)  # exactly 3 blocks
    cached, plain = make(llama_checkpoint, True), make(llama_checkpoint, False)
    want = plain.generate([p], 6, ignore_eos=True)[0]
    assert cached.generate([p], 6, ignore_eos=True)[0] == want
    assert cached.generate([p], 6, ignore_eos=True)[0] == want
    assert cached.stats["prefix_cache_hit_tokens"] == 32  # 2 of 3 blocks: one token left


def test_partial_hit_with_chunked_prefill(llama_checkpoint):
    """A cached prompt starts its prefill mid-sequence, and the rest arrives in chunks
    mixed with other requests' decodes."""
    prefix = rand_tokens(64, 5)
    prompts = [prefix + rand_tokens(30 + i, 10 + i) for i in range(3)]
    plain = make(llama_checkpoint, False, max_num_batched_tokens=12)
    cached = make(llama_checkpoint, True, max_num_batched_tokens=12)
    want = [plain.generate([p], 10, ignore_eos=True)[0] for p in prompts]
    cached.generate([prefix + [1]], 2, ignore_eos=True)
    assert cached.generate(prompts, 10, ignore_eos=True) == want
    assert cached.stats["prefix_cache_hit_tokens"] >= 3 * 64
    assert cached.stats.get("mixed_steps", 0) > 0


def test_eviction_under_pressure(llama_checkpoint):
    a, b = rand_tokens(60, 6), rand_tokens(100, 7)
    plain = make(llama_checkpoint, False)
    want_a, want_b = (plain.generate([p], 12, ignore_eos=True)[0] for p in (a, b))
    llm = make(llama_checkpoint, True, blocks=10)  # 9 usable
    assert llm.generate([a], 12, ignore_eos=True)[0] == want_a
    assert llm.block_manager.num_cached == 4 and llm.stats["prefix_cache_evictions"] == 0
    assert llm.generate([b], 12, ignore_eos=True)[0] == want_b  # needs 8 blocks
    assert llm.stats["prefix_cache_evictions"] > 0
    assert llm.generate([a], 12, ignore_eos=True)[0] == want_a
    assert llm.block_manager.num_free == llm.block_manager.num_usable
    llm.block_manager.check()


def test_preempted_request_reuses_its_own_blocks(llama_checkpoint):
    prompts = [rand_tokens(20, 20 + i) for i in range(4)]
    plain = make(llama_checkpoint, False)
    want = [plain.generate([p], 40, ignore_eos=True)[0] for p in prompts]
    llm = make(llama_checkpoint, True, blocks=12)
    assert llm.generate(prompts, 40, ignore_eos=True) == want
    s = llm.stats
    assert s["preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_identical_tokens_with_and_without_prefix_caching(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    prefix = rand_tokens(35, 8)
    prompts = [prefix + rand_tokens(n, 30 + n) for n in (3, 11, 17, 25)]
    plain, cached = make(path, False), make(path, True)
    want = plain.generate(prompts, 10, ignore_eos=True)
    assert cached.generate(prompts[:1], 10, ignore_eos=True) == want[:1]
    assert cached.generate(prompts, 10, ignore_eos=True) == want
    assert cached.stats["prefix_cache_hit_tokens"] >= 4 * 32
