"""Triton kernels for row-wise activation ops: SiLU-and-mul and plain activation quant, each
optionally with a static or dynamic per-token quantized output.

One program per row, looping over the row in BLOCK chunks (rows can be wider than registers);
dynamic quant makes two passes: absmax first, then quantize (recomputing SiLU is cheaper than
a round trip through memory)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from passes.ops.triton.quant import MIN_DYNAMIC_SCALE, quant_params, quantize_values, rows_view

NO_QUANT, STATIC, DYNAMIC = 0, 1, 2


@triton.jit
def _row_values(x_ptr, row, x_stride, offs, mask, N, GATED: tl.constexpr):
    """fp32 values of one chunk: ``silu(gate) * up`` when GATED, else ``x``."""
    if GATED:
        g = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * x_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u
    return tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    N,
    x_stride,
    out_stride,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    base = tl.arange(0, BLOCK)
    if QUANT == 1:
        scale = tl.load(scale_ptr).to(tl.float32)
    elif QUANT == 2:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + base
            mask = offs < N
            absmax = tl.maximum(
                absmax, tl.abs(_row_values(x_ptr, row, x_stride, offs, mask, N, GATED))
            )
        scale = tl.maximum(tl.max(absmax, axis=0) / QMAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    for start in range(0, N, BLOCK):
        offs = start + base
        mask = offs < N
        y = _row_values(x_ptr, row, x_stride, offs, mask, N, GATED)
        if QUANT != 0:
            y = quantize_values(y, scale, IS_INT8, QMAX)
        tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(out, x, scale, gated: bool, quant: int, block: int = 1024) -> None:
    name = "triton silu_and_mul" if gated else "triton activation quant"
    x2, o2 = rows_view(x, name), rows_view(out, name)
    rows, n = o2.shape
    if rows == 0:
        return
    if quant == DYNAMIC and not scale.is_contiguous():
        raise ValueError(f"{name}: scales must be contiguous [T, 1], got strides {scale.stride()}")
    qp = quant_params(out) if quant != NO_QUANT else dict(IS_INT8=False, QMAX=1.0)
    _row_kernel[(rows,)](
        x2,
        o2,
        scale if scale is not None else x2,
        n,
        x2.stride(0),
        o2.stride(0),
        BLOCK=min(block, triton.next_power_of_2(n)),
        GATED=gated,
        QUANT=quant,
        MIN_SCALE=MIN_DYNAMIC_SCALE,
        **qp,
    )


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    _launch(out, x, None, True, NO_QUANT)


def silu_and_mul_static_quant(out, x, scale) -> None:
    _launch(out, x, scale, True, STATIC)


def silu_and_mul_dynamic_quant(out, x, scales) -> None:
    _launch(out, x, scales, True, DYNAMIC)


def static_scaled_quant(out, x, scale) -> None:
    _launch(out, x, scale, False, STATIC)


def dynamic_per_token_quant(out, x, scales) -> None:
    _launch(out, x, scales, False, DYNAMIC)
