"""Fuse a tensor-parallel all-reduce, the residual add and the RMSNorm of its result into
``piecewise::allreduce_add_rms_norm`` (reference op in ``passes/ops/allreduce_norm.py``).

Before (the row-parallel o_proj / down_proj output ``x``; group from ``parallel_state``)::

    ar  = _c10d_functional.all_reduce.default(x, "sum", group)
    w   = _c10d_functional.wait_tensor.default(ar)
    add = aten.add.Tensor(residual, w)
    ... RMSNorm of add (fp32 mean of squares, rsqrt, cast, * weight) ...
    -> uses of (norm, add)

After::

    f = piecewise.allreduce_add_rms_norm.default(x, residual, weight, eps, group)
    -> uses of (f[0], f[1])

Per decoder layer: two matches (after attention, after the MLP; the last layer's second one
feeds the final norm).  With one process there is no all-reduce in the graph and no match.
On CPU the op is the reference (same math, one opaque call): it measures the pattern, not a
kernel; the fused kernel is a GPU job (see passes/README.md).

Registered with ``@register_pass(name)`` alone; with ``after=`` / ``fusion=`` metadata it would
say ``after="noop_elimination", fusion=True`` (it must run before ``fuse_add_rmsnorm``, which
would take the add + norm).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

import passes.ops.allreduce_norm  # noqa: F401  (registers piecewise::allreduce_add_rms_norm)
from framework.compat.ops import c10d_functional
from framework.core.parallel_state import get_tp_state
from passes.fusion_patterns import EPS_DUMMY, rms_norm_hf
from passes.pattern_fusion import FusionPattern, PatternFusionPass, float_dtypes
from passes.registry import register_pass


def make_pattern(group: str):
    def pattern(x, residual, weight, eps):
        reduced = c10d_functional().all_reduce.default(x, "sum", group)
        reduced = c10d_functional().wait_tensor.default(reduced)
        r = residual + reduced
        return rms_norm_hf(r, weight, eps), r

    def replacement(x, residual, weight, eps):
        out = torch.ops.piecewise.allreduce_add_rms_norm.default(x, residual, weight, eps, group)
        return out[0], out[1]

    return pattern, replacement


@register_pass(
    "fuse_allreduce_rmsnorm", after=("noop_elimination", "sequence_parallelism"), fusion=True
)
class FuseAllReduceRMSNormPass(PatternFusionPass):
    __doc__ = __doc__
    trace_on_fake_tensors = True  # the pattern holds an all-reduce

    def config_factors(self) -> dict[str, Any]:
        st = get_tp_state()
        return {**super().config_factors(), "group": st.group_name, "tp": st.world_size}

    def patterns(self) -> Iterable[FusionPattern]:
        group = get_tp_state().group_name
        if not group:  # one process: nothing to fuse
            return
        pattern, replacement = make_pattern(group)
        for dtype in float_dtypes(self.context):

            def inputs(dtype=dtype):
                return [
                    torch.randn(5, 16, dtype=dtype),
                    torch.randn(5, 16, dtype=dtype),
                    torch.randn(16, dtype=dtype),
                ]

            yield FusionPattern(
                f"allreduce_add_rmsnorm_{dtype}",
                pattern,
                replacement,
                inputs,
                scalars={"eps": EPS_DUMMY},
            )
