"""The C++ CPU kernels of the piecewise linear ops (passes/native_ops.py, csrc/torch_ops.cpp):
registered with the dispatcher, built once per machine (cached), the bf16 small-M call taken
in C++ without entering Python, errors as the Python body raises them, and the same results
as the Python body."""

import pytest
import torch

from framework.core.native_build import kernel_dir
from passes import native_ops
from passes import small_m_linear as small_m
from passes.ops.packed_linear import PackedLinearMethod, mkldnn_available

pytestmark = [
    pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)"),
    pytest.mark.skipif(
        not (small_m.kernel_available() and native_ops.load()),
        reason="the C++ op library does not build here",
    ),
]
BF16 = torch.bfloat16


def _layer(n, k, bias=True, max_rows=small_m.DEFAULT_MAX_ROWS):
    from models.layers import Linear

    layer = Linear(k, n, bias=bias, dtype=BF16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    method = PackedLinearMethod(max_rows)
    assert method.process(layer)
    layer.linear_method = method
    return layer


def test_every_op_has_a_cpp_cpu_kernel_and_the_build_is_cached():
    for op in native_ops.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"piecewise::{op}", "CPU"), op
    path = native_ops.LIBRARY.library_path()
    assert path.exists() and kernel_dir() in path.parents
    assert native_ops.LIBRARY.library_path() == path  # found again, not rebuilt
    assert "," in native_ops.isa()


@pytest.mark.parametrize("rows,max_rows", [(3, small_m.DEFAULT_MAX_ROWS), (40, 64), (64, 64)])
def test_bf16_small_m_call_runs_in_cpp_and_equals_the_python_body(monkeypatch, rows, max_rows):
    layer = _layer(96, 64, max_rows=max_rows)
    x = torch.randn(rows, 64).to(BF16)
    args = (x, layer.weight, layer.weight_md, layer.bias, 96, 64, max_rows)
    python = torch.ops.piecewise.packed_linear_python(*args)

    def no_python(*a, **k):
        raise AssertionError("the small-M call went through Python")

    monkeypatch.setattr(small_m, "run_packed", no_python)
    native = torch.ops.piecewise.packed_linear(*args)
    assert torch.equal(native, python)
    x3 = x.view(1, rows, 64)
    assert torch.equal(torch.ops.piecewise.packed_linear(x3, *args[1:]), python.view(1, rows, 96))


def test_cpp_errors_name_the_problem():
    layer = _layer(96, 64)
    x = torch.randn(1, 64).to(BF16)
    with pytest.raises(TypeError, match=r"x \(torch.float32\) and w \(torch.bfloat16\) differ"):
        torch.ops.piecewise.packed_linear(x.float(), layer.weight, None, None, 96, 64, 16)
    with pytest.raises(ValueError, match="bias .* torch.float32 for w .* torch.bfloat16"):
        torch.ops.piecewise.packed_linear(
            x, layer.weight, layer.weight_md, layer.bias.float(), 96, 64, 16
        )
