"""piecewise::int8_scaled_mm / fp8_scaled_mm / int8_weight_only_mm vs float64 references."""

import pytest
import torch

import passes.ops  # noqa: F401  (registers the ops)
from passes.ops import scaled_mm

ops = torch.ops.piecewise


def ref_scaled_mm(x_q, x_scale, w_q, w_scale, bias):
    y = (x_q.double() @ w_q.double()) * x_scale.double() * w_scale.double()
    return y if bias is None else y + bias.double()


def make_int8(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_nk = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return x_q, w_nk


@pytest.mark.parametrize("m", [1, 3, 17, 33])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_scaled_mm(m, per_token, with_bias):
    x_q, w_nk = make_int8(m, 64, 40)
    x_scale = torch.rand(m, 1) * 0.01 if per_token else torch.tensor([0.004])
    w_scale = torch.rand(1, 40) * 0.01
    bias = torch.randn(40, dtype=torch.bfloat16) if with_bias else None
    y = ops.int8_scaled_mm(x_q, x_scale, w_nk.t(), w_scale, bias, torch.bfloat16)
    assert y.shape == (m, 40) and y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.double(), ref_scaled_mm(x_q, x_scale, w_nk.t(), w_scale, bias), rtol=1e-2, atol=1e-2
    )


def test_int8_scaled_mm_row_major_weight_and_scalar_weight_scale():
    x_q, w_nk = make_int8(4, 32, 24)
    w_kn = w_nk.t().contiguous()
    y = ops.int8_scaled_mm(
        x_q, torch.tensor([0.5]), w_kn, torch.tensor([0.25]), None, torch.float32
    )
    want = (x_q.double() @ w_kn.double()) * 0.125
    torch.testing.assert_close(y.double(), want)


@pytest.mark.parametrize("m", [1, 5])
def test_fp8_scaled_mm(m):
    g = torch.Generator().manual_seed(0)
    x_q = (torch.randn(m, 32, generator=g) * 50).to(torch.float8_e4m3fn)
    w_q = (torch.randn(24, 32, generator=g) * 50).to(torch.float8_e4m3fn)
    x_scale, w_scale = torch.rand(m, 1), torch.rand(1, 24)
    y = ops.fp8_scaled_mm(x_q, x_scale, w_q.t(), w_scale, None, torch.float32)
    torch.testing.assert_close(
        y.double(), ref_scaled_mm(x_q, x_scale, w_q.t(), w_scale, None), rtol=1e-5, atol=1e-3
    )


@pytest.mark.parametrize("m", [1, 8, 16, 17, 40])
@pytest.mark.parametrize("shape", [(64, 48), (40, 24)])  # packed-kernel shape, fallback shape
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_weight_only_mm(m, shape, dtype):
    """Covers both CPU paths: ``_weight_int8pack_mm`` (small M, K%32==0, N%16==0) and
    dequant + linear (everything else)."""
    k, n = shape
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) * 0.02
    bias = torch.randn(n, generator=g).to(dtype)
    y = ops.int8_weight_only_mm(x, w_q, w_scale, bias)
    want = x.double() @ (w_q.double() * w_scale.double()[:, None]).t() + bias.double()
    assert y.dtype == dtype and y.shape == (m, n)
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double(), want, **tol)


def test_weight_only_packed_path_is_selected_only_on_safe_shapes():
    x = torch.randn(4, 64)
    assert scaled_mm._packed_ok(x, torch.empty(48, 64, dtype=torch.int8))
    assert not scaled_mm._packed_ok(x, torch.empty(40, 64, dtype=torch.int8))  # N % 16
    assert not scaled_mm._packed_ok(x, torch.empty(48, 40, dtype=torch.int8))  # K % 32
    assert not scaled_mm._packed_ok(torch.randn(17, 64), torch.empty(48, 64, dtype=torch.int8))


def test_fake_errors_name_the_tensor():
    with torch._subclasses.FakeTensorMode():
        x_q = torch.empty(4, 32, dtype=torch.int8)
        w = torch.empty(32, 24, dtype=torch.int8)
        with pytest.raises(ValueError, match="x_scale must be"):
            ops.int8_scaled_mm(x_q, torch.empty(3, 1), w, torch.empty(1), None, torch.float32)
        with pytest.raises(ValueError, match="w_scale must be"):
            ops.int8_scaled_mm(x_q, torch.empty(1), w, torch.empty(1, 5), None, torch.float32)
        with pytest.raises(ValueError, match=r"expected x_q \[T, K\] and w_q \[K, N\]"):
            ops.int8_scaled_mm(x_q, torch.empty(1), w.t(), torch.empty(1), None, torch.float32)
        with pytest.raises(ValueError, match="must be torch.int8"):
            ops.int8_scaled_mm(x_q.float(), torch.empty(1), w, torch.empty(1), None, torch.float32)


def _opcheck_cases():
    x_q, w_nk = make_int8(5, 32, 16)
    f8x = torch.randn(5, 32).to(torch.float8_e4m3fn)
    f8w = torch.randn(16, 32).to(torch.float8_e4m3fn)
    return [
        (
            ops.int8_scaled_mm.default,
            (x_q, torch.rand(5, 1), w_nk.t(), torch.rand(1, 16), torch.randn(16), torch.bfloat16),
        ),
        (
            ops.int8_scaled_mm.default,
            (x_q, torch.rand(1), w_nk.t(), torch.rand(1), None, torch.float32),
        ),
        (
            ops.fp8_scaled_mm.default,
            (f8x, torch.rand(5, 1), f8w.t(), torch.rand(1, 16), None, torch.bfloat16),
        ),
        (
            ops.int8_weight_only_mm.default,
            (torch.randn(5, 32, dtype=torch.bfloat16), w_nk, torch.rand(16), None),
        ),
    ]


@pytest.mark.parametrize("case", range(4))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    # test_schema multiplies outputs, which CPU torch lacks for float8: skipped for fp8 only
    utils = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(op, args, test_utils=utils if fp8 else utils + ["test_schema"])
