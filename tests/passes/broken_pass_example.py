"""A deliberately wrong out-of-tree pass (``broken_pass_example:SwapMulForAdd``), for the tests
that check ``verify_passes`` names it with its first diverging node on a real model."""

from __future__ import annotations

import torch

from passes.base import GraphPass

aten = torch.ops.aten


class SwapMulForAdd(GraphPass):
    """Wrong on purpose: the first ``a * b`` of every piece becomes ``a + b``.

    Before::  y = aten.mul.Tensor(a, b)
    After::   y = aten.add.Tensor(a, b)
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.match_count = 0
        for node in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            node.target = aten.add.Tensor
            self.match_count = 1
            return
