"""JSON (de)serialization of the split graph's skeleton, so a warm start rebuilds the compiled
program without running Dynamo.

Only what a split graph holds is supported: placeholders, ``call_module``, ``call_function``
on ``operator.getitem`` or a ``torch.ops`` operator, and ``output``; constants are ints,
floats, strings, bools, None, dtypes and (nested) lists/tuples.  Anything else raises
:class:`NotSerializable` and the caller keeps the Dynamo path.  No pickle is involved.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from framework.compat.ops import OpOverload, OpOverloadPacket


class NotSerializable(Exception):
    pass


def op_name(target: Any) -> str | None:
    """``ns::name`` (plus ``.overload`` when not default) of a torch.ops target, else None."""
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, OpOverload):
        base = target._schema.name
        return base if target._overloadname == "default" else f"{base}.{target._overloadname}"
    return None


def _resolve_op(name: str) -> Any:
    base, _, overload = name.partition(".")
    ns, op = base.split("::")
    packet = getattr(getattr(torch.ops, ns), op)
    return getattr(packet, overload) if overload else packet


def _encode(v: Any) -> Any:
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, (list, tuple)):
        return {"seq": [_encode(x) for x in v], "tuple": isinstance(v, tuple)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"const": v}
    raise NotSerializable(f"constant of type {type(v).__name__} in the split graph")


def _decode(v: dict, env: dict[str, fx.Node]) -> Any:
    if "node" in v:
        return env[v["node"]]
    if "seq" in v:
        items = [_decode(x, env) for x in v["seq"]]
        return tuple(items) if v["tuple"] else items
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    return v["const"]


def graph_to_json(gm: fx.GraphModule, skip_submodules: set[str] = frozenset()) -> dict:
    nodes = []
    for n in gm.graph.nodes:
        entry = {
            "name": n.name,
            "op": n.op,
            "args": _encode(tuple(n.args)),
            "kwargs": {k: _encode(v) for k, v in n.kwargs.items()},
        }
        if n.op == "call_function":
            if n.target is operator.getitem:
                entry["target"] = "getitem"
            else:
                name = op_name(n.target)
                if name is None:
                    raise NotSerializable(f"call of {n.target} in the split graph")
                entry["target"] = name
        elif n.op in ("call_module", "placeholder"):
            entry["target"] = str(n.target)
        elif n.op != "output":
            raise NotSerializable(f"node kind {n.op} in the split graph")
        nodes.append(entry)
    subs = {}
    for name, mod in gm.named_children():
        if name in skip_submodules:
            continue
        if not isinstance(mod, fx.GraphModule):
            raise NotSerializable(f"submodule {name} is not a graph")
        subs[name] = graph_to_json(mod)
    return {"nodes": nodes, "submodules": subs}


def graph_from_json(
    data: dict, modules: dict[str, torch.nn.Module] | None = None
) -> fx.GraphModule:
    """Rebuild a GraphModule; ``modules`` supplies submodules not stored in ``data``."""
    root: dict[str, Any] = {k: graph_from_json(v) for k, v in data["submodules"].items()}
    root.update(modules or {})
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for e in data["nodes"]:
        args = _decode(e["args"], env)
        kwargs = {k: _decode(v, env) for k, v in e["kwargs"].items()}
        if e["op"] == "placeholder":
            node = graph.placeholder(e["target"])
        elif e["op"] == "call_module":
            node = graph.call_module(e["target"], args, kwargs)
        elif e["op"] == "call_function":
            fn = operator.getitem if e["target"] == "getitem" else _resolve_op(e["target"])
            node = graph.call_function(fn, args, kwargs)
        else:
            node = graph.output(args[0])
        node.name = e["name"]
        env[e["name"]] = node
    return fx.GraphModule(root, graph)
