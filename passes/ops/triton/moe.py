"""Grouped-GEMM mixture of experts in Triton (the CUDA kernel of ``piecewise::fused_moe``).

Host side (torch, on the device): the ``T*K`` (token, slot) pairs are sorted by expert and
each expert's run is padded to a multiple of ``BLOCK_M`` (:func:`align_by_expert`), so every
``BLOCK_M`` block of the sorted list belongs to one expert.  Every size is static (a bound
from ``T``, ``K`` and ``E``; the blocks past the last expert's are skipped), so the op runs
inside CUDA-graph captures: the MoE op sits inside the piecewise graphs. One kernel,
:func:`_moe_gemm_kernel`, then computes ``C[slot] = A[row(slot)] @ W[e]^T`` for every block
(program (m, n): block m of the sorted slots, columns n of the output), reading only the
weights of the experts that are hit:

    stage 1  h1[T*K, 2I] = x[slot // K] @ w13[e]^T          (A rows: tokens)
             h [T*K, I]  = silu(h1[:, :I]) * h1[:, I:]      (piecewise::silu_and_mul)
    stage 2  h2[T*K, H]  = (h[slot] @ w2[e]^T) * weight[slot]  (A rows: slots)
    out[T, H] = sum over the K slots of each token (fp32), cast to x.dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from passes.ops.triton.scaled_mm import dot_precision

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    N,
    K,
    num_slots,
    top_k,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    s_cm,
    s_cn,
    A_PER_SLOT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a padding block past the last expert's (static grid): nothing to do
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    if A_PER_SLOT:
        rows = slots
    else:
        rows = slots // top_k
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rows[:, None] * s_am + kk[None, :] * s_ak,
            mask=valid[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * s_be + kk[:, None] * s_bk + rn[None, :] * s_bn,
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(a, b, out_dtype=tl.float32, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + slots[:, None] * s_cm + rn[None, :] * s_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (rn[None, :] < N),
    )


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the ``block_m`` blocks :func:`align_by_expert` fills: at most
    ``min(E, T*K)`` experts are hit and each pads by fewer than ``block_m`` slots."""
    hit = min(num_experts, num_slots)
    return (num_slots + hit * (block_m - 1)) // block_m


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted slot ids padded per expert to ``block_m`` with the sentinel ``T*K``, the
    expert of each ``block_m`` block, -1 for the blocks past the last expert's).

    Sizes depend on ``T``, ``K`` and ``E`` alone (:func:`max_blocks`), and nothing is read
    back to the host (no ``.item()``, ``bincount`` or ``repeat_interleave`` with tensor
    repeats): the op runs inside a CUDA-graph capture, where a host sync is an error."""
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat.long(), torch.ones(num_slots, dtype=torch.int64, device=dev))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # one past each expert's last block
    starts = (block_end - blocks) * block_m  # first padded position of each expert
    firsts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order].long()
    rank = torch.arange(num_slots, device=dev) - firsts[experts_sorted]
    n_blocks = max_blocks(num_slots, num_experts, block_m)
    sorted_ids = torch.full((n_blocks * block_m,), num_slots, dtype=torch.int32, device=dev)
    sorted_ids[starts[experts_sorted] + rank] = order.to(torch.int32)
    # block b belongs to the expert whose block range holds it: the count of ends <= b
    owner = torch.searchsorted(block_end, torch.arange(n_blocks, device=dev), right=True)
    expert_ids = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_ids, expert_ids


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    top_k: int,
    a_per_slot: bool,
    mul_weight: bool,
) -> None:
    """``out[slot] = a[row(slot)] @ w[expert]^T (* weight[slot])`` for every sorted slot;
    ``w [E, N, K]``, ``out [T*K, N]``."""
    E, N, K = w.shape
    grid = (expert_ids.numel(), triton.cdiv(N, BLOCK_N))
    if grid[0] == 0:
        return
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        N,
        K,
        out.shape[0],
        top_k,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        A_PER_SLOT=a_per_slot,
        MUL_WEIGHT=mul_weight,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The ``piecewise::fused_moe`` CUDA kernel (see the module docstring)."""
    T, top_k = topk_ids.shape
    E, two_i, H = w13.shape
    sorted_ids, expert_ids = align_by_expert(topk_ids, E, BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()
    h1 = torch.empty((T * top_k, two_i), dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, h1, weights, sorted_ids, expert_ids, top_k, False, False)
    h = torch.empty((T * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    torch.ops.piecewise.silu_and_mul(h, h1)
    h2 = torch.empty((T * top_k, H), dtype=torch.float32, device=x.device)
    moe_gemm(h, w2, h2, weights, sorted_ids, expert_ids, top_k, True, True)
    return h2.view(T, top_k, H).sum(dim=1).to(x.dtype)
