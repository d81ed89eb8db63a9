import pytest
import torch
import torch.nn.functional as F
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op

from framework.core.config import PassConfig
from passes import small_m_linear as small_m
from passes.manager import PassManager
from passes.ops_prepack import _PACKED, clear_packed_weights, mkldnn_available

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_and_numerics(dtype):
    x, w, b = (
        torch.randn(3, 64, dtype=dtype),
        torch.randn(48, 64, dtype=dtype),
        torch.randn(48, dtype=dtype),
    )
    for bias in (None, b):
        torch.library.opcheck(torch.ops.piecewise.prepacked_linear.default, (x, w, bias))
        out = torch.ops.piecewise.prepacked_linear(x, w, bias)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(out, F.linear(x, w, bias), atol=tol, rtol=tol)


def _cache_for(rows: int):
    """The cache a bf16 call of ``rows`` rows packs into: the small-M kernel's or oneDNN's."""
    if rows <= small_m.MAX_ROWS and small_m.kernel_available():
        return small_m._PACKED
    return _PACKED


@pytest.mark.parametrize("rows", [2, small_m.MAX_ROWS + 1])
def test_weight_packed_once_and_repacked_after_in_place_update(rows):
    clear_packed_weights()
    cache = _cache_for(rows)
    x = torch.randn(rows, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    torch.ops.piecewise.prepacked_linear(x, w, None)
    packed = cache.values()[0]
    torch.ops.piecewise.prepacked_linear(x, w, None)
    assert len(cache) == 1 and cache.values()[0] is packed
    w.mul_(2)  # weights reloaded in place: the version counter moves, the pack is redone
    out = torch.ops.piecewise.prepacked_linear(x, w, None)
    torch.testing.assert_close(out, F.linear(x, w), atol=5e-2, rtol=5e-2)


def test_linears_with_weight_inputs_are_rewritten():
    dtype = torch.bfloat16
    pm = PassManager(PassConfig(passes=["prepack_linear"]), dtype=dtype)
    backend = TestBackend(pm)

    def f(x, w1, b1, w2, w_int):
        h = F.linear(x, w1, b1)  # addmm
        y = F.linear(torch.relu(h), w2)  # mm
        return y, x.float() @ w_int.float().t()  # not a weight placeholder: kept

    args = [
        torch.randn(2, 32, dtype=dtype),
        torch.randn(48, 32, dtype=dtype),
        torch.randn(48, dtype=dtype),
        torch.randn(16, 48, dtype=dtype),
        torch.randint(-3, 3, (8, 32), dtype=torch.int8),
    ]
    out = compile_with(f, backend, *args)
    after = backend.graph_after
    assert count_op(after, torch.ops.piecewise.prepacked_linear) == 2
    assert count_op(after, aten.addmm) == 0 and count_op(after, aten.mm) == 1
    assert pm.stats()["prepack_linear"]["total_matches"] == 2
    assert_close_to_eager(out, f(*args), dtype)


def test_addmm_with_a_residual_input_becomes_linear_plus_add():
    dtype = torch.bfloat16
    pm = PassManager(PassConfig(passes=["prepack_linear"]), dtype=dtype)
    backend = TestBackend(pm)

    def f(x, w, r):
        return torch.addmm(r, x, w.t())  # residual folded into the matmul

    args = [
        torch.randn(3, 32, dtype=dtype),
        torch.randn(16, 32, dtype=dtype),
        torch.randn(3, 16, dtype=dtype),
    ]
    out = compile_with(f, backend, *args)
    assert count_op(backend.graph_after, torch.ops.piecewise.prepacked_linear) == 1
    assert count_op(backend.graph_after, aten.addmm) == 0
    assert_close_to_eager(out, f(*args), dtype)


@pytest.mark.parametrize("rows", [2, small_m.MAX_ROWS + 1])
def test_packed_copy_dies_with_its_weight(rows):
    import gc

    clear_packed_weights()
    cache = _cache_for(rows)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    torch.ops.piecewise.prepacked_linear(torch.randn(rows, 32, dtype=torch.bfloat16), w, None)
    assert len(cache) == 1
    del w
    gc.collect()
    assert len(cache) == 0
