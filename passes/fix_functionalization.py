"""Re-inplace functionalized custom ops: call the mutating op directly on its buffers.

Inductor lowers ``auto_functionalized`` by cloning each mutated argument unless its own
reinplacing proves the clone unnecessary; for ops whose buffers are fresh (``empty`` outputs of
a fusion) or dead after the call, calling the op in place saves the clones.  This pass does it
when it is provably safe and leaves every other node to Inductor:

* each mutated argument is produced by a non-aliasing op (a fresh tensor, not a view and not a
  graph input), and
* every other use of it comes before the call in graph order (nobody reads the old value
  later), and no tensor is passed as two mutated arguments;
* for ops that add ``x`` into ``residual`` in place (and leave ``x`` alone) the two operands are
  swapped when only ``x`` is safe to overwrite (see ``SWAPPABLE_ADD_OPERANDS``).

Before::

    af = auto_functionalized(piecewise.rms_norm_dynamic_quant, out=empty, x=x, weight=w,
                             scales=empty_1, eps=1e-6, residual=add)
    q, s, r = af[1], af[2], af[3]
    -> uses of q, s, r

After::

    piecewise.rms_norm_dynamic_quant(out=empty, x=x, weight=w, scales=empty_1, eps=1e-6,
                                     residual=add)
    -> uses of empty, empty_1, add

It runs last: the graph is no longer functional afterwards, so no pattern may run after it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from framework.compat.ops import OpOverload, get_mutable_args
from passes.base import GraphPass
from passes.fx_utils import (
    AF_TARGETS,
    af_v1_kwargs,
    getitem_users,
    mutable_arg_offset,
    nodes_in_order,
)
from passes.registry import ALL, register_pass


def _is_fresh_tensor(node: Any) -> bool:
    """A tensor no other tensor aliases: output of a non-view op, or a getitem of one."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False  # placeholders (graph inputs) and constants: their owner may read them
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        if isinstance(parent, torch.fx.Node) and parent.target in AF_TARGETS:
            return True  # new values of a functionalized op are fresh tensors
        return _is_fresh_tensor(parent) and isinstance(parent.target, OpOverload)
    if isinstance(target, OpOverload):
        return not any(r.alias_info is not None for r in target._schema.returns)
    return False


SWAPPABLE_ADD_OPERANDS = {
    "piecewise::fused_add_rms_norm": ("x", "residual"),
    "piecewise::fused_add_rms_norm_static_quant": ("x", "residual"),
    "piecewise::rms_norm_dynamic_quant": ("x", "residual"),
}
"""Ops computing ``residual <- x + residual``: the operands may trade places (IEEE addition is
commutative, and in the functional form only the *values* of the results are observed), which
lets the in-place sum land in the fresh tensor when ``residual`` is a graph input -- the usual
case in a piece, whose residual stream arrives from the previous piece."""


def _safe_to_mutate(arg: Any, node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    return _is_fresh_tensor(arg) and not any(
        u is not node and order.get(u, -1) > order[node] for u in arg.users
    )


# Last: re-inplaces auto_functionalized ops, which breaks the functional IR other passes need.
@register_pass("fix_functionalization", after=ALL, levels={"cpu": 1, "cuda": 1})
class FixFunctionalizationPass(GraphPass):
    __doc__ = __doc__

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = nodes_in_order(graph)
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in AF_TARGETS:
                continue
            if self._defunctionalize(graph, node, order):
                count += 1
        self.match_count = count

    @staticmethod
    def _defunctionalize(
        graph: torch.fx.Graph, node: torch.fx.Node, order: dict[torch.fx.Node, int]
    ) -> bool:
        op = node.args[0]
        kwargs = af_v1_kwargs(node)
        if kwargs is None:
            return False
        offset = mutable_arg_offset(op)
        users = getitem_users(node)
        if (
            len(op._schema.returns) > 0
            or any(i < offset for i in users)
            or len(node.users) != sum(map(len, users.values()))
        ):
            return False  # op results in use, or a non-getitem user: leave it to Inductor
        names, _ = get_mutable_args(op)
        swap = SWAPPABLE_ADD_OPERANDS.get(op._schema.name)
        if swap and "x" not in names and kwargs.get("residual") is not None:
            a, b = swap
            if not _safe_to_mutate(kwargs[b], node, order) and _safe_to_mutate(
                kwargs[a], node, order
            ):
                kwargs[a], kwargs[b] = kwargs[b], kwargs[a]
        mutated = [kwargs[n] for n in names]
        present = [m for m in mutated if m is not None]
        if len(set(present)) != len(present):
            return False
        if not all(_safe_to_mutate(arg, node, order) for arg in present):
            return False
        with graph.inserting_before(node):
            call = graph.call_function(op, (), kwargs)
        call.meta["val"] = None
        for index, getitems in users.items():
            replacement = mutated[index - offset]
            for g in getitems:
                g.replace_all_uses_with(replacement)
                graph.erase_node(g)
        graph.erase_node(node)
        return True
