"""An ``LLM`` on the GPU for the ``gpu``-marked tests: O2, the Triton attention backend (the one
FULL graphs can capture), the given CUDA-graph mode, capture sizes 1/2/4/8, up to 4
sequences of 64 tokens."""

from __future__ import annotations

from pathlib import Path

from framework import LLM, CompilationConfig


def cuda_llm(path: str | Path, cudagraph_mode: str) -> LLM:
    import backends.attention.triton_paged  # noqa: F401  (registers "triton")

    cc = CompilationConfig(
        level=2,
        cudagraph_mode=cudagraph_mode,
        progress_bar=False,
        cudagraph_capture_sizes=[1, 2, 4, 8],
    )
    return LLM(
        str(path),
        device="cuda",
        attention_backend="triton",
        compilation_config=cc,
        max_num_seqs=4,
        max_model_len=64,
    )
