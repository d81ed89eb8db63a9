"""Hand-written CPU int8 linears for the few rows of a decode step, near memory bandwidth.

Two kernels (``csrc/int8_linear.cpp``) over one weight layout:

* **W8A8, dynamic per-token** (:func:`run_packed`): ``x`` (bf16 or fp32 ``[M, K]``) is quantised
  per row in the kernel's prologue, with exactly the arithmetic of
  ``piecewise::dynamic_per_token_quant`` (scale ``max(absmax / 127, 1e-10)``, round half to
  even, clamp, in fp32); the int8 products run on AVX512-VNNI ``vpdpbusd`` (u8 x s8, 4 k per
  32-bit lane, int32 accumulation) -- from 6 rows on AMX ``tdpbusd`` where the CPU has AMX-INT8
  (the same exact sums, read from the same panels: 2.2-3.8x faster at M = 64 with every
  call streaming its weight from DRAM, Intel Xeon, ``experiments/bench/results/``
  ``small_m_amx_2026-12-05.md``) --, or on AVX2 ``vpmaddubsw`` +
  ``vpmaddwd`` (the sign moved to the activation side, ``|w| x (q * sign(w))``, so no int16
  pair sum saturates: the same exact int32 sums); the epilogue computes
  ``float(acc) * x_scale * w_scale (+ bias)`` in that order, rounded once to x's dtype.  The
  result equals ``dynamic_per_token_quant`` + ``torch._int_mm`` + the scaled-mm epilogue bit for
  bit (``tests/passes/test_int8_small_m.py``).
  ``vpdpbusd`` multiplies *unsigned* by signed bytes: the prologue stores ``u = q + 128`` and
  the kernel subtracts ``comp[n] = 128 * sum_k W_q[n, k]`` (:func:`compensation`, computed once
  at packing) from each accumulator, which is exact in int32.
* **weight-only** (:func:`run_packed_weight_only`): x stays in floating point; each int8
  weight is widened to fp32 in registers and FMA'd; ``acc * w_scale (+ bias)``, one rounding.

Layout (:func:`pack`): panels of 64 output channels, 4 consecutive k per 32-bit lane,
``packed[p][i][j][t] = W_q[64 p + j][4 i + t]``, zero-padded: ``[ceil(N/64), ceil(K/4), 64, 4]``
int8.  The engine re-lays each quantised weight once after loading
(:class:`passes.ops.int8_packed_linear.PackedInt8LinearMethod`); that tensor is the layer's weight.

The ops the graph calls (``piecewise::int8_packed_linear``, ``int8_wo_packed_linear``) run
these kernels from C++ (``csrc/torch_ops.cpp``, :mod:`passes.native_ops`); the ctypes entry
points here are for tests (including the portable build, ``PIECEWISE_INT8_LINEAR_PORTABLE=1``),
microbenchmarks and the ops' Python bodies where the C++ op library is not built.
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
"""Rows (tokens) up to which the int8 kernels run; more rows go to ``torch._int_mm`` (W8A8)
or torch's weight-only path.  The default of ``KernelConfig.int8_small_m_max_rows``.
Measured (``python -m experiments.bench.small_m_linear --kernels int8``, the tiny and 1.1B
shapes, M = 1..64): the W8A8 kernel's geometric-mean speed-up over ``dynamic_per_token_quant``
+ ``_int_mm`` on a plain weight stays above 1 at every measured M (2.3x at M = 1, 2.3x at 16,
1.3x at 40, 1.2x at 64; the largest weights trail from M = 40-48), and over what a packed
layer really runs above max_rows (the same, after unpacking its weight per call) it is
2.2-32x; so the crossover lies at or past 64, the largest M measured."""

LANES = 64
"""Output channels per panel (``kLanes`` in the .cpp)."""
QUAD = 4
"""Consecutive k per 32-bit lane (``kQuad``): what one ``vpdpbusd`` lane sums."""

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Activation / output dtypes the kernels read, with the .cpp's codes."""

