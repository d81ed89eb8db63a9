"""``inline_splitting_ops``: a splitting op's submodule becomes one call of the op's overload
in the split module's code, with the same arguments and results; anything else stays."""

from __future__ import annotations

import torch
import torch.fx as fx

import passes.ops  # noqa: F401  (defines piecewise::rms_norm)
from backends.piecewise.split import inline_splitting_ops, split_graph

RMS = torch.ops.piecewise.rms_norm


def model(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    y = x * 2.0
    RMS(out, y, w, 1e-6)  # the packet, as models call ops
    return out + 1.0


def _split() -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    split, pieces = split_graph(gm, ["piecewise::rms_norm"])
    assert [p.is_splitting_op for p in pieces] == [False, True, False]
    return split


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 8, generator=g), torch.randn(8, generator=g), torch.empty(3, 8)


def test_the_splitting_op_is_called_from_the_split_module_with_the_same_results():
    split = _split()
    x, w, out = _args()
    want = split(x, w, out.clone())
    assert sum(n.op == "call_module" for n in split.graph.nodes) == 3
    assert inline_splitting_ops(split) == 1
    calls = [n for n in split.graph.nodes if n.op == "call_function" and n.target is RMS.default]
    assert len(calls) == 1  # the packet resolved to its one overload
    (call,) = calls
    assert call.args[3] == 1e-6  # the constant argument kept
    assert sum(n.op == "call_module" for n in split.graph.nodes) == 2  # the two pieces
    assert "torch.ops.piecewise.rms_norm.default(" in split.code
    torch.testing.assert_close(split(x, w, out.clone()), want, rtol=0, atol=0)
    assert hasattr(split, "submod_1")  # the submodule stays, unused


def model_op_pieces(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    y = torch.ops.aten.mul.Tensor(x, 2.0)  # a piece that is one op call, its result used
    RMS(out, y, w, 1e-6)
    return torch.ops.aten.add.Tensor(out, 1.0)


def test_a_piece_that_is_one_op_call_whose_result_is_used_stays():
    gm = fx.symbolic_trace(model_op_pieces)
    split, pieces = split_graph(gm, ["piecewise::rms_norm"])
    assert [p.is_splitting_op for p in pieces] == [False, True, False]
    x, w, out = _args()
    want = split(x, w, out.clone())
    assert inline_splitting_ops(split) == 1  # only the splitting op
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [
        "submod_0",
        "submod_2",
    ]
    assert inline_splitting_ops(split) == 0  # nothing left to inline
    torch.testing.assert_close(split(x, w, out.clone()), want, rtol=0, atol=0)


def test_a_submodule_with_two_calls_stays():
    gm = fx.symbolic_trace(model)
    split, _ = split_graph(gm, ["piecewise::rms_norm"])
    sub = split.submod_1
    op = next(n for n in sub.graph.nodes if n.op == "call_function")
    with sub.graph.inserting_after(op):
        sub.graph.call_function(RMS.default, op.args)  # a second call in the submodule
    sub.recompile()
    assert inline_splitting_ops(split) == 0
    assert sum(n.op == "call_module" for n in split.graph.nodes) == 3


def test_a_splitting_op_with_a_direct_kernel_is_called_without_the_dispatcher(monkeypatch):
    """``bind_direct_splitting_ops``: an inlined op with a direct kernel runs it from the split
    module's own code, same results; under an override, a dispatch mode or the profiler the
    call goes through the dispatcher (they see the op)."""
    from backends.piecewise.split import bind_direct_splitting_ops
    from framework.compat.ops import TorchDispatchMode
    from framework.core import ops as core_ops

    split = _split()
    x, w, out = _args()
    want = split(x, w, out.clone())
    inline_splitting_ops(split)
    assert bind_direct_splitting_ops(split) == 0  # no direct kernel: nothing bound
    calls = []

    def direct(o, t, weight, eps):
        calls.append("direct")
        RMS.default(o, t, weight, eps)

    monkeypatch.setitem(core_ops._DIRECT, "piecewise::rms_norm", direct)
    assert bind_direct_splitting_ops(split) == 1
    assert "direct_rms_norm(" in split.code  # the switch, from the module's own code
    torch.testing.assert_close(split(x, w, out.clone()), want, rtol=0, atol=0)
    assert calls == ["direct"]

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.testing.assert_close(split(x, w, out.clone()), want, rtol=0, atol=0)
    assert calls == ["direct"] and seen.count("piecewise.rms_norm.default") == 1

    def zeros(o, t, weight, eps):
        o.zero_()

    with core_ops.override_kernel("piecewise::rms_norm", "cpu", zeros):
        got = split(x, w, out.clone())
    assert calls == ["direct"] and torch.equal(got, torch.ones_like(got))  # zeros + 1
