import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import dynamic_quant, rms_norm
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

from framework.core.config import PassConfig
from passes.manager import PassManager

ops = torch.ops.piecewise


def functional_nodes(graph):
    return sum(1 for n in graph.nodes if n.target in (auto_functionalized, auto_functionalized_v2))


def test_fused_ops_on_fresh_buffers_run_in_place():
    dtype = torch.bfloat16
    pm = PassManager(
        PassConfig(
            passes=[
                "noop_elimination",
                "fuse_add_rmsnorm",
                "fuse_rmsnorm_quant",
                "fix_functionalization",
            ]
        ),
        dtype=dtype,
    )
    backend = TestBackend(pm)

    def f(x, residual, w):
        r = x * 2 + residual  # fresh tensor, dead after the fused op
        q, s = dynamic_quant(rms_norm(r, w))
        return q, s, r

    args = [
        torch.randn(4, 32, dtype=dtype),
        torch.randn(4, 32, dtype=dtype),
        torch.randn(32, dtype=dtype),
    ]
    out = compile_with(f, backend, *args)
    after = backend.graph_after
    assert count_op(after, ops.rms_norm_dynamic_quant) == 1
    assert functional_nodes(after) == 0, after
    assert pm.stats()["fix_functionalization"]["total_matches"] == 1
    assert_close_to_eager(out, f(*args), dtype)


def test_unsafe_mutations_stay_functional():
    pm = PassManager(PassConfig(passes=["fix_functionalization"]))
    backend = TestBackend(pm)

    def f(x, residual, w):
        ops.fused_add_rms_norm(x, residual, w, 1e-6)  # mutates graph inputs
        h = x * 1.5
        keep = h + 0  # h is read after the op mutates it
        r = residual * 3
        ops.fused_add_rms_norm(h, r, w, 1e-6)
        return h + keep, r

    args = [torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)]
    expected = f(*[a.clone() for a in args])
    out = compile_with(f, backend, *[a.clone() for a in args])
    assert functional_nodes(backend.graph_before) == 2
    assert functional_nodes(backend.graph_after) == 2
    assert pm.stats()["fix_functionalization"]["total_matches"] == 0
    assert_close_to_eager(out, expected, torch.float32)
