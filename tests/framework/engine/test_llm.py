"""End-to-end: greedy generation equals transformers, batched and alone, at every level."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from framework import LLM

PROMPTS = [[3, 17, 42, 9, 100, 7, 64, 5, 11], [8, 1, 250], [77, 12, 5, 90, 31, 2]]
NEW_TOKENS = 12


def hf_greedy(path, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_checkpoint(family)
            cache[family] = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_eager_matches_transformers_batched_and_alone(family, tiny_checkpoint, hf_reference):
    llm = LLM(str(tiny_checkpoint(family)), optimization_level=0, max_num_seqs=4, max_model_len=64)
    expected = hf_reference(family)
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == expected
    for prompt, exp in zip(PROMPTS, expected):
        assert llm.generate([prompt], NEW_TOKENS, ignore_eos=True) == [exp]


@pytest.mark.parametrize(
    "family,level",
    [("llama", 1), ("llama", 2), ("llama", 3), ("qwen2", 2), ("qwen3", 2), ("mistral", 2)],
)
def test_compiled_levels_match_eager(
    family, level, tiny_checkpoint, hf_reference, compile_cache_dir
):
    llm = LLM(
        str(tiny_checkpoint(family)),
        optimization_level=level,
        max_num_seqs=4,
        max_model_len=64,
        cache_dir=compile_cache_dir,
    )
    assert llm.stats["mode"] == "PIECEWISE"
    expected = hf_reference(family)
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == expected
    assert llm.generate([PROMPTS[1]], NEW_TOKENS, ignore_eos=True) == [expected[1]]


def test_chunked_prefill_and_mixed_steps_match(tiny_checkpoint, hf_reference):
    """A token budget smaller than the prompts forces chunked prefill and steps that mix
    prefill chunks with decodes."""
    llm = LLM(
        str(tiny_checkpoint("llama")),
        optimization_level=0,
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=5,
    )
    assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == hf_reference("llama")
    assert llm.stats.get("mixed_steps", 0) > 0


def test_stops_at_eos(tiny_checkpoint, hf_reference):
    llm = LLM(str(tiny_checkpoint("llama")), optimization_level=0, max_model_len=64)
    first = hf_reference("llama")[0]
    llm.model_config.eos_token_id = [first[2]]
    out = llm.generate([PROMPTS[0]], NEW_TOKENS)[0]
    assert out == first[:3]


def test_bad_generate_arguments(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), max_model_len=32)
    with pytest.raises(TypeError, match="list of prompts"):
        llm.generate([1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]])
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([[1] * 30], max_new_tokens=8)
    with pytest.raises(ValueError, match="LLM.max_num_seqs"):
        LLM(str(llama_checkpoint), max_num_seqs=0)
