import pytest
import torch
import torch.nn.functional as F
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import dynamic_quant, silu_mul, static_quant

from framework.core.config import PassConfig
from passes.manager import PassManager

aten, ops = torch.ops.aten, torch.ops.piecewise


def activations_then_quants(gate_up, other, scale, qdtype):
    q1, s1 = dynamic_quant(silu_mul(gate_up), qdtype)  # the model's sliced form
    gate, up = other.chunk(2, dim=-1)
    q2 = static_quant(F.silu(gate) * up, scale, qdtype)  # the chunk form
    act = torch.empty(other.shape[0], other.shape[1] // 2, dtype=other.dtype)
    ops.silu_and_mul(act, gate_up * 2)  # the op form
    q3, s3 = dynamic_quant(act, qdtype)
    return q1, s1, q2, q3, s3


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_silu_mul_quant_fused(qdtype):
    dtype = torch.bfloat16
    pm = PassManager(PassConfig(passes=["noop_elimination", "fuse_silu_mul_quant"]), dtype=dtype)
    backend = TestBackend(pm)
    args = [
        torch.randn(4, 64, dtype=dtype),
        torch.randn(4, 64, dtype=dtype),
        torch.tensor([0.01]),
        qdtype,
    ]
    out = compile_with(activations_then_quants, backend, *args)
    before, after = backend.graph_before, backend.graph_after
    assert count_op(before, aten.exp) == 2 and count_op(before, ops.silu_and_mul) == 1
    assert count_op(after, ops.silu_and_mul_dynamic_quant) == 2
    assert count_op(after, ops.silu_and_mul_static_quant) == 1
    for gone in (ops.dynamic_per_token_quant, ops.static_scaled_quant, ops.silu_and_mul, aten.exp):
        assert count_op(after, gone) == 0, gone
    assert pm.stats()["fuse_silu_mul_quant"]["total_matches"] == 3
    assert_close_to_eager(out, activations_then_quants(*args), dtype)


def test_unquantized_activation_is_left_to_inductor():
    pm = PassManager(PassConfig(passes=["fuse_silu_mul_quant"]), dtype=torch.float32)
    backend = TestBackend(pm)
    compile_with(lambda x: silu_mul(x) + 1, backend, torch.randn(2, 16))
    assert pm.stats()["fuse_silu_mul_quant"]["total_matches"] == 0
