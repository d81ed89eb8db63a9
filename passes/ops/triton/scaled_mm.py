"""One tiled Triton matmul for the three quantized linears: int8 x int8 (int32 accumulate),
fp8 x fp8 (fp32 accumulate), and weight-only int8 (weights upcast to the activation dtype in
registers, so the int8 weight is read from memory once).  Scales and bias are applied in the
epilogue in fp32."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

SCALE_NONE, SCALE_SCALAR, SCALE_VECTOR = 0, 1, 2


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for activations of ``dtype``: exact fp32 products
    ("ieee") for fp32, as torch's matmul gives by default (TF32 would round the activations
    to 10 mantissa bits and an fp32 model would drift from transformers); the tensor-core
    default ("tf32", which only concerns fp32 inputs) for every other dtype."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_bk,
    s_bn,
    s_cm,
    s_cn,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC_INT32: tl.constexpr,
    UPCAST_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if ACC_INT32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak,
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * s_bk + rn[None, :] * s_bn,
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if UPCAST_B:
            b = b.to(a.dtype)
        if ACC_INT32:
            acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32, input_precision=DOT_PRECISION)
    y = acc.to(tl.float32)
    if A_SCALE == 1:
        y = y * tl.load(a_scale_ptr).to(tl.float32)
    elif A_SCALE == 2:
        y = y * tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0).to(tl.float32)[:, None]
    if B_SCALE == 1:
        y = y * tl.load(b_scale_ptr).to(tl.float32)
    elif B_SCALE == 2:
        y = y * tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn,
        y.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _scale_mode(scale: Optional[torch.Tensor]) -> int:
    if scale is None:
        return SCALE_NONE
    return SCALE_SCALAR if scale.numel() == 1 else SCALE_VECTOR


def _launch(
    a, b, a_scale, b_scale, bias, out_dtype, acc_int32, upcast_b, block_k: int = 64
) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides) with the scaled epilogue."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    for label, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s is not None and s.numel() > 1 and not s.is_contiguous():
            raise ValueError(
                f"triton scaled_mm: {label} must be contiguous, got strides {s.stride()}"
            )
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_mm_kernel[grid](
        a,
        b,
        c,
        a_scale if a_scale is not None else c,
        b_scale if b_scale is not None else c,
        bias if bias is not None else c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        A_SCALE=_scale_mode(a_scale),
        B_SCALE=_scale_mode(b_scale),
        HAS_BIAS=bias is not None,
        ACC_INT32=acc_int32,
        UPCAST_B=upcast_b,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return c


def int8_scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    return _launch(x_q, w_q, x_scale, w_scale, bias, out_dtype, True, False)


def fp8_scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    return _launch(x_q, w_q, x_scale, w_scale, bias, out_dtype, False, False)


def int8_weight_only_mm(x, w_q, w_scale, bias) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    y = _launch(x2, w_q.t(), None, w_scale, bias, x.dtype, False, True)
    return y.view(*x.shape[:-1], w_q.shape[0])
