"""What the pass verifier feeds a piece and which of its values it may compare.

Inputs: random activations with the token count from the compile range (every shape symbol
bound consistently), the real weights and buffers where the backend knows them, and for a
graph that contains attention a private batch in the forward context.  Comparable values: every
node except uninitialised allocations (``empty``...) that the graph never writes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.fx

from framework.compat.ops import UNSAFE_VIEW, HigherOrderOperator, OpOverload, c10d_functional
from framework.core.attention_metadata import AttentionMetadata
from framework.core.compile_range import CompileRange
from framework.core.errors import CompileStepError
from framework.core.forward_context import ForwardContext, set_forward_context
from framework.core.symbolic import concrete_int, symbol_bindings

_FP8 = tuple(
    d
    for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
)
DEFAULT_TOKENS = 8
"""Token count used when the graph has a symbolic size and no compile range is known."""


class PassVerificationError(CompileStepError):
    """A pass changed a piece's outputs beyond the tolerance (or a piece cannot be verified).
    The pass manager prefixes the piece and range; the compile spine raises it unwrapped."""


def concrete_size(compile_range: Optional[CompileRange]) -> int:
    """The token count verification runs with: small, inside the compile range."""
    if compile_range is None:
        return DEFAULT_TOKENS
    return max(int(compile_range.start), min(int(compile_range.end), DEFAULT_TOKENS))


def random_inputs(
    graph: torch.fx.Graph, size: int, seed: int = 0, known: Optional[dict[int, torch.Tensor]] = None
) -> list[Any]:
    """Random tensors matching the placeholders' fake values, the token count set to ``size``
    (see :func:`symbol_bindings`); placeholder ``i`` takes ``known[i]`` instead (a real weight
    or buffer) when its shape and dtype match."""
    known = known or {}
    gen = torch.Generator().manual_seed(seed)
    placeholders = list(graph.find_nodes(op="placeholder"))
    bindings = symbol_bindings([n.meta.get("val") for n in placeholders], size)
    inputs = []
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            inputs.append(concrete_int(val, bindings))
        elif isinstance(val, torch.Tensor):
            shape = [concrete_int(s, bindings) for s in val.shape]
            real = known.get(len(inputs))
            if (
                isinstance(real, torch.Tensor)
                and list(real.shape) == shape
                and real.dtype == val.dtype
            ):
                inputs.append(real.detach())
            else:
                inputs.append(_random_tensor(shape, val.dtype, gen).to(val.device))
        elif isinstance(val, (int, float, bool)) or val is None:
            inputs.append(val)
        else:
            raise PassVerificationError(
                f"verify_passes: placeholder {node.name} has no fake value (meta['val']) to "
                f"build a random input from (got {type(val).__name__})"
            )
    return inputs


def _random_tensor(shape: list[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point and dtype not in _FP8:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype in _FP8:
        return (torch.randn(shape, generator=gen) * 8).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    # Other integers are usually indices (positions, slots): keep them small and non-negative.
    return torch.randint(0, 4, shape, generator=gen).to(dtype)


UNINITIALIZED_OPS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
}
"""Allocations whose values are garbage until an op writes them: never compared."""

AMPLIFYING_OPS = frozenset(
    {
        "piecewise::int8_packed_linear",  # W8A8: quantizes its input per token, inside
        "piecewise::int8_packed_linear_python",
        "piecewise::fused_moe_int8",  # W8A8 experts (quantize_activations)
        "piecewise::topk_softmax",  # a discrete choice: which experts
    }
)
"""Ops whose output may move by a whole quantization step (or pick another expert) when an
input moves by one rounding.  A fusion that rounds an input of one differently is judged on
that input; what the op makes of it is not compared (its output and what follows are
tainted), as for a quantized tensor the graph shows (``passes.verify``)."""


def op_name(node: torch.fx.Node) -> Optional[str]:
    """``namespace::name`` of a call to an operator overload, else None."""
    target = node.target
    return target.name() if isinstance(target, OpOverload) else None


_VIEW_OPS = {
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    UNSAFE_VIEW,
}
"""Ops whose result may alias their first argument besides those whose schema says so."""


def _aliases_first_arg(node: torch.fx.Node) -> bool:
    target = node.target
    if target in _VIEW_OPS:
        return True
    if not isinstance(target, OpOverload):
        return False
    returns = target._schema.returns
    return (
        bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    )


def undefined_nodes(graph: torch.fx.Graph) -> set[str]:
    """Names of the nodes whose value the graph never defines: uninitialised allocations
    (``empty``...) and views of them, when no op in the graph writes into the allocation
    (through any view).  A piece hands such a buffer to the splitting op after it (attention
    writes its output there), so its bytes are whatever memory held: never compared."""
    root: dict[str, str] = {}
    written: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in UNINITIALIZED_OPS:
            root[node.name] = node.name
        elif (
            _aliases_first_arg(node)
            and node.args
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].name in root
        ):
            root[node.name] = root[node.args[0].name]
        for arg in _written_args(node):
            if arg.name in root:
                written.add(root[arg.name])
    undefined = {name for name, r in root.items() if r not in written}
    # A functional collective's result is defined only after its wait_tensor (tensor
    # parallelism): the value in between is never compared.
    undefined |= {
        n.name for n in graph.nodes if n.op == "call_function" and n.target in ASYNC_COLLECTIVES
    }
    return undefined


ASYNC_COLLECTIVES = {
    c10d_functional().all_reduce.default,
    c10d_functional().all_gather_into_tensor.default,
    c10d_functional().reduce_scatter_tensor.default,
}


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Arguments ``node`` writes into: a mutating op's ``(a!)`` arguments.  (An
    ``auto_functionalized`` node writes nothing: it returns new values, read through
    ``getitem``; ``fix_functionalization`` turns it into the in-place call.)"""
    target = node.target
    if isinstance(target, OpOverload) and target._schema.is_mutable:
        args = target._schema.arguments
        bound = dict(zip((a.name for a in args), node.args), **node.kwargs)
        return [
            v
            for a in args
            if a.alias_info is not None and a.alias_info.is_write
            for v in [bound.get(a.name)]
            if isinstance(v, torch.fx.Node)
        ]
    return []


