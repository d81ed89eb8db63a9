"""The fused CPU paged-attention library (``csrc/cpu_paged_attention.cpp``), built per machine
and loaded through ctypes by the shared helper :class:`framework.core.native_build.NativeLibrary`
(g++ ``-O3 -march=native``, portable fallback, cached under ``$PIECEWISE_CACHE_DIR/kernels``).

``PIECEWISE_CPU_PAGED_PORTABLE=1`` forces the portable build.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from framework.core.native_build import KernelBuildError, NativeLibrary, compiler

__all__ = ["LIBRARY", "KernelBuildError", "compiler", "declare_attention", "isa", "load_library"]


def declare_attention(lib: ctypes.CDLL) -> None:
    """The signature of the kernel's entry point (the one function every version of the
    source has had; ``experiments.bench.attention_ab`` loads older ones)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.piecewise_cpu_paged_attention
    fn.argtypes = (
        [p, i64, p, i64, p, i64, p, i64, p, i64, i64, p, p, i64, p, p]
        + [i64] * 6
        + [ctypes.c_float, i64, i64]
    )
    fn.restype = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    declare_attention(lib)
    lib.piecewise_cpu_paged_isa.restype = ctypes.c_char_p
    lib.piecewise_cpu_paged_exp_neg.argtypes = [p, p, p, i64]
    lib.piecewise_cpu_paged_exp_neg.restype = None


LIBRARY = NativeLibrary(
    "cpu_paged",
    Path(__file__).resolve().parent / "csrc" / "cpu_paged_attention.cpp",
    portable_env="PIECEWISE_CPU_PAGED_PORTABLE",
    declare=_declare,
)


def load_library(portable: bool | None = None) -> ctypes.CDLL:
    """Load (building if needed) the library; cached per ``portable`` value."""
    return LIBRARY.load(portable)


def isa(portable: bool | None = None) -> str:
    """The instruction set the loaded build was vectorised for."""
    return load_library(portable).piecewise_cpu_paged_isa().decode()
