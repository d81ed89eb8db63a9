"""CUDA-graph integration on CPU through EmulatedGraphOps: the same dispatcher, wrappers,
padding and capture plan as on a GPU; replay runs the kernels recorded at capture (aten ops,
Inductor graphs, Triton launches) on the captured static buffers, never the Python."""

import pytest
import torch
from triton_interpreter import language_is_interpreted, run_module_in_interpreter

from framework import LLM, CompilationConfig
from framework.core.forward_context import BatchDescriptor, CUDAGraphMode
from framework.cudagraph.wrapper import clear_all_graphs

INTERPRETED = "triton_interpreted"
"""Marker of the CPU tests that need the Triton interpreter (rerun in a child process)."""

PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250], [77, 12, 5, 90]]


def _llm(path, **kw):
    cc = dict(level=1, compiler="eager", pass_config={"passes": []}, progress_bar=False)
    cc.update(kw.pop("cc", {}))
    return LLM(
        str(path),
        compilation_config=CompilationConfig(**cc),
        max_num_seqs=4,
        max_model_len=64,
        **kw,
    )


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=4, max_model_len=64)
    return llm.generate(PROMPTS, 10, ignore_eos=True)


def test_padded_batches_match_unpadded(llama_checkpoint, reference):
    llm = _llm(llama_checkpoint)
    sizes = [2, 8, 16, 64]

    def padding_dispatch(n, num_reqs, uniform):
        padded = next(s for s in sizes if s >= n)
        return CUDAGraphMode.NONE, BatchDescriptor(padded, None, False)

    llm.runner.dispatch = padding_dispatch
    assert llm.generate(PROMPTS, 10, ignore_eos=True) == reference
    padded = [s for s in llm.runner.trace if s["num_padded_tokens"] > s["num_tokens"]]
    assert padded, "the workload should have exercised padding"


def test_piecewise_graphs_capture_once_and_replay(llama_checkpoint, reference):
    clear_all_graphs()
    llm = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cc={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    assert llm.stats["cudagraph_mode"] == "PIECEWISE"
    assert llm.stats["captures"] == 4 * (llm.model_config.num_layers + 1)
    assert llm.generate(PROMPTS, 10, ignore_eos=True) == reference
    wrappers = [w for w in llm.compiled.backend.split_wrappers()]
    assert all(w.stats.replays > 0 for w in wrappers)
    assert all(w.stats.captures == 4 for w in wrappers)


def test_a_warm_up_runs_no_graph(llama_checkpoint):
    """``dummy_run`` (the start-up warm-up, calibration) runs the dispatcher's padded size
    without graphs.  On a GPU a capture runs nothing: a warm-up dispatched to a graph was a
    piece's first run inside a capture, and the kernel loads of that first run invalidated it
    (cudaErrorStreamCaptureInvalidated, the GPU check's second run on the H200)."""
    clear_all_graphs()
    llm = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cc={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
    )
    before = llm.graphs.stats()
    llm.dummy_run(16)
    llm.dummy_run(3)  # padded to 4, a captured size
    after = llm.graphs.stats()
    assert (after.captures, after.replays) == (before.captures, before.replays)
    assert llm.generate(PROMPTS[:1], 2, ignore_eos=True)  # the engine's own steps still replay
    assert llm.graphs.stats().replays > before.replays


def test_capture_counts_are_per_engine(llama_checkpoint):
    """A second engine in the same process (the first one alive, its graphs kept) reports
    its own captures, not the process's."""
    first = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cc={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
    )
    second = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cc={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]},
    )
    pieces = first.model_config.num_layers + 1
    assert first.stats["captures"] == 3 * pieces
    assert second.stats["captures"] == 2 * pieces
    assert second.startup.captures == second.graphs.stats().captures == 2 * pieces
    assert first.graphs.stats().captures == 3 * pieces  # untouched by the second engine
    assert not set(map(id, first.graphs.wrappers)) & set(map(id, second.graphs.wrappers))


def test_emulate_cuda_graphs_must_be_a_bool(llama_checkpoint):
    with pytest.raises(ValueError, match="LLM.emulate_cuda_graphs: must be a bool"):
        LLM(str(llama_checkpoint), emulate_cuda_graphs="yes")


@pytest.mark.triton_interpreted
@pytest.mark.skipif(
    not language_is_interpreted(),
    reason="needs the Triton interpreter: test_in_interpreter reruns it",
)
def test_full_and_piecewise_with_graph_safe_backend(llama_checkpoint, reference):
    clear_all_graphs()
    llm = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        attention_backend="triton",
        cc={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
    )
    assert llm.stats["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert llm.generate(PROMPTS, 6, ignore_eos=True) == [r[:6] for r in reference]
    full = llm.runner.forward
    assert full.stats.captures == 3 and full.stats.replays > 0


@pytest.mark.skipif(
    torch.cuda.is_available() or language_is_interpreted(),
    reason="CPU only; runs the interpreter tests of this module",
)
def test_in_interpreter(request):
    run_module_in_interpreter(__file__, request, marker=INTERPRETED)


def test_piecewise_graphs_capture_inductor_pieces(llama_checkpoint, reference, compile_cache_dir):
    """Inductor-compiled pieces inside emulated graphs: each piece's capture records the
    compiled graph as one launch, and generation through the replays matches eager."""
    clear_all_graphs()
    llm = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cache_dir=compile_cache_dir,
        cc={
            "compiler": "inductor",
            "cudagraph_mode": "PIECEWISE",
            "cudagraph_capture_sizes": [1, 4],
        },
    )
    assert llm.generate(PROMPTS, 10, ignore_eos=True) == reference
    wrappers = llm.compiled.backend.split_wrappers()
    assert all(w.stats.captures == 2 and w.stats.replays > 0 for w in wrappers)
    for w in wrappers:
        for entry in w._entries.values():
            assert "inductor graph" in [launch.name for launch in entry.graph.tape]


def test_torch_backend_downgrades_full_to_piecewise(llama_checkpoint):
    llm = _llm(
        llama_checkpoint,
        emulate_cuda_graphs=True,
        cc={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2]},
    )
    assert llm.stats["cudagraph_mode"] == "PIECEWISE"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_modes_give_identical_tokens_on_gpu(llama_checkpoint):
    from cuda_llm import cuda_llm

    outs = {}
    for mode in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        llm = cuda_llm(llama_checkpoint, mode)
        assert llm.stats["cudagraph_mode"] == mode
        outs[mode] = llm.generate(PROMPTS, 10, ignore_eos=True)
        clear_all_graphs()
    assert all(o == outs["NONE"] for o in outs.values()), outs
