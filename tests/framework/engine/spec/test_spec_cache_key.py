"""The speculative config is part of the compile-cache key: changing k (or the draft) gives
a new key, and an engine never loads artifacts compiled for another k."""

import pytest
import torch

from framework import LLM
from framework.compile.build import build_forward
from framework.core.config import CompilationConfig, round_sizes_to_query_len
from framework.core.forward_context import CUDAGraphMode
from framework.engine.spec.config import SpeculativeConfig
from models.loader import load_model
from passes.registry import level_passes


def _store_key(model, mc, config, spec):
    compiled = build_forward(
        model,
        config,
        model_hash=mc.compute_hash(),
        dtype=torch.float32,
        quant_hash=None,
        speculative_hash=spec.compute_hash() if spec is not None else None,
    )
    return compiled.store.key


def test_key_changes_with_k_and_draft(llama_checkpoint, tmp_path):
    model, mc = load_model(str(llama_checkpoint), torch.float32, "cpu")
    cc = CompilationConfig(level=1, cache_dir=str(tmp_path), progress_bar=False)
    config = cc.resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=False)
    keys = {
        name: _store_key(model, mc, config, spec)
        for name, spec in {
            "off": None,
            "k2": SpeculativeConfig(num_speculative_tokens=2),
            "k3": SpeculativeConfig(num_speculative_tokens=3),
            "draft_a": SpeculativeConfig(
                method="draft_model", model="/a", num_speculative_tokens=2
            ),
            "draft_b": SpeculativeConfig(
                method="draft_model", model="/b", num_speculative_tokens=2
            ),
        }.items()
    }
    assert len(set(keys.values())) == len(keys), keys
    assert _store_key(model, mc, config, SpeculativeConfig(num_speculative_tokens=2)) == keys["k2"]
    assert _store_key(model, mc, config, None) == keys["off"]


def test_sizes_rounded_to_multiples_of_the_query_len():
    cc = CompilationConfig(
        level=2, compile_sizes=[1, 3, 8], cudagraph_capture_sizes=[1, 2, 4, 8, 16]
    )
    config = cc.resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=True)
    assert config.cudagraph_mode != CUDAGraphMode.NONE
    out, warning = round_sizes_to_query_len(config, 5, max_num_seqs=2)
    assert out.cudagraph_capture_sizes == [5, 10, 20] and out.compile_sizes == [5, 10]
    assert warning is None  # 20 >= 2 x 5
    out, warning = round_sizes_to_query_len(config, 5, max_num_seqs=8)
    assert "[5, 10, 20]" in warning and "40" in warning and "WITHOUT CUDA graphs" in warning
    same, none = round_sizes_to_query_len(config, 1, max_num_seqs=8)
    assert same is config and none is None
    # A budget too small for a full verify batch is said too.
    small = cc.replace(cudagraph_capture_sizes=[1, 2]).resolve(
        max_num_tokens=8, level_passes=level_passes, has_cuda=True
    )
    _, warning = round_sizes_to_query_len(small, 5, max_num_seqs=4)
    assert "max_num_tokens=8 < max_num_seqs (4) x (1 + k) = 20" in warning


@pytest.mark.slow
def test_changing_k_compiles_anew_and_loads_nothing_stale(llama_checkpoint, tmp_path):
    def run(k):
        llm = LLM(
            str(llama_checkpoint),
            optimization_level=1,
            cache_dir=str(tmp_path),
            max_num_seqs=2,
            max_model_len=64,
            compilation_config={"progress_bar": False},
            speculative_config={"method": "ngram", "num_speculative_tokens": k},
        )
        out = llm.generate([[11, 12, 13, 14] * 3, [7, 8, 9] * 3], 12, ignore_eos=True)
        return llm.stats, out

    cold, out2 = run(2)
    assert cold["compile_compiles"] > 0 and cold["compile_loads"] == 0
    other, out3 = run(3)
    assert other["cache_dir"] != cold["cache_dir"]  # a new key
    assert other["compile_loads"] == 0 and other["compile_compiles"] > 0  # nothing stale
    warm, again = run(2)
    assert warm["cache_dir"] == cold["cache_dir"] and warm["compile_compiles"] == 0
    assert warm["compile_loads"] > 0
    assert out2 == out3 == again
