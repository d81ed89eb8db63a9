"""Compile a ``@triton.jit`` kernel ahead of time for a CUDA GPU (sm_90, H100/H200), no GPU needed.

The interpreter skips Triton's code generator, so it accepts kernels the real compiler rejects
(types that differ across branches or loop iterations, unsupported casts, constexpr misuse).
``triton.compile`` with a ``GPUTarget`` runs the real pipeline -- TTIR, TTGIR, LLVM IR, PTX
and, with the ``ptxas`` that Triton's NVIDIA backend bundles (``triton/backends/nvidia/bin``),
a cubin -- on any machine.  A compile error fails the test; the only skips are a Triton build
without the NVIDIA backend or without ``ptxas`` (the backend hashes its ptxas version before
any stage runs, so nothing can be compiled without it), each with that reason.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Mapping

import pytest

ARCH = 90
"""sm_90: the H100/H200 generation the GPU check runs on."""

MODEL_DTYPES = ("bf16", "fp16", "fp32")
"""Triton names of the activation dtypes a model runs in (bf16/fp16 on GPU, fp32 on CPU)."""


def require_cuda_backend() -> None:
    """Skip (with the reason) when this Triton build cannot target CUDA at all."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        why = "TRITON_INTERPRET=1 here: kernels are interpreted, nothing to compile"
        pytest.skip(reason=why)
    from triton.backends import backends

    if "nvidia" not in backends:
        why = f"triton {triton.__version__} has no NVIDIA backend ({sorted(backends)})"
        pytest.skip(reason=why)
    from triton import knobs

    try:
        ptxas = knobs.nvidia.ptxas.path
    except RuntimeError as e:  # raised when the tool is found nowhere
        pytest.skip(reason=f"this triton build ships no ptxas and none is on PATH: {e}")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip(reason=f"this triton build ships no ptxas ({ptxas!r})")


def compile_for_sm90(kernel: Any, types: Mapping[str, str], constexprs: Mapping[str, Any]) -> Any:
    """Compile ``kernel`` (a JITFunction) for sm_90 and check every stage came out.

    ``types`` gives the Triton type of each runtime argument ("*bf16", "i32", "fp32", ...);
    every argument must be in exactly one of ``types`` and ``constexprs`` (a forgotten one is
    a test bug, reported as such).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    assert isinstance(kernel, JITFunction), (
        f"{kernel!r} is not a JITFunction: was triton imported with TRITON_INTERPRET=1?"
    )
    params = list(inspect.signature(kernel.fn).parameters)
    unknown = (set(types) | set(constexprs)) - set(params)
    missing = [p for p in params if p not in types and p not in constexprs]
    assert not unknown and not missing, (
        f"{kernel.fn.__name__}: unknown arguments {sorted(unknown)}, untyped {missing}"
    )
    signature = {p: ("constexpr" if p in constexprs else types[p]) for p in params}
    compiled = triton.compile(
        ASTSource(kernel, signature, dict(constexprs)), target=GPUTarget("cuda", ARCH, 32)
    )
    for stage in ("ttir", "ttgir", "llir", "ptx", "cubin"):
        assert compiled.asm.get(stage), f"{kernel.fn.__name__}: no {stage} produced"
    assert f".target sm_{ARCH}" in compiled.asm["ptx"]
    return compiled
