"""CPU: run linears whose weight is a graph input on a oneDNN-prepacked weight.

Inductor prepacks weights for oneDNN only with freezing (weights as constants); in a piecewise
graph the weights are graph inputs, so every GEMV reads the plain layout.  This pass rewrites
such matmuls into ``piecewise::prepacked_linear`` (passes/ops_prepack.py), which packs each
weight once and calls ``mkldnn._linear_pointwise``.  CPU only: it does nothing on a graph whose
tensors live on another device, and is not applicable without oneDNN.

Before (``w`` a bf16/fp32 placeholder ``[N, K]``)::

    t   = aten.permute.default(w, [1, 0])
    y   = aten.mm.default(x, t)                 # or aten.addmm.default(b, x, t)

After::

    y   = piecewise.prepacked_linear.default(x, w, None)   # (x, w, b) for addmm

An ``addmm`` whose input is a full ``[T, N]`` tensor (Inductor folds a residual add into the
matmul) becomes ``aten.add(prepacked_linear(x, w, None), r)``; Inductor fuses that add into
the next pointwise kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from passes.base import CompileRange, GraphPass, graph_device_types
from passes.ops_prepack import PACKABLE_DTYPES, mkldnn_available, prepacked_linear
from passes.registry import register_pass

aten = torch.ops.aten


def _transposed_weight(node) -> Optional[torch.fx.Node]:
    """``w`` when ``node`` is ``permute(w, [1, 0])`` / ``t(w)`` of a packable 2-D placeholder."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target == aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2]):
        w = node.args[0]
    elif node.target == aten.t.default:
        w = node.args[0]
    else:
        return None
    val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if (
        w.op != "placeholder"
        or not isinstance(val, torch.Tensor)
        or val.dim() != 2
        or val.dtype not in PACKABLE_DTYPES
    ):
        return None
    return w


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
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target == aten.mm.default:
                bias, x, wt = None, *node.args
            elif node.target == aten.addmm.default and not node.kwargs:
                bias, x, wt = node.args
                bval = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
                if not isinstance(bval, torch.Tensor) or bval.dim() not in (1, 2):
                    continue
            else:
                continue
            w = _transposed_weight(wt)
            xval = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if w is None or not isinstance(xval, torch.Tensor) or xval.dtype != w.meta["val"].dtype:
                continue
            residual = None
            if bias is not None and bias.meta["val"].dim() == 2:
                residual, bias = bias, None
            with graph.inserting_before(node):
                new = graph.call_function(prepacked_linear, (x, w, bias))
                if residual is not None:
                    new.meta.update(node.meta)
                    new = graph.call_function(aten.add.Tensor, (new, residual))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            self.match_count += 1
        graph.eliminate_dead_code()
