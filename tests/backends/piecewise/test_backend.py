"""Split, per-range dispatch and the compiled-program skeleton of the piecewise backend."""

import pytest
import torch

from backends.piecewise.compiler import CompileRange, compile_ranges
from backends.piecewise.runtime import PiecewiseRuntime, RangeEntry
from framework import LLM, CompilationConfig


def _eager_llm(path, **cc):
    config = CompilationConfig(level=1, compiler="eager", pass_config={"passes": []}, **cc)
    return LLM(str(path), compilation_config=config, max_num_seqs=2, max_model_len=64)


def test_compile_ranges_from_endpoints_and_sizes():
    assert compile_ranges([], [], 16) == [CompileRange(1, 16)]
    assert compile_ranges([4, 8], [2, 8], 16) == [
        CompileRange(1, 4),
        CompileRange(5, 8),
        CompileRange(9, 16),
        CompileRange(2, 2),
        CompileRange(8, 8),
    ]
    # endpoints at or above max_num_tokens collapse into the last range
    assert compile_ranges([16, 32], [], 16) == [CompileRange(1, 16)]


@pytest.mark.parametrize("max_tokens", [9, 16])
def test_dispatch_prefers_exact_size_then_containing_range(max_tokens):
    ranges = compile_ranges([4], [1, 3, 8], max_tokens)
    calls = []

    def runnable(rng):
        def run(x):
            calls.append(rng)
            return x

        return run

    rt = PiecewiseRuntime(
        "p", [RangeEntry(r, runnable(r), "compiled") for r in ranges], max_tokens, size_from=(0, 0)
    )
    for n in range(1, max_tokens + 1):
        rt(torch.zeros(n, 2))
        expected = (
            CompileRange(n, n)
            if n in (1, 3, 8)
            else CompileRange(1, 4)
            if n <= 4
            else CompileRange(5, max_tokens)
        )
        assert calls[-1] == expected, n
        assert rt.entry_for(n).compile_range == expected
    with pytest.raises(ValueError, match="outside 1..%d" % max_tokens):
        rt(torch.zeros(max_tokens + 1, 2))


def test_runtime_rejects_ranges_that_leave_gaps():
    with pytest.raises(ValueError, match="no compiled entry covers"):
        PiecewiseRuntime(
            "p", [RangeEntry(CompileRange(1, 4), lambda x: x, "compiled")], 8, size_from=(0, 0)
        )


def test_piece_count_is_layers_plus_one(llama_checkpoint):
    llm = _eager_llm(llama_checkpoint)
    s = llm.stats
    layers = llm.model_config.num_layers
    assert s["compile_num_pieces"] == layers + 1
    assert s["compile_num_splitting_ops"] == layers
    # 2 layers: first, middle and last piece all differ (nothing to share); sharing of
    # identical middle pieces is tested on an 8-layer model in test_artifact_cache_e2e.py
    assert layers == 2
    assert (s["compile_unique_graphs"], s["compile_shared"]) == (3, 0)


def test_empty_splitting_ops_keeps_one_graph(llama_checkpoint):
    llm = _eager_llm(llama_checkpoint, splitting_ops=[])
    assert llm.stats["compile_num_pieces"] == 1
    assert llm.stats["compile_num_splitting_ops"] == 0
    ref = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=2, max_model_len=64)
    prompts = [[1, 2, 3, 4], [5, 6]]
    assert llm.generate(prompts, 6) == ref.generate(prompts, 6)


def test_piece_runtimes_dispatch_by_token_count(llama_checkpoint):
    llm = _eager_llm(llama_checkpoint, compile_sizes=[1, 4], compile_ranges_endpoints=[8])
    runtimes = llm.compiled.backend.runtimes
    assert len(runtimes) == llm.model_config.num_layers + 1
    for rt in runtimes.values():
        assert rt.entry_for(1).compile_range == CompileRange(1, 1)
        assert rt.entry_for(4).compile_range == CompileRange(4, 4)
        assert rt.entry_for(5).compile_range == CompileRange(1, 8)
        assert rt.entry_for(9).compile_range == CompileRange(9, 64)


def test_traced_files_are_the_model_sources(llama_checkpoint):
    llm = _eager_llm(llama_checkpoint)
    names = {p.rsplit("/", 1)[-1] for p in llm.compiled.backend.traced_files}
    assert {"decoder.py", "layers.py"} <= names
    assert not any("/torch/" in p for p in llm.compiled.backend.traced_files)
