"""Scaled matmuls of the quantized linear schemes.

Layouts (chosen by measurement on the project CPU, see the table below):

* ``int8_scaled_mm`` / ``fp8_scaled_mm``: ``x_q [T, K]``, ``w_q [K, N]`` with *any* strides --
  the schemes pass ``weight.t()`` of an ``[N, K]`` row-major weight, i.e. a column-major
  ``[K, N]`` (the cuBLAS/CUTLASS convention); ``x_scale`` fp32 ``[T, 1]`` (per token) or
  ``[1]`` (per tensor); ``w_scale`` fp32 ``[1, N]`` (per channel) or ``[1]``; optional
  ``bias [N]``.  ``y = (x_q @ w_q) * x_scale * w_scale + bias`` in fp32, cast to ``out_dtype``.
* ``int8_weight_only_mm``: ``x [T, K]`` (bf16/fp16/fp32), ``w_q [N, K]`` int8 row-major (the
  ``Linear.weight`` layout), ``w_scale [N]`` (per output channel); ``y = x @ (w_q * w_scale)^T
  + bias`` in x's dtype.

CPU paths, [M, 512] x [512, 1408], medians of 200 calls, one process (2 shared cores, noisy):

    M    bf16 F.linear   _int_mm w[N,K].t()   _int_mm w[K,N]   _weight_int8pack_mm   dequant+linear
    1        76 us            14 us               29 us             48 us               125 us
    8        78 us            36 us               33 us             89 us               145 us
    17       99 us            46 us               45 us            201 us               160 us
    64      245 us           138 us              120 us            678 us               312 us

So int8 x int8 uses ``torch._int_mm`` at every M (on this torch build the CPU kernel has no
M > 16 restriction; that restriction is CUDA's, where the Triton kernel runs instead).  Weight-only
uses ``_weight_int8pack_mm`` for small M and dequant + ``F.linear`` above
``WEIGHT_ONLY_PACKED_MAX_M``; ``_weight_int8pack_mm`` produced garbage / crashed on shapes with
K % 32 != 0 or N % 16 != 0 (torch 2.13 CPU), so those shapes always dequantize.  fp8 is a GPU
path: the CPU version upcasts to fp32 and exists for tests only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from framework.compat.ops import int_mm, weight_int8pack_mm
from framework.core.ops import define_op, if_installed

_TRITON = "passes.ops.triton.scaled_mm"

WEIGHT_ONLY_PACKED_MAX_M = 16
"""Largest token count for which the weight-only op uses ``_weight_int8pack_mm`` on CPU."""


def _epilogue(
    acc: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype
) -> Tensor:
    # int32 * fp32 promotes to fp32 in one kernel (no separate int->float pass)
    y = torch.mul(acc, x_scale).mul_(w_scale.reshape(1, -1) if w_scale.numel() > 1 else w_scale)
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


def int8_scaled_mm_torch(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor],
    out_dtype: torch.dtype,
) -> Tensor:
    """``(x_q @ w_q) * x_scale * w_scale + bias`` for int8 ``x_q [T,K]``, ``w_q [K,N]``."""
    if x_q.device.type == "cpu":
        acc = int_mm(x_q, w_q)
    else:  # oracle on devices without a kernel: exact in fp64 for K < 2**37 / 127**2
        acc = x_q.double() @ w_q.double()
    return _epilogue(acc, x_scale, w_scale, bias, out_dtype)


def fp8_scaled_mm_torch(
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor],
    out_dtype: torch.dtype,
) -> Tensor:
    """``(x_q @ w_q) * x_scale * w_scale + bias`` for float8_e4m3fn ``x_q [T,K]``,
    ``w_q [K,N]``."""
    return _epilogue(x_q.float() @ w_q.float(), x_scale, w_scale, bias, out_dtype)


def _packed_ok(x: Tensor, w_q: Tensor) -> bool:
    n, k = w_q.shape
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= WEIGHT_ONLY_PACKED_MAX_M
        and k % 32 == 0
        and n % 16 == 0
        and w_q.is_contiguous()
    )


def int8_weight_only_mm_torch(
    x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Optional[Tensor]
) -> Tensor:
    """``x @ (w_q * w_scale[:, None])^T + bias`` for int8 ``w_q [N, K]``; result in x's dtype."""
    if _packed_ok(x, w_q):
        y = weight_int8pack_mm(x.contiguous(), w_q, w_scale.to(x.dtype))
        if y is not None:
            return y if bias is None else y + bias
    w = w_q.to(x.dtype) * w_scale.to(x.dtype).unsqueeze(-1)
    return F.linear(x, w, bias)


