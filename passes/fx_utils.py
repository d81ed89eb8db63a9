"""FX helpers shared by the passes: counting ops, and the two forms of functionalized mutation.

A mutating custom op in a post-grad graph appears as ``auto_functionalized(op, **kwargs)`` (v1:
the mutated tensors are kwargs) or ``auto_functionalized_v2(op, _<arg>_base_index=i, ...,
_all_bases=[...])`` (v2, Inductor's default).  Both return ``(op result, *new values)``; the
pattern-matching passes are written against v1, so :func:`canonicalize_auto_functionalized`
rewrites every v2 node whose mutated arguments are whole tensors (no view metadata) into v1.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from framework.compat.ops import (
    OpOverload,
    auto_functionalized,
    auto_functionalized_v2,
    get_mutable_args,
)

AF_TARGETS = (auto_functionalized, auto_functionalized_v2)
_VIEW_INFO_SUFFIXES = (
    "_size",
    "_stride",
    "_storage_offset",
    "_slice_dim",
    "_slice_start",
    "_slice_end",
    "_alias",
)


def node_op(node: torch.fx.Node) -> Any:
    """The op a node runs: its target, or for ``auto_functionalized*`` the wrapped op."""
    if node.op == "call_function" and node.target in AF_TARGETS:
        return node.args[0]
    return node.target


def _matches(target: Any, op: Any) -> bool:
    if target is op:
        return True
    packet = getattr(target, "overloadpacket", None)
    return packet is not None and packet is op


def count_op(graph: torch.fx.Graph | torch.fx.GraphModule, op: Any) -> int:
    """Nodes that run ``op`` (an overload or an overload packet), directly or functionalized."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    return sum(1 for n in graph.nodes if n.op == "call_function" and _matches(node_op(n), op))


def mutable_arg_offset(op: OpOverload) -> int:
    """Index of the first mutated tensor in an ``auto_functionalized*`` result tuple."""
    return max(1, len(op._schema.returns))


def af_v1_kwargs(node: torch.fx.Node) -> Optional[dict[str, Any]]:
    """The op's keyword arguments of an ``auto_functionalized*`` node (mutated tensors included
    as plain kwargs), or ``None`` when a mutated argument is a view of a base (v2 view
    metadata) or two mutated arguments share a base."""
    if node.target is auto_functionalized:
        return schema_ordered(node.args[0], dict(node.kwargs))
    return v2_to_v1_kwargs(node.args[0], node.kwargs)


def v2_to_v1_kwargs(op: OpOverload, kwargs: dict[str, Any]) -> Optional[dict]:
    """``auto_functionalized_v2`` kwargs (nodes or fake values) as v1 kwargs, or ``None``."""
    names, _ = get_mutable_args(op)
    bases = kwargs["_all_bases"]
    out = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    used = set()
    for name in names:
        if any(f"_{name}{s}" in kwargs for s in _VIEW_INFO_SUFFIXES):
            return None
        index = kwargs[f"_{name}_base_index"]
        if index is None:
            out[name] = None
            continue
        if index in used:
            return None
        used.add(index)
        out[name] = bases[index]
    if len(used) != len(bases):
        return None
    return schema_ordered(op, out)


def schema_ordered(op: OpOverload, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in the op's schema order: the pattern matcher compares kwargs key by key in
    order, and functionalization emits them in schema order."""
    order = [a.name for a in op._schema.arguments]
    unknown = set(kwargs) - set(order)
    if unknown:
        raise TypeError(f"{op}: unknown argument(s) {sorted(unknown)}; schema: {op._schema}")
    return {name: kwargs[name] for name in order if name in kwargs}


def getitem_users(node: torch.fx.Node) -> dict[int, list[torch.fx.Node]]:
    out: dict[int, list[torch.fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            out.setdefault(user.args[1], []).append(user)
    return out


def canonicalize_auto_functionalized(graph: torch.fx.Graph) -> int:
    """Rewrite view-free ``auto_functionalized_v2`` nodes as v1; returns how many."""
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=auto_functionalized_v2)):
        kwargs = af_v1_kwargs(node)
        if kwargs is None or any(u.target is not operator.getitem for u in node.users):
            continue
        op = node.args[0]
        names, _ = get_mutable_args(op)
        offset = mutable_arg_offset(op)
        base_to_v1 = {
            node.kwargs[f"_{n}_base_index"]: offset + i
            for i, n in enumerate(names)
            if node.kwargs[f"_{n}_base_index"] is not None
        }
        with graph.inserting_before(node):
            new = graph.call_function(auto_functionalized, (op,), kwargs)
        new.meta.update(node.meta)
        if "eager_input_vals" in node.meta:  # fake (args, kwargs) Inductor re-traces with
            eager_args, eager_kwargs = node.meta["eager_input_vals"]
            eager_v1 = v2_to_v1_kwargs(op, eager_kwargs)
            if eager_v1 is None:
                del new.meta["eager_input_vals"]
            else:
                new.meta["eager_input_vals"] = (eager_args, eager_v1)
        if "val" in node.meta:
            # v1 returns every mutable argument (None ones included), in schema order.
            val = node.meta["val"]
            bases_vals = val[offset:]
            by_index = {v1 - offset: bases_vals[b] for b, v1 in base_to_v1.items()}
            new.meta["val"] = (*val[:offset], *[by_index.get(i) for i in range(len(names))])
        for index, users in getitem_users(node).items():
            new_index = index if index < offset else base_to_v1[index - offset]
            for user in users:
                user.args = (new, new_index)
        graph.erase_node(node)
        count += 1
    return count


def nodes_in_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}
