"""Soak: requests with random prompt lengths and max tokens arrive over time through the
step API, with a KV budget far below what they need together.  Every request finishes with
the greedy tokens it gets alone, no block leaks, and the scheduler had to preempt."""

import random

import pytest
import torch

from framework import LLM, SamplingParams
from framework.engine.kv_cache import KVCacheSpec
from models.config import ModelConfig

BLOCK = 4
MAX_LEN = 64


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny steps: one intra-op thread avoids OpenMP barrier spinning, which on
    a shared 2-core machine made each step ~25x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def workload(n: int, seed: int, vocab: int):
    g = random.Random(seed)
    prefixes = [[g.randrange(vocab) for _ in range(g.randint(8, 24))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        max_tokens = g.randint(1, 24)
        length = g.randint(1, MAX_LEN - max_tokens)
        prompt = [g.randrange(vocab) for _ in range(length)]
        if g.random() < 0.5:  # half share a common prefix
            prompt = (g.choice(prefixes) + prompt)[:length]
        reqs.append((prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=g.random() < 0.7)))
    return reqs


def engine(path, blocks: int, caching: bool, **kw) -> LLM:
    mc = ModelConfig.from_hf_dir(str(path))
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, BLOCK)
    return LLM(
        str(path),
        optimization_level=0,
        max_num_seqs=8,
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        kv_cache_memory_bytes=blocks * spec.bytes_per_block,
        enable_prefix_caching=caching,
        **kw,
    )


def alone(path, reqs) -> list[list[int]]:
    llm = LLM(
        str(path), optimization_level=0, max_num_seqs=1, max_model_len=MAX_LEN, block_size=BLOCK
    )
    return [llm.generate([p], sampling_params=sp)[0] for p, sp in reqs]


def soak(llm: LLM, reqs, seed: int) -> dict[int, list[int]]:
    g = random.Random(seed)
    pending = list(enumerate(reqs))
    ids, done = {}, {}
    steps = 0
    while pending or llm.has_unfinished():
        for _ in range(g.choice([0, 0, 1, 1, 2, 3])):  # arrivals over time
            if pending:
                i, (p, sp) = pending.pop(0)
                ids[llm.add_request(p, sp)] = i
        for out in llm.step():
            assert out.finished and out.request_id not in done
            done[out.request_id] = out.token_ids
        steps += 1
        if steps % 25 == 0:
            llm.block_manager.check()
        assert steps < 20 * len(reqs), "the engine stopped making progress"
    return {ids[rid]: toks for rid, toks in done.items()}


_ALONE: dict = {}


def run_soak(path, n: int, blocks: int, caching: bool, seed: int = 0):
    vocab = ModelConfig.from_hf_dir(str(path)).vocab_size
    reqs = workload(n, seed, vocab)
    key = (str(path), n, seed)
    if key not in _ALONE:  # shared by the with / without prefix caching runs
        _ALONE[key] = alone(path, reqs)
    expected = _ALONE[key]
    llm = engine(path, blocks, caching)
    got = soak(llm, reqs, seed)
    assert len(got) == n
    assert [got[i] for i in range(n)] == expected
    s = llm.stats
    assert s["kv_blocks_free"] == s["kv_blocks_total"] == blocks - 1
    llm.block_manager.check()
    assert s["preemptions"] > 0 and s["finished_requests"] == n
    if caching:
        assert s["prefix_cache_hit_tokens"] > 0
    return s


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix_caching"])
def test_soak_200_requests_under_kv_pressure(llama_checkpoint, caching):
    # 8 running requests may need 8 x 16 blocks; the cache holds 23.
    run_soak(llama_checkpoint, 200, blocks=24, caching=caching)


@pytest.mark.slow(reason="1000 requests on the 4 families: minutes on CPU")
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix_caching"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_soak_1000_requests_every_family(tiny_checkpoint, family, caching):
    run_soak(tiny_checkpoint(family), 1000, blocks=20, caching=caching, seed=1)
