"""Fuse RMSNorm (plain or with the residual add) and the activation quant that follows it.

A quantized linear emits ``static_scaled_quant`` (per-tensor scale) or
``dynamic_per_token_quant`` before its scaled matmul; when its input is an RMSNorm, norm and
quant become one op that never writes the bf16 normalised activation.  Matched forms of the
norm: the decomposed HF RMSNorm, the decomposed add + RMSNorm, ``piecewise.rms_norm`` and
``piecewise.fused_add_rms_norm`` (so the pass works with or after ``fuse_add_rmsnorm``).

Before (dynamic per-token int8 or fp8; after ``fuse_add_rmsnorm``)::

    af  = auto_functionalized(piecewise.fused_add_rms_norm, x=x, residual=res, weight=w, eps=e)
    q   = auto_functionalized(piecewise.dynamic_per_token_quant, out=empty, x=af[1],
                              scales=empty_1)
    -> uses of (q[1], q[2], af[2])

After::

    f   = auto_functionalized(piecewise.rms_norm_dynamic_quant, out=empty, x=x, weight=w,
                              scales=empty_1, eps=e, residual=res)
    -> uses of (f[1], f[2], f[3])

Static scales map to ``rms_norm_static_quant`` / ``fused_add_rms_norm_static_quant``.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch

import passes.ops.activation_quant  # noqa: F401  (registers the quant ops)
import passes.ops.norm  # noqa: F401  (registers the norm ops)
from passes.fusion_patterns import EPS_DUMMY, quant_buffers, rms_norm_hf
from passes.pattern_fusion import FusionPattern, PatternFusionPass, call_mutating, float_dtypes
from passes.registry import register_pass

ops = torch.ops.piecewise


def _static_quant(h, out, scale):
    return call_mutating(ops.static_scaled_quant.default, out=out, x=h, scale=scale)[0]


def _dynamic_quant(h, out, scales):
    return call_mutating(ops.dynamic_per_token_quant.default, out=out, x=h, scales=scales)


# --- the norm forms (``*_op``: the piecewise op, ``norm_out`` its output buffer) -----------


def _norm_op(x, weight, eps, norm_out):
    return call_mutating(ops.rms_norm.default, out=norm_out, x=x, weight=weight, eps=eps)[0]


def _add_norm_decomposed(x, residual, weight, eps):
    r = x + residual
    return rms_norm_hf(r, weight, eps), r


def _add_norm_op(x, residual, weight, eps):
    return call_mutating(
        ops.fused_add_rms_norm.default, x=x, residual=residual, weight=weight, eps=eps
    )


# --- patterns and replacements ---------------------------------------------------------------


def rms_static_pattern(x, weight, out, scale, eps):
    return _static_quant(rms_norm_hf(x, weight, eps), out, scale)


def rms_dynamic_pattern(x, weight, out, scales, eps):
    return _dynamic_quant(rms_norm_hf(x, weight, eps), out, scales)


def rms_op_static_pattern(x, weight, out, scale, eps, norm_out):
    return _static_quant(_norm_op(x, weight, eps, norm_out), out, scale)


def rms_op_dynamic_pattern(x, weight, out, scales, eps, norm_out):
    return _dynamic_quant(_norm_op(x, weight, eps, norm_out), out, scales)


def static_replacement(x, weight, out, scale, eps):
    return call_mutating(
        ops.rms_norm_static_quant.default, out=out, x=x, weight=weight, scale=scale, eps=eps
    )[0]


def dynamic_replacement(x, weight, out, scales, eps):
    q, s, _ = call_mutating(
        ops.rms_norm_dynamic_quant.default,
        out=out,
        x=x,
        weight=weight,
        scales=scales,
        eps=eps,
        residual=None,
    )
    return q, s


def op_static_replacement(x, weight, out, scale, eps, norm_out):
    return static_replacement(x, weight, out, scale, eps)  # norm_out is no longer needed


def op_dynamic_replacement(x, weight, out, scales, eps, norm_out):
    return dynamic_replacement(x, weight, out, scales, eps)


def _with_add(add_norm):
    def static_pattern(x, residual, weight, out, scale, eps):
        h, r = add_norm(x, residual, weight, eps)
        return _static_quant(h, out, scale), r

    def dynamic_pattern(x, residual, weight, out, scales, eps):
        h, r = add_norm(x, residual, weight, eps)
        q, s = _dynamic_quant(h, out, scales)
        return q, s, r

    return static_pattern, dynamic_pattern


def add_static_replacement(x, residual, weight, out, scale, eps):
    return call_mutating(
        ops.fused_add_rms_norm_static_quant.default,
        out=out,
        x=x,
        residual=residual,
        weight=weight,
        scale=scale,
        eps=eps,
    )


def add_dynamic_replacement(x, residual, weight, out, scales, eps):
    return call_mutating(
        ops.rms_norm_dynamic_quant.default,
        out=out,
        x=x,
        weight=weight,
        scales=scales,
        eps=eps,
        residual=residual,
    )


def _example_inputs(dtype: torch.dtype, static: bool, add: bool, norm_op: bool) -> list:
    x = torch.randn(5, 16, dtype=dtype)
    out, scales = quant_buffers(x)
    inputs = [x, torch.randn(5, 16, dtype=dtype)] if add else [x]
    inputs += [torch.randn(16, dtype=dtype), out, torch.ones(1) if static else scales]
    return inputs + [torch.empty_like(x)] if norm_op else inputs


# GPU: a Triton kernel backs the fused op, so it is on from O1. CPU: no faster kernel than
# Inductor's own fusion (O2 bf16 int8_per_token decode: 8.80 ms with the quant fusions, 7.44 ms
# without), so only O3 (experimental) runs it. It sees fuse_add_rmsnorm's fused op.
@register_pass(
    "fuse_rmsnorm_quant", after=("fuse_add_rmsnorm",), levels={"cpu": 3, "cuda": 1}, fusion=True
)
class FuseRMSNormQuantPass(PatternFusionPass):
    __doc__ = __doc__

    def patterns(self) -> Iterable[FusionPattern]:
        scalars = {"eps": EPS_DUMMY}
        for dtype in float_dtypes(self.context):
            # Larger patterns first: add+norm+quant must win over norm+quant on the same quant.
            for form, add_norm in (("decomposed", _add_norm_decomposed), ("op", _add_norm_op)):
                static_p, dynamic_p = _with_add(add_norm)
                yield FusionPattern(
                    f"add_rmsnorm_{form}_static_quant_{dtype}",
                    static_p,
                    add_static_replacement,
                    partial(_example_inputs, dtype, True, True, False),
                    scalars,
                )
                yield FusionPattern(
                    f"add_rmsnorm_{form}_dynamic_quant_{dtype}",
                    dynamic_p,
                    add_dynamic_replacement,
                    partial(_example_inputs, dtype, False, True, False),
                    scalars,
                )
            for form, static_p, dynamic_p, static_r, dynamic_r, norm_op in (
                (
                    "decomposed",
                    rms_static_pattern,
                    rms_dynamic_pattern,
                    static_replacement,
                    dynamic_replacement,
                    False,
                ),
                (
                    "op",
                    rms_op_static_pattern,
                    rms_op_dynamic_pattern,
                    op_static_replacement,
                    op_dynamic_replacement,
                    True,
                ),
            ):
                yield FusionPattern(
                    f"rmsnorm_{form}_static_quant_{dtype}",
                    static_p,
                    static_r,
                    partial(_example_inputs, dtype, True, False, norm_op),
                    scalars,
                )
                yield FusionPattern(
                    f"rmsnorm_{form}_dynamic_quant_{dtype}",
                    dynamic_p,
                    dynamic_r,
                    partial(_example_inputs, dtype, False, False, norm_op),
                    scalars,
                )
