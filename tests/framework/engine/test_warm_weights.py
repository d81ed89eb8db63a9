"""A warm ``LLM`` maps its processed weights: the second engine on the same checkpoint and
settings finds the processed-weights cache entry the first wrote, its tensors are views of that
file's pages, and its greedy tokens equal the cold engine's and transformers'."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from mapped import file_backed
from paged_harness import hf_greedy
from transformers import AutoModelForCausalLM

from framework import LLM, CompilationConfig

PROMPTS = [[3, 17, 42, 9, 100, 7, 64, 5, 11, 23, 19, 4, 8, 15, 16, 42, 99, 1], [8, 1, 250]]
NEW = 8


def _own_copy(src, dst):
    """A copy of the checkpoint with fresh mtimes (``copytree`` keeps the source's): its own
    processed-weights entry, never one another test wrote for the source."""
    shutil.copytree(src, dst)
    now = time.time_ns()
    for f in dst.iterdir():
        os.utime(f, ns=(now, now))
    return dst


def _llm(path, cache_dir, dtype, quantization=None) -> LLM:
    return LLM(
        str(path),
        dtype=dtype,
        quantization=quantization,
        optimization_level=2,
        max_num_seqs=2,
        max_model_len=64,
        cache_dir=cache_dir,
        compilation_config=CompilationConfig(progress_bar=False),
    )


def _check_warm(ckpt, compile_cache_dir, dtype, quantization=None):
    cold = _llm(ckpt, compile_cache_dir, dtype, quantization)
    assert cold.stats["weights_cache"] == "written"
    want = cold.generate(PROMPTS, NEW, ignore_eos=True)
    warm = _llm(ckpt, compile_cache_dir, dtype, quantization)
    assert warm.stats["weights_cache"] == "hit"
    assert warm.stats["weights_page_cache_frac"] == 1.0  # the cold start just wrote it
    assert "weights_page_cache_frac" not in cold.stats
    assert warm.stats["dynamo_traces"] == 0 and warm.stats["compile_compiles"] == 0
    assert warm.weights_path == cold.weights_path
    tensors = list(warm.model.parameters()) + list(warm.model.buffers())
    assert tensors and all(file_backed(t, warm.weights_path) for t in tensors)
    assert warm.packed_layers == cold.packed_layers
    assert warm.quantized_layers == cold.quantized_layers
    assert warm.packed_layers or warm.quantized_layers
    got = warm.generate(PROMPTS, NEW, ignore_eos=True)
    assert got == want
    return want


def test_warm_llm_maps_weights_and_matches_cold_and_transformers(
    llama_checkpoint, compile_cache_dir, tmp_path
):
    ckpt = _own_copy(llama_checkpoint, tmp_path / "llama")
    out = _check_warm(ckpt, compile_cache_dir, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert out == [hf_greedy(hf, p, NEW) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("quant", [None, "int8_per_token"], ids=["bf16", "int8"])
def test_warm_llm_bf16_and_int8(llama_checkpoint, compile_cache_dir, tmp_path, quant):
    ckpt = _own_copy(llama_checkpoint, tmp_path / "llama")
    _check_warm(ckpt, compile_cache_dir, torch.bfloat16, quant)


@pytest.mark.slow
def test_warm_llm_maps_packed_moe_experts(tiny_checkpoint, compile_cache_dir, tmp_path):
    """Stacked MoE experts re-laid out for the small-M kernel are cached and mapped too."""
    ckpt = _own_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "qwen3_moe")
    _check_warm(ckpt, compile_cache_dir, torch.bfloat16)
