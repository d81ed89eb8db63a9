"""End to end with the fused CPU attention backend: fp32 greedy tokens equal the O0 run on the
plain-torch reference backend, for all four families, batched with chunked prefill and mixed
prefill+decode steps, and through a compiled (O2) model."""

import pytest

from framework import LLM

PROMPTS = [[3, 17, 42, 9, 100, 7, 64, 5, 11], [8, 1, 250], [77, 12, 5, 90, 31, 2]]
NEW_TOKENS = 12


def generate(path, backend, level=0, **kw):
    llm = LLM(
        str(path),
        optimization_level=level,
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=5,
        attention_backend=backend,
        **kw,
    )
    assert llm.runner.attention_backend == backend
    out = llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert llm.stats.get("mixed_steps", 0) > 0
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fp32_tokens_equal_the_reference_backend_at_o0(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    assert generate(path, "cpu_paged") == generate(path, "torch")


def test_compiled_model_with_cpu_paged_equals_o0(tiny_checkpoint, compile_cache_dir):
    path = tiny_checkpoint("llama")
    assert generate(path, "cpu_paged", level=2, cache_dir=compile_cache_dir) == generate(
        path, "torch"
    )