def _check_mm(
    name: str,
    x_q: Tensor,
    x_scale: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor],
    qdtype: torch.dtype,
) -> None:
    if x_q.dtype != qdtype or w_q.dtype != qdtype:
        raise ValueError(f"{name}: x_q and w_q must be {qdtype}, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[0]:
        raise ValueError(
            f"{name}: expected x_q [T, K] and w_q [K, N], got {tuple(x_q.shape)} "
            f"and {tuple(w_q.shape)}"
        )
    n = w_q.shape[1]
    if x_scale.numel() != 1 and tuple(x_scale.shape) != (x_q.shape[0], 1):
        raise ValueError(
            f"{name}: x_scale must be [1] or [T, 1] = [{x_q.shape[0]}, 1], got "
            f"{tuple(x_scale.shape)}"
        )
    if w_scale.numel() != 1 and w_scale.numel() != n:
        raise ValueError(
            f"{name}: w_scale must be [1] or [1, N] = [1, {n}], got {tuple(w_scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{name}: bias must be [N] = [{n}], got {tuple(bias.shape)}")


def _int8_scaled_mm_fake(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor:
    _check_mm("piecewise::int8_scaled_mm", x_q, x_scale, w_q, w_scale, bias, torch.int8)
    return x_q.new_empty((x_q.shape[0], w_q.shape[1]), dtype=out_dtype)


def _fp8_scaled_mm_fake(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> Tensor:
    _check_mm("piecewise::fp8_scaled_mm", x_q, x_scale, w_q, w_scale, bias, torch.float8_e4m3fn)
    return x_q.new_empty((x_q.shape[0], w_q.shape[1]), dtype=out_dtype)


def _int8_weight_only_mm_fake(x, w_q, w_scale, bias) -> Tensor:
    name = "piecewise::int8_weight_only_mm"
    if w_q.dtype != torch.int8 or w_q.dim() != 2 or x.shape[-1] != w_q.shape[1]:
        raise ValueError(
            f"{name}: expected int8 w_q [N, K] with K = x.shape[-1] = "
            f"{x.shape[-1]}, got {w_q.dtype} {tuple(w_q.shape)}"
        )
    if w_scale.numel() != w_q.shape[0]:
        raise ValueError(
            f"{name}: w_scale must have N = {w_q.shape[0]} elements, got {tuple(w_scale.shape)}"
        )
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


def _cuda(name: str) -> Optional[str]:
    return if_installed("triton", f"{_TRITON}:{name}")


int8_scaled_mm = define_op(
    "piecewise::int8_scaled_mm", fake=_int8_scaled_mm_fake, cuda=_cuda("int8_scaled_mm")
)(int8_scaled_mm_torch)
fp8_scaled_mm = define_op(
    "piecewise::fp8_scaled_mm", fake=_fp8_scaled_mm_fake, cuda=_cuda("fp8_scaled_mm")
)(fp8_scaled_mm_torch)
int8_weight_only_mm = define_op(
    "piecewise::int8_weight_only_mm",
    fake=_int8_weight_only_mm_fake,
    cuda=_cuda("int8_weight_only_mm"),
)(int8_weight_only_mm_torch)
