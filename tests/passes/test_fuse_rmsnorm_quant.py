import pytest
import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import dynamic_quant, rms_norm, static_quant

from framework.core.config import PassConfig
from passes.manager import PassManager

aten, ops = torch.ops.aten, torch.ops.piecewise


def norms_then_quants(x, residual, w1, w2, w3, scale, qdtype):
    q1, s1 = dynamic_quant(rms_norm(x, w1), qdtype)  # norm -> dynamic quant
    r = x + residual
    q2 = static_quant(rms_norm(r, w2), scale, qdtype)  # add + norm -> static quant
    r2 = x * 2 + r
    q3, s3 = dynamic_quant(rms_norm(r2, w3), qdtype)  # add + norm -> dynamic quant
    return q1, s1, q2, q3, s3, r2


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("after_add_fusion", [True, False], ids=["after_add", "decomposed"])
def test_norm_quant_fused(qdtype, after_add_fusion):
    dtype = torch.bfloat16
    names = ["noop_elimination", "fuse_rmsnorm_quant"]
    if after_add_fusion:
        names.insert(1, "fuse_add_rmsnorm")
    pm = PassManager(PassConfig(passes=names), dtype=dtype)
    backend = TestBackend(pm)
    args = [
        torch.randn(4, 32, dtype=dtype),
        torch.randn(4, 32, dtype=dtype),
        *[torch.randn(32, dtype=dtype) for _ in range(3)],
        torch.tensor([0.02]),
        qdtype,
    ]
    out = compile_with(norms_then_quants, backend, *args)
    before, after = backend.graph_before, backend.graph_after
    assert count_op(before, ops.dynamic_per_token_quant) == 2
    assert count_op(before, ops.static_scaled_quant) == 1
    assert count_op(after, ops.rms_norm_dynamic_quant) == 2
    assert count_op(after, ops.fused_add_rms_norm_static_quant) == 1
    for gone in (
        ops.dynamic_per_token_quant,
        ops.static_scaled_quant,
        ops.fused_add_rms_norm,
        aten.rsqrt,
    ):
        assert count_op(after, gone) == 0, gone
    assert pm.stats()["fuse_rmsnorm_quant"]["total_matches"] == 3
    assert_close_to_eager(out, norms_then_quants(*args), dtype)
