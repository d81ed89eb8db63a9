import pytest
import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import rms_norm

from framework.core.config import PassConfig
from passes.manager import PassManager

aten, ops = torch.ops.aten, torch.ops.piecewise


def two_norms(x, residual, w1, w2):
    r = x + residual  # residual add feeding a norm: fused
    h = rms_norm(r, w1)
    r2 = h * 2 + r  # second add: its sum is used only by the norm
    return rms_norm(r2, w2, 1e-5), r  # (eps differs: eps is a pattern wildcard)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm_fused_per_add(dtype):
    pm = PassManager(PassConfig(passes=["noop_elimination", "fuse_add_rmsnorm"]), dtype=dtype)
    backend = TestBackend(pm)
    args = [
        torch.randn(4, 32, dtype=dtype),
        torch.randn(4, 32, dtype=dtype),
        torch.randn(32, dtype=dtype),
        torch.randn(32, dtype=dtype),
    ]
    out = compile_with(two_norms, backend, *args)
    assert count_op(backend.graph_before, aten.rsqrt) == 2
    assert count_op(backend.graph_after, ops.fused_add_rms_norm) == 2
    assert count_op(backend.graph_after, aten.rsqrt) == 0
    assert count_op(backend.graph_after, aten.add.Tensor) == 0
    assert pm.stats()["fuse_add_rmsnorm"]["total_matches"] == 2
    assert_close_to_eager(out, two_norms(*args), dtype)


def test_norm_without_add_is_left_alone():
    pm = PassManager(PassConfig(passes=["fuse_add_rmsnorm"]), dtype=torch.float32)
    backend = TestBackend(pm)
    compile_with(lambda x, w: rms_norm(x, w) * 3, backend, torch.randn(2, 8), torch.randn(8))
    assert count_op(backend.graph_after, ops.fused_add_rms_norm) == 0
    assert pm.warn_unmatched() == ["fuse_add_rmsnorm"]
