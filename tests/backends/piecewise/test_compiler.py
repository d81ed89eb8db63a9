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
