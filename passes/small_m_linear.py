"""A hand-written CPU linear for the few rows of a decode step (bf16), near memory bandwidth.

``small_m_linear(x2, w, bias)`` computes ``x2 @ w.T + bias`` for a 2-D bf16 ``x2`` with the C++
kernel ``csrc/small_m_linear.cpp`` (AMX tiles, ``tdpbf16ps``, where the build targets AMX-BF16
and Linux grants the tile registers: Sapphire Rapids and later, every M; AVX512-BF16
``vdpbf16ps`` where the build targets it; AVX2
+ FMA on CPUs without it, e.g. AMD Zen 3: each bf16 pair widened exactly to fp32 by a shift and
a mask, two FMAs; a portable loop elsewhere). fp32 accumulation, the output rounded to nearest
even once, after the bias (as ``F.linear`` does). Any number of rows: past 6 the rows take
passes over k-blocks of each weight panel held in L1/L2 (``csrc/panel_loop.h``), so the weight
is streamed once for all rows, and a row's bits never depend on how many rows came with it.

Why: at batch 1 a linear is a GEMV that only has to stream its weight once; oneDNN's
``_linear_pointwise`` on a packed weight reaches ~12-17 GB/s here, against ~31 GB/s of read
bandwidth.  The kernel reads the weight re-laid out into panels of 64 output features
(:func:`pack`, see the .cpp), so each thread streams contiguous memory and needs no horizontal
reductions.  That panel layout is the layer's own weight (``piecewise::packed_linear``,
:mod:`passes.ops.packed_linear`): the engine re-lays each weight once after loading and releases
the original; on AVX512-BF16 machines without AMX it is also oneDNN's packed layout, so larger
batches run oneDNN on the same bytes.  With AMX oneDNN picks a blocking of its own: no shared
bytes, and batches past ``max_rows`` run the kernel ``max_rows`` rows at a time.

AMX: on AVX512-BF16 alone a linear of M rows costs M times the dot products, and on an Intel
Xeon with AMX (2 vCPUs, 2026-12-05) that made the kernel compute-bound from M = 2: against
oneDNN's AMX path on its own layout it took 1.37x the time at M = 8 and 4.8x at M = 64 (N
11264, K 2048, every call streaming from DRAM).  The tile path reads the same panels (a
panel's k-pairs are AMX's VNNI layout for B) and streams the weight at every M up to 16;
the tiny model's O2 decode step, AVX512 build against AMX build in alternated processes,
3 rounds: b1 2.56 -> 2.75 ms (0.93x: one stream per thread where the AVX512 path keeps two),
b8 5.58 -> 3.25 ms (1.72x), b32 12.02 -> 5.94 ms (2.02x)
(``experiments/bench/results/small_m_amx_2026-12-05.md``).

:func:`run_packed` is what the op calls; :func:`small_m_linear` packs a plain weight per call
(tests, microbenchmarks).  Whether the op uses the kernel, and up to how many rows, are
engine settings (``CompilationConfig.kernel_config``); ``PIECEWISE_SMALL_M_LINEAR_PORTABLE=1``
forces the portable build of the library.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from framework.core.native_build import KernelBuildError, NativeLibrary, compiler

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 64
"""Rows (tokens) up to which the kernel runs; more rows go to oneDNN.  The default of
``KernelConfig.small_m_max_rows``.  Measured (``python -m experiments.bench.small_m_linear``,
the tiny and 1.1B shapes, M = 1..64): the geometric mean of the kernel's speed-up over oneDNN
stays above 1 at every measured M (1.8x at M = 1, 1.3x at 16, 1.1x at 40 and 64; the tiny LM
head alone is even from M = 48), so the crossover lies at or past 64, the largest M
measured: a verify step (b8 x (1 + 4) = 40 rows) and b32 / b64 decode steps run the kernel."""

LANES = 64
"""Output features per panel of the packed layout (``kLanes`` in the .cpp)."""

DTYPES = {torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.piecewise_small_m_linear.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, i64]
    lib.piecewise_small_m_linear.restype = ctypes.c_int
    lib.piecewise_small_m_linear_lanes.restype = ctypes.c_int64
    lib.piecewise_small_m_linear_isa.restype = ctypes.c_char_p


LIBRARY = NativeLibrary(
    "small_m_linear",
    Path(__file__).resolve().parent / "csrc" / "small_m_linear.cpp",
    portable_env="PIECEWISE_SMALL_M_LINEAR_PORTABLE",
    declare=_declare,
    depends=(
        Path(__file__).resolve().parent / "csrc" / "panel_loop.h",
        Path(__file__).resolve().parent / "csrc" / "amx_tiles.h",
        Path(__file__).resolve().parents[1] / "framework" / "core" / "csrc" / "row_argmax.h",
        Path(__file__).resolve().parents[1] / "framework" / "core" / "csrc" / "bf16.h",
    ),
)


@functools.lru_cache(maxsize=None)
def load_library(portable: Optional[bool] = None) -> ctypes.CDLL:
    """Load (building if needed) the library; cached per ``portable`` value."""
    lib = LIBRARY.load(portable)
    if lib.piecewise_small_m_linear_lanes() != LANES:
        raise KernelBuildError(f"{LIBRARY.source.name}: panel width differs from LANES={LANES}")
    return lib


def isa(portable: Optional[bool] = None) -> str:
    """The instruction set the loaded build uses."""
    return load_library(portable).piecewise_small_m_linear_isa().decode()


@functools.lru_cache(maxsize=None)
def kernel_available() -> bool:
    """The kernel builds on this machine (a failed build is logged once and leaves every
    linear on oneDNN)."""
    if compiler() is None:
        return False
    try:
        load_library()
    except KernelBuildError as e:
        logger.warning("small-M linear kernel unavailable, linears stay on oneDNN: %s", e)
        return False
    return True


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` in the kernel's layout ``[ceil(N/64), ceil(K/2), 64, 2]``, zero-padded."""
    n, k = w.shape
    n_pad, k_pad = -(-n // LANES) * LANES, k + (k & 1)
    if (n_pad, k_pad) == (n, k):
        padded = w  # no padding: one copy, the permuted one
    else:
        padded = w.new_zeros(n_pad, k_pad)
        padded[:n, :k] = w
    return padded.view(n_pad // LANES, LANES, k_pad // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape :func:`pack` gives an ``[n, k]`` weight."""
    return (-(-n // LANES), -(-k // 2), LANES, 2)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain ``[n, k]`` weight of a :func:`pack` ed one (a new tensor)."""
    panels, pairs = packed.shape[:2]
    plain = packed.permute(0, 2, 1, 3).reshape(panels * LANES, pairs * 2)
    return plain[:n, :k].contiguous()


def is_packed(w: torch.Tensor, n: int, k: int) -> bool:
    """``w`` has the shape and dtype :func:`pack` gives an ``[n, k]`` weight."""
    return (
        w.dim() == 4
        and w.dtype in DTYPES
        and tuple(w.shape) == panel_shape(n, k)
        and w.is_contiguous()
    )


_KERNEL = None
"""The default build's C function, once loaded (saves two cached look-ups per call)."""


def _kernel(portable: Optional[bool] = None):
    global _KERNEL
    fn = load_library(portable).piecewise_small_m_linear
    if portable is None:
        _KERNEL = fn
    return fn


def small_m_linear(
    x2: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor],
    portable: Optional[bool] = None,
) -> torch.Tensor:
    """``x2 [M, K] @ w[N, K].T (+ bias [N])`` with the kernel; returns a new ``[M, N]``."""
    if (
        x2.dim() != 2
        or w.dim() != 2
        or w.shape[1] != x2.shape[1]
        or w.dtype not in DTYPES
        or x2.dtype != w.dtype
        or not (x2.is_cpu and w.is_cpu)
    ):
        raise ValueError(
            f"small_m_linear: x {tuple(x2.shape)} {x2.dtype} and w {tuple(w.shape)} "
            f"{w.dtype} must be CPU [M, K] and [N, K] of one dtype in {list(DTYPES)}"
        )
    if bias is not None and (bias.shape != w.shape[:1] or bias.dtype != w.dtype):
        raise ValueError(
            f"small_m_linear: bias must be [{w.shape[0]}] {w.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    return run(x2, w, bias, portable)


def run(
    x2: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor],
    portable: Optional[bool] = None,
) -> torch.Tensor:
    """:func:`small_m_linear` without the argument checks (packs ``w`` for this call)."""
    return run_packed(x2, pack(w), bias, w.shape[0], portable)


def run_packed(
    x2: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    n: int,
    portable: Optional[bool] = None,
) -> torch.Tensor:
    """``x2 [M, K] @ W.T (+ bias)`` on the :func:`pack` ed ``W [n, K]``; no argument checks
    (``piecewise::packed_linear`` makes them: one call per linear per decode step)."""
    m, k = x2.shape
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = x2.new_empty(m, n)
    fn = (_KERNEL or _kernel()) if portable is None else _kernel(portable)
    rc = fn(
        x2.data_ptr(),
        x2.stride(0) if m > 1 else k,  # a size-1 dim's stride can be anything
        m,
        packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        n,
        k,
        DTYPES[packed.dtype],
    )
    if rc:
        raise ValueError(f"small_m_linear: kernel error {rc} for x {tuple(x2.shape)}, w {(n, k)}")
    return out
