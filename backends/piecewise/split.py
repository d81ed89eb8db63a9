"""Splitting the one Dynamo graph into pieces: cut at the splitting ops, hash each piece's
structure (identical layers hash equal), and learn each piece's example inputs, static inputs
and token source. :class:`backends.piecewise.backend.PiecewiseBackend` compiles what this cuts."""

from __future__ import annotations

import hashlib
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from backends.piecewise.graph_serde import op_name
from framework.compat.ops import FakeTensor, OpOverload, OpOverloadPacket, qualified_name
from framework.core import ops as core_ops

_STACK_FILE = re.compile(r'File "([^"]+)", line')


@dataclass
class PieceInfo:
    name: str
    index: int
    is_splitting_op: bool


def split_graph(
    gm: fx.GraphModule, splitting_ops: list[str]
) -> tuple[fx.GraphModule, list[PieceInfo]]:
    """Split ``gm`` so each splitting op is alone in its submodule; the rest between two
    splitting ops forms one piece.  ``[]`` keeps the whole graph as one piece."""
    wanted = {s.removesuffix(".default") for s in splitting_ops}
    part: dict[fx.Node, int] = {}
    split_ids: set[int] = set()
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        name = op_name(node.target) if node.op == "call_function" else None
        if name is not None and name.removesuffix(".default") in wanted:
            pid += 1
            part[node] = pid
            split_ids.add(pid)
            pid += 1
        else:
            part[node] = pid
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    pieces = []
    for name, _ in split.named_children():
        idx = int(name.removeprefix("submod_"))
        pieces.append(PieceInfo(name, idx, idx in split_ids))
    return split, pieces


def inline_splitting_ops(split: fx.GraphModule) -> int:
    """Call each splitting op straight from the split module's own code; returns how many.

    ``split_module`` leaves every splitting op alone in a submodule of its own, which the
    split module calls like any piece: ``nn.Module.__call__``, FX's wrapper, the submodule's
    ``forward``, then the op through its overload packet.  A splitting op runs eagerly, once a
    layer a step, so that chain is paid per layer on the hot path: a tiny-model attention call
    took 22.7 µs through its submodule against 18.7 µs through ``OpOverload`` directly (hot,
    b1, 128 tokens of context), 30.4 against 21.1 µs after a 2 MB read (ad hoc, one process;
    in an engine: ``python -m experiments.bench.engine_ab --ab split_calls``).  A submodule
    that is exactly ``op(placeholders and constants)`` with nothing returned becomes one
    ``call_function`` node of the op's overload (``.default`` for a packet of one overload),
    with the same arguments: the torch dispatcher still picks the kernel (device kernels,
    :func:`framework.core.ops.override_kernel`).  Pieces (their runtimes stand in the
    instance dict) and any other submodule are left as they are.  The submodule itself stays
    an attribute, unused, for tools that read it."""
    count = 0
    for node in list(split.graph.find_nodes(op="call_module")):
        sub = getattr(split, node.target)
        if not isinstance(sub, fx.GraphModule) or node.users or node.kwargs:
            continue
        lone = _lone_op_call(sub, len(node.args))
        if lone is None:
            continue
        op, placeholders = lone
        env = dict(zip(placeholders, node.args))

        def arg(a: Any, env: dict = env) -> Any:
            return env[a] if isinstance(a, fx.Node) else a

        with split.graph.inserting_before(node):
            call = split.graph.call_function(
                _overload(op.target),
                fx.node.map_aggregate(op.args, arg),
                fx.node.map_aggregate(op.kwargs, arg),
            )
        call.meta = dict(op.meta)
        split.graph.erase_node(node)
        count += 1
    if count:
        split.recompile()
    return count


def bind_direct_splitting_ops(split: fx.GraphModule) -> int:
    """After :func:`inline_splitting_ops`: an inlined op with a direct kernel
    (``framework.core.ops.direct_kernel``; the attention op's is its Python body) is called
    through its switch (``framework.core.ops.direct_call``), which runs the kernel without
    the dispatcher -- ~1.4 µs a call saved, once a layer a step -- unless, for that call, an
    override, a dispatch mode or the profiler needs the dispatcher
    (``framework.core.ops.direct_calls_allowed``: the graph emulation's capture and
    ``profile_step`` keep seeing the op).  Calls with keyword arguments keep the dispatcher.
    Returns how many calls are bound."""
    count = 0
    for node in split.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload) or node.kwargs:
            continue
        switch = core_ops.direct_call(op_name(node.target) or "")
        if switch is not None:
            switch.op = node.target  # type: ignore[attr-defined]  (what it stands for)
            node.target = switch
            count += 1
    if count:
        split.recompile()
    return count


def _lone_op_call(sub: fx.GraphModule, num_args: int) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """(the op node, the placeholders) when ``sub`` is placeholders, one torch op call whose
    result nobody uses, and an empty output; else None."""
    placeholders, calls, output = [], [], None
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            placeholders.append(n)
        elif n.op == "call_function":
            calls.append(n)
        elif n.op == "output":
            output = n
        else:
            return None
    if len(calls) != 1 or len(placeholders) != num_args or output is None:
        return None
    (call,) = calls
    if output.args[0] not in ((), [], None) or call.users:
        return None
    if not isinstance(call.target, (OpOverload, OpOverloadPacket)):
        return None
    return call, placeholders


def _overload(target: Any) -> Any:
    """An op packet with a single overload as that overload (the dispatcher call without the
    packet's overload resolution); anything else as it is."""
    if isinstance(target, OpOverloadPacket) and list(target.overloads()) == ["default"]:
        return target.default
    return target