CSRC = Path(__file__).resolve().parent / "csrc"


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.piecewise_int8_linear.argtypes = [p, i64, i64, p, p, p, p, p, i64, i64, i64, i64]
    lib.piecewise_int8_linear.restype = ctypes.c_int
    lib.piecewise_int8_wo_linear.argtypes = [p, i64, i64, p, p, p, p, i64, i64, i64, i64]
    lib.piecewise_int8_wo_linear.restype = ctypes.c_int
    lib.piecewise_int8_linear_lanes.restype = i64
    lib.piecewise_int8_linear_quad.restype = i64
    lib.piecewise_int8_linear_isa.restype = ctypes.c_char_p


LIBRARY = NativeLibrary(
    "int8_linear",
    CSRC / "int8_linear.cpp",
    portable_env="PIECEWISE_INT8_LINEAR_PORTABLE",
    declare=_declare,
    extra_flags=("-ffp-contract=off",),  # the epilogue rounds as torch does: no FMA contraction
    depends=(
        CSRC / "panel_loop.h",
        CSRC / "amx_tiles.h",
        CSRC.parents[1] / "framework" / "core" / "csrc" / "bf16.h",
    ),
)


@functools.lru_cache(maxsize=None)
def load_library(portable: Optional[bool] = None) -> ctypes.CDLL:
    """Load (building if needed) the ctypes library; cached per ``portable`` value."""
    lib = LIBRARY.load(portable)
    if (lib.piecewise_int8_linear_lanes(), lib.piecewise_int8_linear_quad()) != (LANES, QUAD):
        raise KernelBuildError(f"{LIBRARY.source.name}: panel layout differs from {LANES}x{QUAD}")
    return lib


def isa(portable: Optional[bool] = None) -> str:
    """The instruction set the loaded build uses (``avx512_vnni`` where ``vpdpbusd`` runs)."""
    return load_library(portable).piecewise_int8_linear_isa().decode()


@functools.lru_cache(maxsize=None)
def kernel_available() -> bool:
    """The kernels build on this machine (a failed build is logged once and leaves every int8
    linear on torch's path)."""
    if compiler() is None:
        return False
    try:
        load_library()
    except KernelBuildError as e:
        logger.warning("int8 small-M kernels unavailable, int8 linears stay on _int_mm: %s", e)
        return False
    return True


EVERY_ROW_COUNT_ISAS = ("avx2_fma",)
"""Builds of the kernels (:func:`isa`) that take int8 calls of every row count."""


@functools.lru_cache(maxsize=None)
def takes_every_row_count() -> bool:
    """The kernels take int8 calls of every row count, past ``max_rows`` that many rows at a
    time (``piecewise::int8_packed_linear``, ``int8_wo_packed_linear``): where the CPU has no
    int8 dot product (the kernels' AVX2 build: no VNNI), torch's int8 GEMMs have no fast path
    either.  Measured on the AVX2 EPYC (``experiments/bench/results/``
    ``int8_avx2_past_max_rows_2026-12-06.txt``: the kernel in one call 33-42x faster than
    ``_int_mm``, 4.1-5.2x than torch's weight-only path, at 64-512 rows of the default model's
    shapes); before, an int8 generation of 8 64-token prompts took 6-7 s there whatever its
    length, 0.4-1.3 s in bf16 (whose kernel already took every row count there).  Then too
    every row of a call has the bits a decode step gives it."""
    return kernel_available() and isa() in EVERY_ROW_COUNT_ISAS


W8A8_ONE_CALL_ISAS = ("amx_int8",)
"""Builds whose W8A8 kernel (:func:`run_packed`) takes a call of any row count in one call."""


@functools.lru_cache(maxsize=None)
def w8a8_takes_every_row_count() -> bool:
    """The W8A8 kernel takes calls of every row count in one call
    (``piecewise::int8_packed_linear`` past ``max_rows``): on AMX its tile path is a GEMM that
    streams each panel once for all the call's rows, where torch's path unpacks the weight
    for the call and runs ``_int_mm``.  On an AMX Xeon (``experiments/bench/results/``
    ``int8_amx_past_max_rows_2026-12-07.md``) 3.7-9.1x faster at 128-2048 rows of the tiny
    and 1.1B shapes, and 1.3-1.6x faster than the same kernel 64 rows at a time; the same
    bits (W8A8 sums are exact integers).  The weight-only kernel has no tile path: it stays
    on torch's path past ``max_rows`` there (the kernel in slices measured 0.2-1.7x)."""
    return kernel_available() and isa() in W8A8_ONE_CALL_ISAS


