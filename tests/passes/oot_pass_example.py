"""An out-of-tree pass, selected in config by its import path ``oot_pass_example:SubToAddNeg``
(no registration, no framework edit).  Used by the pass-manager tests."""

from __future__ import annotations

import torch

from passes.base import GraphPass

aten = torch.ops.aten


class SubToAddNeg(GraphPass):
    """Rewrite ``a - b`` as ``a + (-b)`` (numerically identical; easy to count).

    Before::  y = aten.sub.Tensor(a, b)
    After::   y = aten.add.Tensor(a, aten.neg.default(b))
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.match_count = 0
        for node in list(graph.find_nodes(op="call_function", target=aten.sub.Tensor)):
            if node.kwargs or not all(isinstance(a, torch.fx.Node) for a in node.args):
                continue
            a, b = node.args
            with graph.inserting_before(node):
                neg = graph.call_function(aten.neg.default, (b,))
                neg.meta["val"] = b.meta.get("val")
                add = graph.call_function(aten.add.Tensor, (a, neg))
            add.meta.update(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            self.match_count += 1
