"""Fuse a MoE router's softmax, top-k and renormalisation into ``piecewise::topk_softmax``.

Matched form (``passes.ops.moe.topk_softmax_torch``, as ``models.moe.SparseMoeBlock`` writes
it; bf16 logits get a ``convert_element_type`` to fp32 first)::

    f32     = prims.convert_element_type(logits, float32)      # bf16/fp16 models only
    amax    = aten.amax(f32, [-1], True)
    e       = aten.exp(aten.sub.Tensor(f32, amax))
    probs   = aten.div.Tensor(e, aten.sum.dim_IntList(e, [-1], True))
    topk    = aten.topk(probs, top_k, -1)
    weights = aten.div.Tensor(topk[0], aten.sum.dim_IntList(topk[0], [-1], True))
                                                                # renormalising routers only
    -> uses of (weights, topk[1])

After::

    r = piecewise.topk_softmax(logits, top_k, renormalize)
    -> uses of (r[0], r[1])

``top_k`` is a pattern wildcard; the renormalising form is registered first so it wins over
the plain one it contains.  The op's CPU kernel is the same plain-torch arithmetic (one op
call instead of ~8 aten nodes; results are bit-identical), so the pass is not on by default on
CPU; it is where a GPU top-k-softmax kernel plugs in.
"""

from __future__ import annotations

from typing import Iterable

import torch

import passes.ops.moe  # noqa: F401  (registers piecewise::topk_softmax)
from passes.ops.moe import topk_softmax_torch
from passes.pattern_fusion import FusionPattern, PatternFusionPass, float_dtypes
from passes.registry import register_pass

TOP_K_DUMMY = 3
"""Trace value of ``top_k``: a wildcard, so it must differ from every other integer in the
traced pattern (the dim -1, the example's 7 tokens and 13 experts)."""


def _pattern(renormalize: bool):
    def pattern(logits, top_k):
        return topk_softmax_torch(logits, top_k, renormalize)

    def replacement(logits, top_k):
        weights, ids = torch.ops.piecewise.topk_softmax.default(logits, top_k, renormalize)
        return weights, ids

    return pattern, replacement


@register_pass(
    "fuse_moe_router",
    after=("noop_elimination",),
    levels={"cpu": 3, "cuda": 2},
    fusion=True,
)
class FuseMoERouterPass(PatternFusionPass):
    __doc__ = __doc__

    def patterns(self) -> Iterable[FusionPattern]:
        for dtype in float_dtypes(self.context):
            for renormalize in (True, False):
                pattern, replacement = _pattern(renormalize)

                def inputs(dtype=dtype):
                    return [torch.randn(7, 13, dtype=dtype)]

                yield FusionPattern(
                    f"moe_router_{'renorm_' if renormalize else ''}{dtype}",
                    pattern,
                    replacement,
                    inputs,
                    scalars={"top_k": TOP_K_DUMMY},
                )