def attention_calls(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """The ``piecewise.attention`` calls of ``graph`` (direct, or inside
    ``auto_functionalized``/``_v2``), each as its bound arguments (nodes and constants)."""
    op = getattr(getattr(torch.ops, "piecewise", None), "attention", None)
    if op is None:
        return []
    calls = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is op.default:
            names = [a.name for a in op.default._schema.arguments]
            calls.append(dict(zip(names, node.args), **node.kwargs))
        elif (
            node.args
            and node.args[0] is op.default
            and isinstance(node.target, HigherOrderOperator)
        ):
            calls.append(dict(node.kwargs))
    return calls


@contextlib.contextmanager
def attention_context(graph: torch.fx.Graph, size: int) -> Iterator[None]:
    """A forward context in which the graph's attention ops see one consistent batch: a
    single request prefilling the ``size`` tokens the verifier feeds, each layer with its own
    zeroed KV cache (``torch`` backend).

    Without it a graph that contains attention (``splitting_ops=[]``) would run against the
    ambient context of the batch being traced: its slot mapping has that batch's token
    count, not the verifier's (``index_copy_`` size error), and the verifier would scatter
    random keys into the live KV cache.  A fresh cache per run keeps the graph before and
    after a pass on identical state."""
    calls = attention_calls(graph)
    if not calls:
        yield
        return
    block_size = 16
    num_blocks = -(-size // block_size)
    md = AttentionMetadata(
        attention_backend="torch",
        num_actual_tokens=size,
        num_reqs=1,
        max_query_len=size,
        max_seq_len=size,
        query_start_loc=torch.tensor([0, size], dtype=torch.int32),
        seq_lens=torch.tensor([size], dtype=torch.int32),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(size, dtype=torch.int64),
        query_start_loc_cpu=[0, size],
        seq_lens_cpu=[size],
    )
    caches = {}
    for call in calls:
        k = call["k"].meta["val"]
        hkv, d = (int(s) for s in k.shape[1:3])
        caches[call["layer_name"]] = torch.zeros(
            2, num_blocks, block_size, hkv, d, dtype=k.dtype, device=k.device
        )
    ctx = ForwardContext(
        attn_metadata={name: md for name in caches}, kv_caches=caches, slot_mapping=md.slot_mapping
    )
    with set_forward_context(ctx):
        yield
