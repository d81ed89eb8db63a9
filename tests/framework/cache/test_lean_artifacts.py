"""Lean artifacts (backends/piecewise/inductor_lean.py) through the Inductor adaptor: a plain piece
gets a lean form, runs it from the cold compile on, and it loads and matches; a piece
without one keeps the standard artifact, which still loads through Inductor."""

import torch

from backends.piecewise.compiler import CompileRange, make_compiler


def _piece(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    compiler = make_compiler("inductor")
    compiled, save = compiler.compile(gm, list(inputs), CompileRange(4, 4))
    return compiler, compiled, save


def test_plain_piece_round_trips_through_its_lean_form(tmp_path):
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        return (torch.relu(x @ w) * 2 + 1,)

    compiler, compiled, save = _piece(f, x, w)
    # a cold compile already runs the lean module, the code a warm start will run
    assert getattr(compiled, "lean", False)
    torch.testing.assert_close(compiled(x, w)[0], f(x, w)[0])
    save(tmp_path / "a.bin")
    loaded = compiler.load(tmp_path / "a.bin")
    assert getattr(loaded, "lean", False)
    torch.testing.assert_close(loaded(x, w)[0], f(x, w)[0])
    x2 = torch.randn(4, 8)  # a second call, fresh inputs
    torch.testing.assert_close(loaded(x2, w)[0], f(x2, w)[0])


def test_piece_without_lean_form_loads_through_inductor(tmp_path, monkeypatch):
    import backends.piecewise.compiler as compiler_module
    from backends.piecewise.inductor_lean import LeanUnsupported

    def refuse(artifact, metas):
        raise LeanUnsupported("refused by the test")

    monkeypatch.setattr(compiler_module, "export_lean", refuse)
    x = torch.randn(4, 8)

    def f(x):
        return (torch.sin(x) + 1,)

    compiler, compiled, save = _piece(f, x)
    assert not getattr(compiled, "lean", False)  # no lean form: the standard artifact runs
    save(tmp_path / "b.bin")
    loaded = compiler.load(tmp_path / "b.bin")
    assert not getattr(loaded, "lean", False)
    torch.testing.assert_close(loaded(x)[0], torch.sin(x) + 1)


def test_lean_piece_is_captured_and_replayed_by_the_graph_emulation(tmp_path):
    """A lean piece's kernels run outside the dispatcher too: the CUDA-graph emulation must
    record it as one launch (as it does Inductor's CompiledFxGraph) and replay it."""
    from framework.core.forward_context import (
        BatchDescriptor,
        CUDAGraphMode,
        ForwardContext,
        set_forward_context,
    )
    from framework.cudagraph.emulation import EmulatedGraphOps
    from framework.cudagraph.wrapper import CUDAGraphWrapper, clear_all_graphs

    x = torch.arange(8.0)

    def f(x):
        return (torch.sin(x * 2) + 1,)

    compiler, _, save = _piece(f, x)
    save(tmp_path / "c.bin")
    loaded = compiler.load(tmp_path / "c.bin")
    assert getattr(loaded, "lean", False)
    w = CUDAGraphWrapper(
        lambda t: loaded(t)[0], CUDAGraphMode.PIECEWISE, graph_ops=EmulatedGraphOps()
    )
    mode, desc = CUDAGraphMode.PIECEWISE, BatchDescriptor(8)
    context = ForwardContext(
        attn_metadata={}, kv_caches={}, cudagraph_runtime_mode=mode, batch_descriptor=desc
    )
    with set_forward_context(context):
        w(x)
        x.copy_(torch.linspace(-3, 3, 8))
        out = w(x)
    torch.testing.assert_close(out, torch.sin(x * 2) + 1)
    names = [launch.name for launch in w._entries[desc].graph.tape]
    clear_all_graphs()
    assert "inductor graph" in names, names
