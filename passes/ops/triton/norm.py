"""One Triton kernel for the RMSNorm family: optional residual add, optional static or dynamic
quantized output.  One program per row; the whole row sits in registers (BLOCK >= hidden)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from passes.ops.triton.quant import MIN_DYNAMIC_SCALE, quant_params, quantize_values, rows_view

NO_QUANT, STATIC, DYNAMIC = 0, 1, 2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    H,
    x_stride,
    res_stride,
    out_stride,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        # add in fp32 and round once to the input dtype: what eager `x + residual` does
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + offs, h, mask=mask)
        hf = h.to(tl.float32)
    else:
        hf = x.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = hf * (1.0 / tl.sqrt_rn(var + eps)) * w
    if QUANT == 0:
        tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if QUANT == 1:
            scale = tl.load(scale_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / QMAX, MIN_SCALE)
            tl.store(scale_ptr + row, scale)
        q = quantize_values(y, scale, IS_INT8, QMAX)
        tl.store(out_ptr + row * out_stride + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(out, x, residual, weight, scale, eps, quant):
    name = "triton rms_norm"
    x2, o2 = rows_view(x, name), rows_view(out, name)
    r2 = rows_view(residual, name) if residual is not None else x2
    rows, hidden = x2.shape
    qp = quant_params(out) if quant != NO_QUANT else dict(IS_INT8=False, QMAX=1.0)
    if rows == 0:
        return
    if quant == DYNAMIC and not scale.is_contiguous():
        raise ValueError(f"{name}: scales must be contiguous [T, 1], got strides {scale.stride()}")
    _rms_norm_kernel[(rows,)](
        x2,
        r2,
        weight,
        o2,
        scale if scale is not None else x2,
        hidden,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        eps,
        BLOCK=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
        QUANT=quant,
        MIN_SCALE=MIN_DYNAMIC_SCALE,
        **qp,
    )


def rms_norm(out, x, weight, eps: float) -> None:
    _launch(out, x, None, weight, None, eps, NO_QUANT)


def fused_add_rms_norm(x, residual, weight, eps: float) -> None:
    _launch(x, x, residual, weight, None, eps, NO_QUANT)


def rms_norm_static_quant(out, x, weight, scale, eps: float) -> None:
    _launch(out, x, None, weight, scale, eps, STATIC)


def fused_add_rms_norm_static_quant(out, x, residual, weight, scale, eps: float) -> None:
    _launch(out, x, residual, weight, scale, eps, STATIC)


def rms_norm_dynamic_quant(
    out, x, weight, scales, eps: float, residual: Optional[torch.Tensor]
) -> None:
    _launch(out, x, residual, weight, scales, eps, DYNAMIC)
