"""CPU: linears run on weights re-laid out once for their kernels (``piecewise::packed_linear``).

The re-layout is not a graph rewrite: packed weights must be the model's own tensors (one
copy, in the layout the kernels read), so it happens once after loading, before tracing --
the engine's model preparation (``framework/engine/model_prep.py``) installs
:class:`passes.ops.packed_linear.PackedLinearMethod` on every CPU linear whose weight nothing else
shares, *when this pass is in the pass list*.  Each such linear then reaches the graph as::

    y = piecewise.packed_linear.default(x, w_packed, w_md, bias, N, K, max_rows)

Stacked MoE experts in bf16 are re-laid out the same way (per expert, for the small-M kernel:
:class:`passes.ops.packed_moe.PackedExpertsMethod`) and reach the graph as
``piecewise.fused_moe_packed.default(...)``.
(int8 layers: ``piecewise.int8_packed_linear`` / ``int8_wo_packed_linear``, see
:mod:`passes.ops.int8_packed_linear`.)

This pass is the switch and the record: it checks that every linear of the piece arrived
packed and counts the packed linears and packed expert ops (``match_count``);
``passes=[-prepack_linear]`` leaves every weight plain (``aten.mm`` on ``[N, K]``,
``piecewise.fused_moe`` on ``[E, N, K]``).  CPU only; not applicable without oneDNN.
"""

from __future__ import annotations

from typing import Optional

import torch

from passes.base import CompileRange, GraphPass, graph_device_types
from passes.ops.int8_packed_linear import PACKED_OPS
from passes.ops.packed_linear import mkldnn_available, packed_linear
from passes.ops.packed_moe import fused_moe_packed
from passes.registry import register_pass


# CPU only (mkldnn); on by default from O1: 1.26x on the CPU decode step.
@register_pass(
    "prepack_linear",
    after=("fuse_add_rmsnorm", "fuse_rmsnorm_quant", "fuse_silu_mul_quant", "fuse_qk_norm_rope"),
    levels={"cpu": 1},
    fusion=True,
)
class PrepackLinearPass(GraphPass):
    __doc__ = __doc__

    def is_applicable(self, compile_range: Optional[CompileRange]) -> bool:
        return mkldnn_available()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.match_count = 0
        if graph_device_types(graph) - {"cpu"}:
            return  # GPU graphs: cuBLAS needs no prepacking
        for node in graph.nodes:
            if node.op == "call_function" and (
                node.target in (packed_linear, fused_moe_packed) or node.target in PACKED_OPS
            ):
                self.match_count += 1
