"""piecewise::silu_and_mul (+ quant) and plain activation quant vs references, plus opcheck."""

import pytest
import torch
import torch.nn.functional as F

import passes.ops  # noqa: F401  (registers the ops)

ops = torch.ops.piecewise
QDTYPES = [torch.int8, torch.float8_e4m3fn]


def ref_silu_mul(x):
    i = x.shape[-1] // 2
    xf = x.double()
    return (xf[..., :i] * torch.sigmoid(xf[..., :i]) * xf[..., i:]).float()


def ref_quant(y, scale, dtype):
    if dtype == torch.int8:
        return torch.round(y / scale).clamp(-128, 127).to(torch.int8)
    return (y / scale).clamp(-448, 448).to(dtype)


def assert_quant_close(got, want, dtype):
    g, w = got.float(), want.float()
    if dtype == torch.int8:
        assert (g - w).abs().max() <= 1
        assert (g != w).float().mean() < 0.02
    else:
        torch.testing.assert_close(g, w, rtol=0.13, atol=2**-9)


def make(t=5, i=48, dtype=torch.bfloat16):
    return (2 * torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(0))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = make(dtype=dtype)
    out = torch.empty(5, 48, dtype=dtype)
    ops.silu_and_mul(out, x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref_silu_mul(x), **tol)
    # same as the unfused model code
    torch.testing.assert_close(out, F.silu(x[:, :48]) * x[:, 48:], **tol)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_silu_and_mul_static_quant(qdtype):
    x = make()
    out = torch.empty(5, 48, dtype=qdtype)
    ops.silu_and_mul_static_quant(out, x, torch.tensor([0.05]))
    assert_quant_close(out, ref_quant(ref_silu_mul(x), 0.05, qdtype), qdtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_silu_and_mul_dynamic_quant(qdtype):
    x = make()
    y = ref_silu_mul(x)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    want_scales = y.abs().amax(-1, keepdim=True) / qmax
    out, scales = torch.empty(5, 48, dtype=qdtype), torch.empty(5, 1)
    ops.silu_and_mul_dynamic_quant(out, x, scales)
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0)
    assert_quant_close(out, ref_quant(y, want_scales, qdtype), qdtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_static_scaled_quant(qdtype):
    x = make()
    out = torch.empty(x.shape, dtype=qdtype)
    ops.static_scaled_quant(out, x, torch.tensor([0.04]))
    assert torch.equal(out.float(), ref_quant(x.float(), 0.04, qdtype).float())


def test_static_int8_rounds_half_to_even_and_clamps():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 1000.0, -1000.0, 0.49]])
    out = torch.empty(x.shape, dtype=torch.int8)
    ops.static_scaled_quant(out, x, torch.tensor([1.0]))
    assert out.tolist() == [[0, 2, 2, 0, -2, 127, -128, 0]]


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_dynamic_per_token_quant_round_trip(qdtype):
    x = make()
    out, scales = torch.empty(x.shape, dtype=qdtype), torch.empty(5, 1)
    ops.dynamic_per_token_quant(out, x, scales)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    torch.testing.assert_close(scales, x.float().abs().amax(-1, keepdim=True) / qmax)
    assert torch.equal(out.float(), ref_quant(x.float(), scales, qdtype).float())
    # dequantized values within half a step (int8) / 1/16 relative (fp8) of the input
    err = (out.float() * scales - x.float()).abs()
    bound = scales / 2 + 1e-6 if qdtype == torch.int8 else x.float().abs() / 16 + scales
    assert (err <= bound).all()


def _opcheck_cases():
    x = make(t=3, i=16)
    s = torch.tensor([0.05])
    i8 = torch.empty(3, 16, dtype=torch.int8)
    f8 = torch.empty(3, 16, dtype=torch.float8_e4m3fn)
    return [
        (ops.silu_and_mul.default, (torch.empty(3, 16, dtype=x.dtype), x)),
        (ops.silu_and_mul_static_quant.default, (i8, x, s)),
        (ops.silu_and_mul_static_quant.default, (f8, x, s)),
        (ops.silu_and_mul_dynamic_quant.default, (i8, x, torch.empty(3, 1))),
        (ops.static_scaled_quant.default, (torch.empty(3, 32, dtype=torch.int8), x, s)),
        (
            ops.dynamic_per_token_quant.default,
            (torch.empty(3, 32, dtype=torch.int8), x, torch.empty(3, 1)),
        ),
        (
            ops.dynamic_per_token_quant.default,
            (torch.empty(3, 32, dtype=torch.float8_e4m3fn), x, torch.empty(3, 1)),
        ),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    # test_schema multiplies outputs, which CPU torch lacks for float8: skipped for fp8 only
    utils = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(op, args, test_utils=utils if fp8 else utils + ["test_schema"])


def test_fake_rejects_odd_gate_width():
    with torch._subclasses.FakeTensorMode():
        with pytest.raises(ValueError, match="silu_and_mul: x's last dimension must be even"):
            ops.silu_and_mul(torch.empty(2, 3), torch.empty(2, 7))
