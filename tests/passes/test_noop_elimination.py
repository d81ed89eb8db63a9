import torch
from graph_test_backend import TestBackend, compile_with, count_op
from torch.fx.experimental.proxy_tensor import make_fx

from framework.core.config import PassConfig
from passes.manager import PassManager

aten = torch.ops.aten


def redundant(x, w):
    v = x.view(-1, 8, 16).reshape(-1, 128)  # chain back to x's own shape
    s = v[:, 0:9223372036854775807]  # full slice
    return s.reshape(x.shape[0], 128) * w  # same-shape reshape


def _eager_piece(mode):
    return make_fx(redundant, tracing_mode=mode)(torch.randn(5, 128), torch.randn(128))


def test_eager_graph_loses_every_noop_view_and_slice():
    for mode in ("real", "symbolic"):  # concrete and symbolic token counts
        gm = _eager_piece(mode)
        assert count_op(gm, aten.view) + count_op(gm, aten.slice) > 0
        pm = PassManager(PassConfig(passes=["noop_elimination"]))
        gm = pm.run_on_graph_module(gm)
        assert count_op(gm, aten.view) == count_op(gm, aten.slice) == 0, gm.graph
        assert count_op(gm, aten.reshape) == 0 and count_op(gm, aten.mul) == 1
        assert pm.stats()["noop_elimination"]["total_matches"] >= 3
        x, w = torch.randn(3, 128), torch.randn(128)
        torch.testing.assert_close(gm(x, w), redundant(x, w))


def test_view_of_a_non_viewable_reshape_is_kept():
    def f(x):  # x.t() is not contiguous: the reshape copies, so view(x.t()) would fail
        return x.t().reshape(-1).view(4, 6) + 1

    gm = make_fx(f)(torch.randn(6, 4))
    gm = PassManager(PassConfig(passes=["noop_elimination"])).run_on_graph_module(gm)
    x = torch.randn(6, 4)
    torch.testing.assert_close(gm(x), f(x))


def test_inductor_piece_keeps_numerics():
    pm = PassManager(PassConfig(passes=["noop_elimination"]))
    backend = TestBackend(pm)
    x, w = torch.randn(5, 128), torch.randn(128)
    torch.testing.assert_close(compile_with(redundant, backend, x, w), redundant(x, w))
