"""The token symbol of fake example inputs set to one size: shapes, strides and offsets follow,
other symbols keep their example values."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from framework.core.symbolic import concrete_int, concretize_inputs, symbol_bindings


def _fake(mode, t, *dynamic):
    return mode.from_tensor(
        t,
        symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic]
        ),
    )


def test_token_symbol_sets_shape_stride_and_offset():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = _fake(mode, torch.randn(5, 8), True, False)
    view = x.t()  # stride (1, 8): the symbol sits in a stride
    n = x.shape[0]
    out = concretize_inputs([x, view, n, "const"], 3)
    assert out[0].shape == (3, 8) and out[0].stride() == (8, 1)
    assert out[1].shape == (8, 3) and out[1].stride() == (1, 8)
    assert out[2] == 3 and out[3] == "const"
    assert concrete_int(7, {}) == 7


def test_a_second_symbol_keeps_its_example_value():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    tokens = _fake(mode, torch.randn(5, 4), True, False)
    reqs = _fake(mode, torch.arange(2), True)  # another dynamic dim (e.g. requests), hint 2
    bindings = symbol_bindings([tokens, reqs], 9)
    assert sorted(bindings.values()) == [2, 9]
    a, b = concretize_inputs([tokens, reqs], 9)
    assert a.shape == (9, 4) and b.shape == (2,)
