"""Fuse SiLU-and-mul and the activation quant of the down projection that follows it.

Matched activation forms: the decomposed ``F.silu(gate) * up`` with ``gate, up`` the halves of
``x``'s last dim, taken by ``x.chunk(2, -1)`` or by slicing (the split point is re-derived
from each match's shapes), and ``piecewise.silu_and_mul``.

Before (bf16 ``x [T, 2I]``, static per-tensor scale)::

    split = aten.split.Tensor(x, I, -1)
    g32   = prims.convert_element_type(split[0], float32)
    act   = aten.div.Tensor(g32, aten.add.Tensor(aten.exp(aten.neg(g32)), 1))
    y     = aten.mul.Tensor(prims.convert_element_type(act, bfloat16), split[1])
    q     = auto_functionalized(piecewise.static_scaled_quant, out=empty, x=y, scale=s)
    -> uses of q[1]

After::

    f = auto_functionalized(piecewise.silu_and_mul_static_quant, out=empty, x=x, scale=s)
    -> uses of f[1]

Dynamic per-token scales map to ``silu_and_mul_dynamic_quant`` (outputs: q, scales).
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch

import passes.ops.activation  # noqa: F401  (registers the silu_and_mul ops)
import passes.ops.activation_quant  # noqa: F401  (registers the quant ops)
from passes.fusion_patterns import quant_buffers, silu_and_mul_hf, silu_and_mul_sliced
from passes.pattern_fusion import FusionPattern, PatternFusionPass, call_mutating, float_dtypes
from passes.registry import register_pass

ops = torch.ops.piecewise


def _silu_mul_op(x, act_out):
    return call_mutating(ops.silu_and_mul.default, out=act_out, x=x)[0]


def _static(y, out, scale):
    return call_mutating(ops.static_scaled_quant.default, out=out, x=y, scale=scale)[0]


def _dynamic(y, out, scales):
    return call_mutating(ops.dynamic_per_token_quant.default, out=out, x=y, scales=scales)


def _decomposed(activation):
    def static_pattern(x, out, scale):
        return _static(activation(x), out, scale)

    def dynamic_pattern(x, out, scales):
        return _dynamic(activation(x), out, scales)

    return static_pattern, dynamic_pattern


def op_static_pattern(x, out, scale, act_out):
    return _static(_silu_mul_op(x, act_out), out, scale)


def op_dynamic_pattern(x, out, scales, act_out):
    return _dynamic(_silu_mul_op(x, act_out), out, scales)


def static_replacement(x, out, scale):
    return call_mutating(ops.silu_and_mul_static_quant.default, out=out, x=x, scale=scale)[0]


def dynamic_replacement(x, out, scales):
    return call_mutating(ops.silu_and_mul_dynamic_quant.default, out=out, x=x, scales=scales)


def op_static_replacement(x, out, scale, act_out):
    return static_replacement(x, out, scale)  # act_out is no longer needed


def op_dynamic_replacement(x, out, scales, act_out):
    return dynamic_replacement(x, out, scales)


def _example_inputs(dtype: torch.dtype, static: bool, op_form: bool) -> list:
    x = torch.randn(5, 32, dtype=dtype)
    act = torch.empty(5, 16, dtype=dtype)
    out, scales = quant_buffers(act)
    inputs = [x, out, torch.ones(1) if static else scales]
    return inputs + [act] if op_form else inputs


# Levels as fuse_rmsnorm_quant's (measured together): O1 on GPU, O3 only on CPU.
@register_pass(
    "fuse_silu_mul_quant", after=("noop_elimination",), levels={"cpu": 3, "cuda": 1}, fusion=True
)
class FuseSiluMulQuantPass(PatternFusionPass):
    __doc__ = __doc__

    def patterns(self) -> Iterable[FusionPattern]:
        for dtype in float_dtypes(self.context):
            forms = [
                (name, *_decomposed(act), static_replacement, dynamic_replacement, False)
                for name, act in (("chunk", silu_and_mul_hf), ("slice", silu_and_mul_sliced))
            ]
            forms.append(
                (
                    "op",
                    op_static_pattern,
                    op_dynamic_pattern,
                    op_static_replacement,
                    op_dynamic_replacement,
                    True,
                )
            )
            for form, sp, dp, sr, dr, op_form in forms:
                yield FusionPattern(
                    f"silu_mul_{form}_static_quant_{dtype}",
                    sp,
                    sr,
                    partial(_example_inputs, dtype, True, op_form),
                )
                yield FusionPattern(
                    f"silu_mul_{form}_dynamic_quant_{dtype}",
                    dp,
                    dr,
                    partial(_example_inputs, dtype, False, op_form),
                )
