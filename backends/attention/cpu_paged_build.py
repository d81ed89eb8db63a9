"""The fused CPU paged-attention kernel (``csrc/cpu_paged_attention.cpp``), built per machine
by the shared helpers of :mod:`framework.core.native_build` (g++ ``-O3 -march=native``,
portable fallback, cached under ``$PIECEWISE_CACHE_DIR/kernels``) in two forms:

* a ctypes library (:data:`LIBRARY`, :func:`load_library`): the C entry points, for the op's
  Python body, other builds of the kernel (``experiments.bench.attention_ab``) and tests;
* a torch op library (:data:`OP_LIBRARY`, :func:`load_op`, ``csrc/cpu_paged_op.cpp``): the
  C++ CPU kernel of ``piecewise::cpu_paged_attention``, which the attention backend calls, so
  a layer's call goes from the dispatcher straight into C++ (checks included); where this
  Python's headers are installed it is also a Python module whose function is that kernel,
  which the backend calls without the dispatcher (``framework.core.ops.direct_call``).  It
  compiles torch's headers once per machine and torch version (tens of seconds on 2 cores,
  cached).

``PIECEWISE_CPU_PAGED_PORTABLE=1`` forces the portable build of both.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from framework.core.native_build import KernelBuildError, NativeLibrary, TorchOpLibrary, compiler

__all__ = [
    "LIBRARY",
    "OP_LIBRARY",
    "KernelBuildError",
    "compiler",
    "declare_attention",
    "isa",
    "load_library",
    "load_op",
]
CSRC = Path(__file__).resolve().parent / "csrc"


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
    words = lib.piecewise_cpu_paged_attention_words
    words.argtypes = [p, i64, p, i64, p, i64, p, i64, p, i64, i64, p, p, i64, p, p] + [i64] * 9
    words.restype = ctypes.c_int
    lib.piecewise_cpu_paged_item_heads.argtypes = [p, i64, i64, i64, i64]
    lib.piecewise_cpu_paged_item_heads.restype = i64


LIBRARY = NativeLibrary(
    "cpu_paged",
    CSRC / "cpu_paged_attention.cpp",
    portable_env="PIECEWISE_CPU_PAGED_PORTABLE",
    declare=_declare,
)

OP_LIBRARY = TorchOpLibrary(
    "cpu_paged_op",
    CSRC / "cpu_paged_op.cpp",
    portable_env="PIECEWISE_CPU_PAGED_PORTABLE",
    python_module="cpu_paged_op",
    depends=(
        CSRC / "cpu_paged_attention.cpp",
        CSRC.parents[2] / "framework" / "core" / "csrc" / "dtype_name.h",
    ),
)


def load_library(portable: bool | None = None) -> ctypes.CDLL:
    """Load (building if needed) the library; cached per ``portable`` value."""
    return LIBRARY.load(portable)


def isa(portable: bool | None = None) -> str:
    """The instruction set the loaded build was vectorised for."""
    return load_library(portable).piecewise_cpu_paged_isa().decode()


@functools.lru_cache(maxsize=1)
def load_op() -> bool:
    """Register the C++ CPU kernel of ``piecewise::cpu_paged_attention`` (once per process,
    building the library on first use).  False, with one warning, where it cannot be built:
    the op's Python body (the same checks, the kernel through ctypes) then runs."""
    import backends.attention.cpu_paged  # noqa: F401  (the op is defined before its kernel)

    return OP_LIBRARY.register(
        "piecewise::cpu_paged_attention's Python body calls the kernel through ctypes",
        direct=("piecewise::cpu_paged_attention",),
    )
