"""Triton kernel for QK-norm + RoPE, in place on packed qkv.

Grid ``(T, Hq + Hkv)``: one program per (token, q-or-k head) holds the head's two rotation
halves in registers -- ``[0, D/2)`` and ``[D/2, D)`` for neox, even and odd lanes for GPT-J --
normalises over all D values, rotates, and writes back."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    cache_ptr,
    qkv_stride,
    cache_stride,
    num_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads first, then k heads (packed contiguously in qkv)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    if IS_NEOX:
        i1 = offs
        i2 = offs + half
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    base = qkv_ptr + tok * qkv_stride + head * HEAD_DIM
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    is_q = head < num_heads
    w1 = tl.where(
        is_q, tl.load(qw_ptr + i1, mask=mask, other=0.0), tl.load(kw_ptr + i1, mask=mask, other=0.0)
    ).to(tl.float32)
    w2 = tl.where(
        is_q, tl.load(qw_ptr + i2, mask=mask, other=0.0), tl.load(kw_ptr + i2, mask=mask, other=0.0)
    ).to(tl.float32)
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    x1 = x1 * rstd * w1
    x2 = x2 * rstd * w2
    pos = tl.load(pos_ptr + tok)
    cos = tl.load(cache_ptr + pos * cache_stride + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + half + offs, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(base + i1, o1.to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, o2.to(qkv_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
) -> None:
    if qkv.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            "triton qk_norm_rope: qkv and cos_sin_cache need a contiguous last "
            f"dimension, got strides {qkv.stride()} and {cos_sin_cache.stride()}"
        )
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    _qk_norm_rope_kernel[(tokens, num_heads + num_kv_heads)](
        qkv,
        positions.contiguous(),
        q_weight.contiguous(),
        k_weight.contiguous(),
        cos_sin_cache,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        num_heads,
        eps,
        HEAD_DIM=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        IS_NEOX=is_neox,
    )
