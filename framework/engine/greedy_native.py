"""Greedy argmax of CPU logits rows in one native pass (``csrc/greedy_argmax.cpp``).

The sampler's greedy path needs, per row, the index of the first maximum and that maximum (a
non-finite maximum fails the row's request).  Over the bf16 logits as they lie, one pass of
16 lanes per row and the rows over OpenMP threads replaces a float32 copy of the logits and
numpy's argmax over it.  Measured with ``python -m experiments.bench.step_parts`` (the
sampler row) on the default tiny model; see the engine README.

:func:`greedy_argmax` returns None where the library cannot be built (no compiler) or the
tensor is not a CPU bf16/float32 matrix with unit inner stride: the caller's portable path
then runs.  ``PIECEWISE_GREEDY_ARGMAX_PORTABLE=1`` forces the portable build of the library.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from framework.core.native_build import KernelBuildError, NativeLibrary

logger = logging.getLogger(__name__)

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.piecewise_greedy_argmax.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.piecewise_greedy_argmax.restype = ctypes.c_int


LIBRARY = NativeLibrary(
    "greedy_argmax",
    Path(__file__).resolve().parent / "csrc" / "greedy_argmax.cpp",
    portable_env="PIECEWISE_GREEDY_ARGMAX_PORTABLE",
    declare=_declare,
    depends=(Path(__file__).resolve().parents[1] / "core" / "csrc" / "row_argmax.h",),
)


@functools.lru_cache(maxsize=None)
def _kernel(portable: Optional[bool] = None):
    """The C function, or None (logged once) where the library cannot be had."""
    try:
        return LIBRARY.load(portable).piecewise_greedy_argmax
    except (KernelBuildError, OSError) as e:
        logger.info("greedy argmax: the native kernel is unavailable (%s); numpy runs", e)
        return None


def greedy_argmax(
    logits: torch.Tensor, portable: Optional[bool] = None
) -> Optional[tuple[list[int], list[float]]]:
    """(first-maximum index, maximum) per row of a CPU ``[rows, V]`` bf16/float32 tensor with
    unit inner stride; a row holding a NaN gets its first NaN's index and NaN.  None where
    the kernel does not apply or cannot be built."""
    dtype = DTYPES.get(logits.dtype)
    if (
        dtype is None
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.shape[1] == 0
        or (logits.shape[1] > 1 and logits.stride(1) != 1)
        or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1])
    ):
        return None
    fn = _kernel(portable)
    if fn is None:
        return None
    rows, n = logits.shape
    idx = np.empty(rows, dtype=np.int64)
    val = np.empty(rows, dtype=np.float32)
    stride = logits.stride(0) if rows > 1 else n
    rc = fn(logits.data_ptr(), rows, n, stride, dtype, idx.ctypes.data, val.ctypes.data)
    if rc:
        raise ValueError(f"greedy argmax: kernel error {rc} for logits {tuple(logits.shape)}")
    return idx.tolist(), val.tolist()
