"""The per-device kernel table behind every piecewise op."""
import pytest
import torch

import passes.ops  # noqa: F401  (registers the ops)
from passes.ops import kernel_registry as kr

ops = torch.ops.piecewise


def test_every_op_has_a_default_and_a_lazy_cuda_kernel():
    table = kr.registered_kernels()
    expected = {"rms_norm", "fused_add_rms_norm", "rms_norm_static_quant",
                "fused_add_rms_norm_static_quant", "rms_norm_dynamic_quant",
                "static_scaled_quant", "dynamic_per_token_quant", "silu_and_mul",
                "silu_and_mul_static_quant", "silu_and_mul_dynamic_quant", "qk_norm_rope",
                "int8_scaled_mm", "fp8_scaled_mm", "int8_weight_only_mm"}
    assert {name.split("::")[1] for name in table} >= expected
    for name in expected:
        entry = table[f"piecewise::{name}"]
        assert entry["default"].startswith("passes.ops.")
        if kr.triton_available():
            assert entry["cuda"].startswith("passes.ops.triton.")
            assert hasattr(torch.ops.piecewise, name)


def test_override_rebinds_every_caller_and_restores():
    calls = []

    def fake_kernel(out, x):
        calls.append(x.shape)
        out.fill_(7)

    x, out = torch.randn(2, 8), torch.empty(2, 4)
    compiled = torch.compile(lambda o, t: ops.silu_and_mul(o, t), backend="eager")
    previous = kr.override_kernel("piecewise::silu_and_mul", "cpu", fake_kernel)
    try:
        ops.silu_and_mul(out, x)
        assert (out == 7).all()
        compiled(out, x)
        assert len(calls) == 2
    finally:
        kr.override_kernel("piecewise::silu_and_mul", "cpu", previous)
    ops.silu_and_mul(out, x)
    assert not (out == 7).all() and len(calls) == 2


def test_lazy_import_path_resolves_once():
    kr.register_kernel("piecewise::_test_only", kernel="math:prod")
    try:
        assert kr.kernel_for("piecewise::_test_only", "cuda")([2, 3]) == 6
        assert callable(kr._KERNELS["piecewise::_test_only"]["default"])
    finally:
        kr._KERNELS.pop("piecewise::_test_only")


def test_errors_name_the_op():
    with pytest.raises(KeyError, match="no kernels registered for 'piecewise::nope'"):
        kr.kernel_for("piecewise::nope", "cpu")
    with pytest.raises(KeyError, match="unknown op 'piecewise::nope'"):
        kr.override_kernel("piecewise::nope", "cpu", print)
    with pytest.raises(ValueError, match="qualname must look like"):
        kr.register_kernel("rms_norm", kernel=print)


def test_importing_ops_does_not_import_triton():
    import subprocess
    import sys
    code = "import sys, passes.ops; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=__import__('pathlib').Path(__file__).parents[3])
    assert out.stdout.strip() == "False"