def stable_name(target: Any) -> str:
    """A node target's name that is the same in every process: ``str()`` of a Python function
    or a torch builtin holds its address (``<function embedding at 0x7f...>``).  Op overloads
    and strings print stably; callables get their qualified name (the name FX's code
    generation uses: :func:`framework.compat.ops.qualified_name`)."""
    if isinstance(target, str) or not callable(target):
        return str(target)
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        return str(target)
    try:
        return qualified_name(target)
    except Exception:  # a callable FX cannot name (a bound method, a partial): its type
        return f"{type(target).__module__}.{type(target).__qualname__}"


def graph_hash(gm: fx.GraphModule, example_inputs: list) -> str:
    """Structural hash: node names are canonicalised so identical layers hash equal, and
    targets are named without addresses, so the same graph hashes equal in every process
    (the artifact store deduplicates by it across processes)."""
    names: dict[str, str] = {}
    lines = []

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return names[a.name]
        if isinstance(a, (list, tuple)):
            return [ref(x) for x in a]
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        return stable_name(a) if callable(a) else repr(a)

    for i, n in enumerate(gm.graph.nodes):
        names[n.name] = f"n{i}"
        target = "" if n.op == "placeholder" else stable_name(n.target)
        lines.append(f"{n.op}|{target}|{ref(n.args)}|{ref(dict(n.kwargs))}")
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            lines.append(f"in|{x.dtype}|{tuple(x.shape)}|{x.stride()}|{x.device.type}")
        else:
            lines.append(f"in|{type(x).__name__}|{x}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


def token_source(example_inputs: list) -> tuple[int, Optional[int]]:
    """Where a piece finds its token count: a SymInt argument, else a symbolic tensor dim."""
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt):
            return i, None
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for d, s in enumerate(x.shape):
                if isinstance(s, torch.SymInt):
                    return i, d
    raise ValueError("piece has no input with a symbolic token dimension")


def traced_files(gm: fx.GraphModule) -> list[str]:
    """Files outside torch whose code produced nodes of the graph (from the stack traces
    Dynamo records on every node)."""
    files = set()
    for n in gm.graph.nodes:
        for f in _STACK_FILE.findall(n.meta.get("stack_trace") or ""):
            if f"{os.sep}torch{os.sep}" not in f and os.path.isfile(f):
                files.add(f)
    return sorted(files)


def static_piece_inputs(
    gm: fx.GraphModule, split: fx.GraphModule, example_inputs: list
) -> dict[str, dict[int, torch.Tensor]]:
    """Per piece, its inputs that are real fixed-shape tensors handed to the backend (the
    model's parameters and buffers), by input position.  The pass verifier runs pieces on
    these real values: a fusion may rely on a property of a buffer (RoPE's cos/sin caches
    repeat their two halves), which random values would break."""
    real = {
        n.name: x
        for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)
        if isinstance(x, torch.Tensor)
        and not isinstance(x, FakeTensor)
        and all(isinstance(s, int) for s in x.shape)
    }
    out: dict[str, dict[int, torch.Tensor]] = {}
    for node in split.graph.find_nodes(op="call_module"):
        out[node.target] = {
            i: real[a.name]
            for i, a in enumerate(node.args)
            if isinstance(a, fx.Node) and a.op == "placeholder" and a.name in real
        }
    return out


def piece_example_inputs(split: fx.GraphModule, fakes: list) -> dict[str, list]:
    """Run the split module on fake inputs, recording each submodule's arguments."""
    seen: dict[str, list] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            seen[target] = list(args)
            return super().call_module(target, args, kwargs)

    # The placeholders' own fake mode: Dynamo hands backends a different TracingContext mode.
    fake_mode = next(f.fake_mode for f in fakes if isinstance(f, torch.Tensor))
    with fake_mode, torch.no_grad():
        Recorder(split).run(*fakes)
    return seen


def module_code(split: fx.GraphModule) -> str:
    parts = [split.code]
    for name, sub in split.named_children():
        parts.append(f"# ---- {name}\n{getattr(sub, 'code', repr(sub))}")
    return "\n".join(parts)


REPLAYABLE_SPLITTING_OPS = frozenset({"piecewise::attention"})
"""Splitting ops whose native call a recorded forward can replay (the fused CPU attention
reports its call: ``backends/attention/cpu_paged.py``; other attention backends do not, and
a forward that runs them is not replayed)."""


def native_parts(split: fx.GraphModule, pieces: set[str]) -> tuple[int, Optional[str]]:
    """How many parts of one forward of ``split`` must report their native calls for a
    recording of the whole forward (``backends/piecewise/forward_replay.py``) to be complete
    -- each call of a piece (``pieces``: their names) and of a splitting op of
    :data:`REPLAYABLE_SPLITTING_OPS` -- or why no recording can be: a node that does anything
    else (a submodule that is not a piece, another op; ``getitem`` on a piece's outputs is
    plain Python)."""
    count = 0
    for node in split.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module" and node.target in pieces:
            count += 1
            continue
        if node.op == "call_function":
            if node.target is operator.getitem:
                continue
            # an op, or the switch bind_direct_splitting_ops put in its place (``.op``: the op)
            name = op_name(node.target) or op_name(getattr(node.target, "op", None))
            if name in REPLAYABLE_SPLITTING_OPS:
                count += 1
                continue
        what = f"{node.op} {node.target}"
        return 0, f"the split module's node {node.name} ({what}) runs outside the pieces"
    return count, None
