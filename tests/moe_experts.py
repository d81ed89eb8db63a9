"""Stacked MoE experts for the packed-experts tests: random bf16 routing inputs and expert
stacks, a module with the stacked-experts protocol (``w13``, ``w2``, ``moe_method``), and
packing it for the small-M kernel."""

from __future__ import annotations

import torch

from passes import small_m_linear as small_m
from passes.ops.moe import topk_softmax_torch
from passes.ops.packed_moe import PackedExpertsMethod


def make(t, experts=6, k=2, inter=72, seed=0, weights_dtype=torch.bfloat16, hidden=64):
    """``(x, routing weights, expert ids, w13, w2)`` for ``t`` tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    logits = torch.randn(t, experts, generator=g)
    w13 = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=g)).bfloat16()
    w2 = (0.1 * torch.randn(experts, hidden, inter, generator=g)).bfloat16()
    weights, ids = topk_softmax_torch(logits, k, True)
    return x, weights.to(weights_dtype), ids, w13, w2


class Experts(torch.nn.Module):
    """The stacked-experts protocol (``w13``, ``w2``, ``moe_method``)."""

    def __init__(self, w13, w2):
        super().__init__()
        self.w13 = torch.nn.Parameter(w13.clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(w2.clone(), requires_grad=False)
        self.moe_method = None

    def forward(self, x, weights, ids):
        return self.moe_method.apply(self, x, weights, ids)


def packed(w13, w2, max_rows=small_m.DEFAULT_MAX_ROWS, layouts=None):
    """An :class:`Experts` of these stacks, packed by :class:`PackedExpertsMethod`."""
    m = Experts(w13, w2)
    assert PackedExpertsMethod.applies_to(m, max_rows)
    method = PackedExpertsMethod(max_rows)
    method.process(m, layouts)
    m.moe_method = method
    return m