def panel_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape :func:`pack` gives an ``[n, k]`` weight."""
    return (-(-n // LANES), -(-k // QUAD), LANES, QUAD)


def pack(w_q: torch.Tensor) -> torch.Tensor:
    """int8 ``w_q [N, K]`` in the kernels' layout ``[ceil(N/64), ceil(K/4), 64, 4]``."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise ValueError(
            f"int8_small_m.pack: expected int8 [N, K], got {w_q.dtype} {tuple(w_q.shape)}"
        )
    n, k = w_q.shape
    p, kq, _, _ = panel_shape(n, k)
    if (p * LANES, kq * QUAD) == (n, k):
        padded = w_q
    else:
        padded = w_q.new_zeros(p * LANES, kq * QUAD)
        padded[:n, :k] = w_q
    return padded.view(p, LANES, kq, QUAD).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain int8 ``[n, k]`` weight of a :func:`pack` ed one (a new tensor)."""
    p, kq = packed.shape[:2]
    plain = packed.permute(0, 2, 1, 3).reshape(p * LANES, kq * QUAD)
    return plain[:n, :k].contiguous()


def is_packed(w: torch.Tensor, n: int, k: int) -> bool:
    return (
        w.dim() == 4
        and w.dtype == torch.int8
        and tuple(w.shape) == panel_shape(n, k)
        and w.is_contiguous()
    )


def compensation(w_q: torch.Tensor) -> torch.Tensor:
    """int32 ``[N]``: ``128 * sum_k W_q[n, k]``, what the u8 offset of the activations adds."""
    return w_q.sum(dim=1, dtype=torch.int32).mul_(128)


def _rows(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, (x2.stride(0) if x2.shape[0] > 1 else x2.shape[1])


def _check_rc(rc: int, name: str, x2: torch.Tensor, n: int) -> None:
    if rc:
        raise ValueError(f"{name}: kernel error {rc} for x {tuple(x2.shape)} {x2.dtype}, N={n}")


def run_packed(
    x2: torch.Tensor,
    packed: torch.Tensor,
    w_scale: torch.Tensor,
    comp: torch.Tensor,
    bias: Optional[torch.Tensor],
    n: int,
    portable: Optional[bool] = None,
) -> torch.Tensor:
    """W8A8 ``x2 [M, K]`` (bf16/fp32, quantised per row in the kernel) against the packed
    ``W_q [n, K]`` with fp32 ``w_scale [n]`` and :func:`compensation` ``comp [n]``; bias ``[n]``
    in x's dtype or None.  Returns a new ``[M, n]`` in x's dtype.  No argument checks."""
    x2, x_st = _rows(x2)
    m, k = x2.shape
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = x2.new_empty(m, n)
    rc = load_library(portable).piecewise_int8_linear(
        x2.data_ptr(),
        x_st,
        m,
        packed.data_ptr(),
        comp.data_ptr(),
        w_scale.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        n,
        k,
        DTYPES[x2.dtype],
    )
    _check_rc(rc, "int8_small_m.run_packed", x2, n)
    return out


def run_packed_weight_only(
    x2: torch.Tensor,
    packed: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    n: int,
    portable: Optional[bool] = None,
) -> torch.Tensor:
    """Weight-only ``x2 [M, K] @ (W_q * w_scale[:, None]).T (+ bias)``; fp32 ``w_scale [n]``."""
    x2, x_st = _rows(x2)
    m, k = x2.shape
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = x2.new_empty(m, n)
    rc = load_library(portable).piecewise_int8_wo_linear(
        x2.data_ptr(),
        x_st,
        m,
        packed.data_ptr(),
        w_scale.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        n,
        k,
        DTYPES[x2.dtype],
    )
    _check_rc(rc, "int8_small_m.run_packed_weight_only", x2, n)
    return out
