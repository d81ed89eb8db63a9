"""Compiler adaptors are selected by name from one registry (plugins through the entry-point
group ``piecewise.compilers``); an unknown name is one clear error listing the registered
ones."""

import pytest
import torch

from backends.piecewise.compiler import (
    COMPILERS,
    CompilerAdaptor,
    Eager,
    InductorStandalone,
    make_compiler,
    register_compiler,
)


def test_builtins_are_registered_and_built_by_name():
    assert COMPILERS.entry_point_group == "piecewise.compilers"
    assert {"inductor", "eager"} <= set(COMPILERS.names())
    c = make_compiler("eager", inductor_config={"max_autotune": False})
    assert isinstance(c, Eager) and c.name == "eager" and not c.produces_artifacts
    assert InductorStandalone.produces_artifacts


def test_unknown_name_lists_the_registered_adaptors():
    with pytest.raises(ValueError, match=r"unknown compiler adaptor 'tvm'.*'eager', 'inductor'"):
        make_compiler("tvm")


def test_register_compiler_checks_the_class_and_name_clashes():
    with pytest.raises(TypeError, match="not a CompilerAdaptor"):
        register_compiler("zz_not_an_adaptor")(object)
    with pytest.raises(ValueError, match="already registered"):

        @register_compiler("eager")
        class OtherEager(CompilerAdaptor):
            pass


def test_a_registered_adaptor_compiles_a_piece():
    @register_compiler("zz_identity")
    class Identity(CompilerAdaptor):
        produces_artifacts = False

        def compile(self, graph, example_inputs, compile_range):
            return graph, None

    try:
        gm = torch.fx.symbolic_trace(lambda x: x + 1)
        fn, save = make_compiler("zz_identity").compile(gm, [torch.ones(2)], None)
        assert save is None and torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        COMPILERS.remove("zz_identity")


def test_inductor_pieces_leave_out_the_size_asserts_unless_asked(monkeypatch):
    """A piece's inputs have the layouts it was compiled for, so Inductor's per-call
    ``assert_size_stride`` checks are left out (``BASE_PATCHES``, in the adaptor's hash);
    ``inductor_config={"size_asserts": True}`` brings them back."""
    import backends.piecewise.compiler as compiler_mod
    from backends.piecewise.compiler import CompileRange

    sources = []
    load_lean = compiler_mod.load_lean
    monkeypatch.setattr(
        compiler_mod, "load_lean", lambda source, kernels: sources.append(source) or
        load_lean(source, kernels)
    )  # fmt: skip
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        return (torch.relu(x @ w) * 2 + 1,)

    plain, checked = (
        make_compiler("inductor"),
        make_compiler("inductor", inductor_config={"size_asserts": True}),
    )
    for c in (plain, checked):
        fn, _ = c.compile(torch.fx.symbolic_trace(f), [x, w], CompileRange(4, 4))
        torch.testing.assert_close(fn(x, w)[0], f(x, w)[0])
    assert len(sources) == 2
    assert "assert_size_stride(" not in sources[0] and "assert_size_stride(" in sources[1]
    assert plain.compute_hash() != checked.compute_hash()
