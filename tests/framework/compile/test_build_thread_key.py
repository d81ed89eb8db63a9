"""An engine's compile-cache key covers the thread count its CPU kernels were compiled for:
Inductor writes ``#pragma omp parallel num_threads(N)`` with the compiling process's N, so an
artifact compiled at one count and loaded at another would run at the first one's (the bug
this guards: a 1-thread compile loaded by a 2-thread engine ran serial kernels)."""

import pytest
import torch

from framework import LLM
from framework.compile.build import build_forward
from framework.core.config import CompilationConfig
from models.loader import load_model
from passes.registry import level_passes


def _key_at(threads: int, model, mc, config) -> str:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = build_forward(
            model, config, model_hash=mc.compute_hash(), dtype=torch.float32, quant_hash=None
        )
    finally:
        torch.set_num_threads(before)
    return compiled.store.key


def test_the_thread_count_is_in_a_cpu_engines_key(llama_checkpoint, tmp_path):
    model, mc = load_model(str(llama_checkpoint), torch.float32, "cpu")
    cc = CompilationConfig(level=1, cache_dir=str(tmp_path), progress_bar=False)
    config = cc.resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=False)
    one, two = _key_at(1, model, mc, config), _key_at(2, model, mc, config)
    assert one != two
    assert _key_at(1, model, mc, config) == one


@pytest.mark.slow
def test_another_thread_count_compiles_anew_and_loads_nothing_stale(llama_checkpoint, tmp_path):
    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            llm = LLM(
                str(llama_checkpoint),
                optimization_level=2,
                cache_dir=str(tmp_path),
                max_num_seqs=2,
                max_model_len=64,
                compilation_config={"progress_bar": False},
            )
            out = llm.generate([[11, 12, 13, 14] * 3, [7, 8, 9] * 3], 8, ignore_eos=True)
        finally:
            torch.set_num_threads(before)
        return llm.stats, out

    cold, out1 = run(1)
    assert cold["compile_compiles"] > 0 and cold["compile_loads"] == 0
    other, out2 = run(2)
    assert other["cache_dir"] != cold["cache_dir"]
    assert other["compile_loads"] == 0 and other["compile_compiles"] > 0
    warm, again = run(1)
    assert warm["cache_dir"] == cold["cache_dir"] and warm["compile_compiles"] == 0
    assert out1 == out2 == again
