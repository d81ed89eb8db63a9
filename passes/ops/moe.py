"""Mixture-of-experts ops: the router's top-k softmax and the fused expert computation.

Shapes: T tokens, H hidden size, E experts, K experts per token, I expert intermediate size
(this rank's slice under tensor parallelism).

    piecewise::topk_softmax(logits [T, E], top_k: int, renormalize: bool)
        -> (weights [T, K] fp32, ids [T, K] int64)
        softmax over experts in fp32, the top k, optionally renormalised to sum to 1
    piecewise::fused_moe(x [T, H], topk_weights [T, K], topk_ids [T, K], w13 [E, 2I, H],
                         w2 [E, H, I]) -> [T, H] of x.dtype
        out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]
        w13[e] holds expert e's gate rows then its up rows (the Linear layout, ``[out, in]``)

Arithmetic follows transformers' expert loop so fp32 tokens match: per expert, the gate-up
and down GEMMs in ``x.dtype``, the product with the routing weight in fp32 rounded to
``x.dtype``, and the contributions summed into a ``x.dtype`` accumulator in ascending expert
order.

Kernels:
- :func:`fused_moe_reference`, the test oracle: every expert over every token, masked by its
  routing weight (a per-expert loop that never groups tokens);
- ``passes.ops.triton.moe.fused_moe`` (CUDA): a Triton grouped GEMM over the (token, slot)
  pairs sorted by expert and padded per expert to the block size;
- :func:`fused_moe_grouped` (CPU and the default): tokens grouped by expert
  (:func:`combine_by_expert`: in Python for the few slots of a decode step, sorted with tensor
  ops for prefill), then per expert that is hit one gate-up GEMM over its rows, SiLU-mul, one
  down GEMM, scaled and added.  At batch 1 only the top-k experts' weights are read; the GEMMs
  are plain ``F.linear`` on the stacked weights (oneDNN/MKL, threaded by torch's intra-op
  pool);
- ``piecewise::fused_moe_packed`` (:mod:`passes.ops.packed_moe`, bf16 CPU): the same
  grouping on expert weights re-laid out once for the small-M kernel.

``fused_moe`` is an ordinary op inside a piece, not a splitting op: the fake implementation
returns ``[T, H]`` for a symbolic ``T``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from framework.core.ops import define_op, if_installed
from passes.ops.quant_utils import per_token_scales, quantize
from passes.ops.scaled_mm import int8_scaled_mm_torch, int8_weight_only_mm_torch


def topk_softmax_torch(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The router as the models write it: ``softmax(fp32) -> topk -> (/ sum)``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _topk_softmax_fake(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"piecewise::topk_softmax: logits must be [T, E], got {logits.shape}")
    shape = (logits.shape[0], top_k)
    return (
        logits.new_empty(shape, dtype=torch.float32),
        logits.new_empty(shape, dtype=torch.int64),
    )


def _topk_softmax_impl(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    weights, ids = topk_softmax_torch(logits, top_k, renormalize)
    return weights.contiguous(), ids.contiguous()


topk_softmax = define_op("piecewise::topk_softmax", fake=_topk_softmax_fake)(_topk_softmax_impl)


def _check(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> None:
    name = "piecewise::fused_moe"
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{name}: expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    E, two_i, H = w13.shape
    if x.shape[1] != H or tuple(w2.shape) != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"{name}: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"{name}: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [T, K]"
        )


def _expert(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert on its rows: ``x [M, H] -> [M, H]`` in ``x.dtype``."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def fused_moe_reference(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor
) -> Tensor:
    """Oracle: every expert over every token, weighted by its (possibly zero) routing weight."""
    _check(x, topk_weights, topk_ids, w13, w2)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        hit = topk_ids == e  # [T, K]
        rows = hit.any(dim=-1)  # [T]
        if not bool(rows.any()):
            continue
        weight = (topk_weights.float() * hit).sum(dim=-1, keepdim=True)  # [T, 1]
        contrib = (_expert(x, w13[e], w2[e]).float() * weight).to(x.dtype)
        out = out + contrib * rows.unsqueeze(-1).to(x.dtype)
    return out


DIRECT_MAX_SLOTS = 64
"""Up to this many (token, expert) slots (``T * K``: a decode step) the experts' rows are
grouped in Python from the ids read once (``tolist``); more (prefill) sort the slots by expert
with tensor ops (``argsort``, ``bincount``).  Both give the same result, bit for bit."""


def combine_by_expert(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert: Callable[[int, Tensor], Tensor],
    direct_max_slots: int = DIRECT_MAX_SLOTS,
) -> Tensor:
    """``out[t] = sum_k w[t, k] * expert(ids[t, k], x[t])`` over the experts hit, each called
    once on all its rows (``expert(e, rows [n, H]) -> [n, H]`` in ``x.dtype``).

    The arithmetic every CPU MoE kernel shares (the module docstring's): each contribution is
    ``(y.float() * w).to(x.dtype)``, added into a ``x.dtype`` accumulator in ascending expert
    order.  Up to ``direct_max_slots`` slots the grouping is plain Python over the ids read once
    (at batch 1: no sort, no index tensors, the K contributions added directly); more slots
    sort by expert with tensor ops."""
    T, K = topk_ids.shape
    if T == 0:
        return torch.zeros_like(x)
    if T * K <= direct_max_slots:
        return _combine_direct(x, topk_weights, topk_ids, expert)
    return _combine_sorted(x, topk_weights, topk_ids, expert)


_ONE_ROUNDING = (torch.float32, torch.bfloat16, torch.float16)


def _scaled(y: Tensor, w, dtype: torch.dtype) -> Tensor:
    """``(y.float() * w).to(dtype)`` for ``y`` of ``dtype``; ``w`` a Python float (an fp32
    value) or an fp32 column.  ``y`` of these dtypes times a Python scalar computes in fp32
    and rounds once, so that case is one op."""
    if isinstance(w, float) and y.dtype in _ONE_ROUNDING:
        return y.mul(w)
    return y.float().mul(w).to(dtype)


def _combine_direct(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, expert) -> Tensor:
    T = topk_ids.shape[0]
    groups: dict[int, tuple[list[int], list[float]]] = {}
    for t, (ids, ws) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for e, w in zip(ids, ws):
            g = groups.get(e)
            if g is None:
                groups[e] = g = ([], [])
            g[0].append(t)
            g[1].append(w)
    if T == 1 and all(len(rows) == 1 for rows, _ in groups.values()):
        # one token, distinct experts: the sum of K contributions, in expert order
        # (0 + c == c exactly, so the first contribution is the accumulator)
        out = None
        for e in sorted(groups):
            c = _scaled(expert(e, x), groups[e][1][0], x.dtype)
            out = c if out is None else out.add_(c)
        return out
    out = torch.zeros_like(x)
    for e in sorted(groups):
        rows, ws = groups[e]
        if len(rows) == 1:
            t = rows[0]
            out[t : t + 1].add_(_scaled(expert(e, x[t : t + 1]), ws[0], x.dtype))
            continue
        index = torch.tensor(rows)
        y = expert(e, x.index_select(0, index))
        c = _scaled(y, torch.tensor(ws, dtype=torch.float32).unsqueeze(-1), x.dtype)
        if len(set(rows)) == len(rows):
            # distinct rows: gather, add, write back; the sums of index_add_, ~3x cheaper here
            out.index_copy_(0, index, out.index_select(0, index).add_(c))
        else:  # a token that lists one expert twice
            out.index_add_(0, index, c)
    return out


def _combine_sorted(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, expert) -> Tensor:
    K = topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) slots grouped by expert
    counts = torch.bincount(flat).tolist()
    rows_all = order // K
    weights_all = topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = rows_all[start : start + n]
        y = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, _scaled(y, weights_all[start : start + n], x.dtype))
        start += n
    return out


def fused_moe_grouped(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor
) -> Tensor:
    """Tokens grouped by expert; one gate-up GEMM, SiLU-mul and down GEMM per expert hit."""
    _check(x, topk_weights, topk_ids, w13, w2)
    return combine_by_expert(x, topk_weights, topk_ids, lambda e, xs: _expert(xs, w13[e], w2[e]))


def _fused_moe_fake(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor
) -> Tensor:
    _check(x, topk_weights, topk_ids, w13, w2)
    return torch.empty_like(x)


fused_moe = define_op(
    "piecewise::fused_moe",
    fake=_fused_moe_fake,
    cuda=if_installed("triton", "passes.ops.triton.moe:fused_moe"),
)(fused_moe_grouped)


# --- int8 experts ---------------------------------------------------------------------------
#
#   piecewise::fused_moe_int8(x, topk_weights, topk_ids, w13_q [E, 2I, H] int8,
#                             w13_scale [E, 2I] fp32, w2_q [E, H, I] int8, w2_scale [E, H] fp32,
#                             quantize_activations: bool) -> [T, H] of x.dtype
#
# Weights are int8 per output channel.  ``quantize_activations``: each GEMM's input is
# quantized per token (W8A8, ``torch._int_mm``); else the GEMMs run in ``x.dtype`` on the
# weights dequantized (weight-only; ``_weight_int8pack_mm`` for small M).  Only the experts
# that are hit are touched, as in the float kernel.


def _check_int8(x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale) -> None:
    _check(x, topk_weights, topk_ids, w13_q, w2_q)
    if w13_q.dtype != torch.int8 or w2_q.dtype != torch.int8:
        raise ValueError(
            f"piecewise::fused_moe_int8: weights must be int8, got {w13_q.dtype}, {w2_q.dtype}"
        )
    if tuple(w13_scale.shape) != tuple(w13_q.shape[:2]) or tuple(w2_scale.shape) != tuple(
        w2_q.shape[:2]
    ):
        raise ValueError(
            f"piecewise::fused_moe_int8: scales {tuple(w13_scale.shape)}, "
            f"{tuple(w2_scale.shape)} must be [E, 2I] and [E, H]"
        )


def _int8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, quantize_activations: bool) -> Tensor:
    """``x [M, K] @ dequant(w_q [N, K], w_scale [N])^T`` in ``x.dtype``."""
    if not quantize_activations:
        return int8_weight_only_mm_torch(x, w_q, w_scale.to(x.dtype), None)
    s = per_token_scales(x, torch.int8)
    return int8_scaled_mm_torch(quantize(x, s, torch.int8), s, w_q.t(), w_scale, None, x.dtype)


def fused_moe_int8_grouped(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13_q: Tensor,
    w13_scale: Tensor,
    w2_q: Tensor,
    w2_scale: Tensor,
    quantize_activations: bool,
) -> Tensor:
    _check_int8(x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale)

    def expert(e: int, xs: Tensor) -> Tensor:
        h = _int8_linear(xs, w13_q[e], w13_scale[e], quantize_activations)
        gate, up = h.chunk(2, dim=-1)
        return _int8_linear(F.silu(gate) * up, w2_q[e], w2_scale[e], quantize_activations)

    return combine_by_expert(x, topk_weights, topk_ids, expert)


def fused_moe_int8_reference(
    x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale, quantize_activations
) -> Tensor:
    """Oracle: every expert in fp32 on dequantized weights (and fake-quantized inputs)."""

    def fq(a: Tensor) -> Tensor:
        if not quantize_activations:
            return a.float()
        s = per_token_scales(a, torch.int8)
        return quantize(a, s, torch.int8).float() * s

    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w13_q.shape[0]):
        hit = topk_ids == e
        if not bool(hit.any()):
            continue
        weight = (topk_weights.float() * hit).sum(dim=-1, keepdim=True)
        w13 = w13_q[e].float() * w13_scale[e].float().unsqueeze(-1)
        w2 = w2_q[e].float() * w2_scale[e].float().unsqueeze(-1)
        gate, up = F.linear(fq(x), w13).chunk(2, dim=-1)
        out += weight * F.linear(fq(F.silu(gate) * up), w2)
    return out.to(x.dtype)


def _fused_moe_int8_fake(
    x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale, quantize_activations
) -> Tensor:
    _check_int8(x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale)
    return torch.empty_like(x)


fused_moe_int8 = define_op("piecewise::fused_moe_int8", fake=_fused_moe_int8_fake)(
    fused_moe_int8_grouped
)
