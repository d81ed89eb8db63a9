"""Fuse a residual add and the RMSNorm of its result into ``piecewise::fused_add_rms_norm``.

Before (bf16; ``eps`` any value)::

    add = aten.add.Tensor(x, residual)
    f32 = prims.convert_element_type(add, float32)
    var = aten.mean.dim(aten.pow.Tensor_Scalar(f32, 2), [-1], True)
    h   = aten.mul.Tensor(f32, aten.rsqrt(aten.add.Tensor(var, eps)))
    out = aten.mul.Tensor(weight, prims.convert_element_type(h, bfloat16))
    -> uses of (out, add)

After::

    af  = auto_functionalized(piecewise.fused_add_rms_norm, x=x, residual=residual,
                              weight=weight, eps=eps)
    -> uses of (af[1], af[2])        # af[1]: normalised x, af[2]: new residual

The fused op rounds once (fp32 norm * weight, then cast) where the model rounds twice; the
difference is one bf16 rounding.
"""

from __future__ import annotations

from typing import Iterable

import torch

import passes.ops.norm  # noqa: F401  (registers piecewise::fused_add_rms_norm)
from passes.fusion_patterns import EPS_DUMMY, rms_norm_hf
from passes.pattern_fusion import FusionPattern, PatternFusionPass, call_mutating, float_dtypes
from passes.registry import register_pass


def add_rms_pattern(x, residual, weight, eps):
    r = x + residual
    return rms_norm_hf(r, weight, eps), r


def add_rms_replacement(x, residual, weight, eps):
    out, r = call_mutating(
        torch.ops.piecewise.fused_add_rms_norm.default,
        x=x,
        residual=residual,
        weight=weight,
        eps=eps,
    )
    return out, r


# GPU from O2; CPU only at O3 (neutral against Inductor's own fusion).
@register_pass(
    "fuse_add_rmsnorm",
    after=("noop_elimination", "sequence_parallelism", "fuse_allreduce_rmsnorm"),
    levels={"cpu": 3, "cuda": 2},
    fusion=True,
)
class FuseAddRMSNormPass(PatternFusionPass):
    __doc__ = __doc__

    def patterns(self) -> Iterable[FusionPattern]:
        for dtype in float_dtypes(self.context):

            def inputs(dtype=dtype):
                return [
                    torch.randn(5, 16, dtype=dtype),
                    torch.randn(5, 16, dtype=dtype),
                    torch.randn(16, dtype=dtype),
                ]

            yield FusionPattern(
                f"add_rmsnorm_{dtype}",
                add_rms_pattern,
                add_rms_replacement,
                inputs,
                scalars={"eps": EPS_DUMMY},
            )
