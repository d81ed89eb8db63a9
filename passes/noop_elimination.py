"""Remove view/reshape/slice nodes that do nothing, so fusion patterns see the real dataflow.

Rules (shapes compared on the fake values, symbolic sizes included):

* ``reshape``/``_unsafe_view`` of a view/reshape, or ``view`` of a ``view``: the outer one reads
  the inner one's input directly (chains collapse to one reshape);
* ``view``/``reshape``/``_unsafe_view``/``expand``/``alias`` whose output shape equals its
  input's shape: replaced by its input;
* ``slice.Tensor(x, dim, 0, end, 1)`` with ``end >= x.size(dim)``: replaced by ``x``.

Before::

    v1 = aten.view.default(x, [s0, 8, 16])
    v2 = aten.reshape.default(v1, [s0, 128])     # x is [s0, 128]
    sl = aten.slice.Tensor(v2, 1, 0, 9223372036854775807)
    out = aten.mul.Tensor(sl, w)

After::

    out = aten.mul.Tensor(x, w)

Every removed node aliased its input already, so no aliasing is added.
"""

from __future__ import annotations

from typing import Any

import torch

from passes.base import GraphPass
from passes.registry import register_pass

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SAME_SHAPE_NOOPS = RESHAPES + (aten.expand.default, aten.alias.default)
TO_THE_END = 2**62
"""Slice ends at or above this mean "to the end" (Python's ``x[a:]`` traces as INT64_MAX)."""


def _statically_known_true(expr: Any) -> bool:
    # Deferred: symbolic_shapes imports sympy (~1 s), which a warm start (no compile) never
    # needs, and importing this pass is part of building the pass manager on every start.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(expr)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def same_shape(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dim() != b.dim():
        return False
    return all(_statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _is_full_slice(node: torch.fx.Node) -> bool:
    inp = _val(node.args[0])
    if not isinstance(inp, torch.Tensor):
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if step != 1 or start not in (None, 0):
        return False
    if end is None or (isinstance(end, int) and end >= TO_THE_END):
        return True
    if isinstance(end, torch.fx.Node):
        end = _val(end)
    size = inp.shape[dim]
    return _statically_known_true(end >= size)


# First (strips view/reshape/slice noise so patterns match); on from O1 everywhere.
@register_pass("noop_elimination", after=(), levels={"cpu": 1, "cuda": 1})
class NoOpEliminationPass(GraphPass):
    __doc__ = __doc__

    def __call__(self, graph: torch.fx.Graph) -> None:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in RESHAPES:
                src = node.args[0]
                # reshape(reshape(x, a), b) == reshape(x, b).  A view may only skip an inner
                # view (x is then viewable); an inner reshape may have copied.
                if (
                    isinstance(src, torch.fx.Node)
                    and src.target in RESHAPES
                    and (node.target != aten.view.default or src.target == aten.view.default)
                ):
                    node.replace_input_with(src, src.args[0])
                    count += 1
            if node.target in SAME_SHAPE_NOOPS and same_shape(_val(node), _val(node.args[0])):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
            elif node.target == aten.slice.Tensor and _is_full_slice(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
        graph.eliminate_dead_code()
        self.match_count = count
