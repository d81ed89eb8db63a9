"""piecewise::rms_norm family vs straightforward references, plus opcheck."""

import pytest
import torch

import passes.ops  # noqa: F401  (registers the ops)

ops = torch.ops.piecewise
EPS = 1e-6
QDTYPES = [torch.int8, torch.float8_e4m3fn]


def ref_rms(x, w, eps=EPS):
    xf = x.double()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def ref_quant(y, scale, dtype):
    if dtype == torch.int8:
        return torch.round(y / scale).clamp(-128, 127).to(torch.int8)
    return (y / scale).clamp(-448, 448).to(dtype)


def assert_quant_close(got, want, dtype):
    """int8: at most one step off (rounding of values at .5 after fp32 reductions);
    fp8: at most one e4m3 step (relative 1/8)."""
    g, w = got.float(), want.float()
    if dtype == torch.int8:
        assert (g - w).abs().max() <= 1
        assert (g != w).float().mean() < 0.02
    else:
        torch.testing.assert_close(g, w, rtol=0.13, atol=2**-9)


def make(t=5, h=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    residual = torch.randn(t, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return x, residual, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    x, _, w = make(dtype=dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, EPS)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref_rms(x, w), **tol)


def test_rms_norm_leading_dims_and_output_dtype():
    x, _, w = make(t=6)
    x3 = x.view(2, 3, 64)
    out = torch.empty(2, 3, 64, dtype=torch.float32)
    ops.rms_norm(out, x3, w, EPS)
    torch.testing.assert_close(out, ref_rms(x3, w), atol=1e-5, rtol=1e-5)


def test_fused_add_rms_norm_in_place():
    x, residual, w = make()
    want_res = x + residual  # eager bf16 add, as the unfused model does
    want = ref_rms(want_res, w)
    ops.fused_add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, want_res)
    torch.testing.assert_close(x.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_rms_norm_static_quant(qdtype):
    x, _, w = make()
    scale = torch.tensor([0.02])
    out = torch.empty(x.shape, dtype=qdtype)
    ops.rms_norm_static_quant(out, x, w, scale, EPS)
    assert_quant_close(out, ref_quant(ref_rms(x, w), 0.02, qdtype), qdtype)


def test_static_quant_saturates():
    x, _, w = make()
    out = torch.empty(x.shape, dtype=torch.int8)
    ops.rms_norm_static_quant(out, x, w, torch.tensor([1e-4]), EPS)
    assert out.max() == 127 and out.min() == -128


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_fused_add_rms_norm_static_quant(qdtype):
    x, residual, w = make()
    x0, want_res = x.clone(), x + residual
    out = torch.empty(x.shape, dtype=qdtype)
    ops.fused_add_rms_norm_static_quant(out, x, residual, w, torch.tensor([0.03]), EPS)
    assert torch.equal(residual, want_res) and torch.equal(x, x0)
    assert_quant_close(out, ref_quant(ref_rms(want_res, w), 0.03, qdtype), qdtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_dynamic_quant(qdtype, with_residual):
    x, residual, w = make()
    normed_input = x + residual if with_residual else x
    y = ref_rms(normed_input, w)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    want_scales = y.abs().amax(-1, keepdim=True) / qmax
    out = torch.empty(x.shape, dtype=qdtype)
    scales = torch.empty(x.shape[0], 1)
    ops.rms_norm_dynamic_quant(out, x, w, scales, EPS, residual if with_residual else None)
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0)
    assert_quant_close(out, ref_quant(y, want_scales, qdtype), qdtype)
    if with_residual:
        assert torch.equal(residual, normed_input)
    # per token the largest magnitude maps to the edge of the range
    if qdtype == torch.int8:
        assert (out.float().abs().amax(-1) >= 126).all()


def test_dynamic_quant_zero_row_is_finite():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    out, scales = torch.empty(2, 64, dtype=torch.int8), torch.empty(2, 1)
    ops.rms_norm_dynamic_quant(out, x, torch.ones(64, dtype=torch.bfloat16), scales, EPS, None)
    assert torch.isfinite(scales).all() and (scales > 0).all() and (out == 0).all()


def test_fake_rejects_wrong_weight_and_out_shape():
    """Shape errors surface at trace time (the fake runs under FakeTensorMode), naming the
    op and the tensor."""
    with torch._subclasses.FakeTensorMode():
        x, w = torch.empty(5, 64), torch.empty(64)
        with pytest.raises(ValueError, match="rms_norm: weight has shape"):
            ops.rms_norm(torch.empty(5, 64), x, torch.empty(32), EPS)
        with pytest.raises(ValueError, match="rms_norm_static_quant: out has shape"):
            ops.rms_norm_static_quant(
                torch.empty(5, 32, dtype=torch.int8), x, w, torch.empty(1), EPS
            )
        with pytest.raises(ValueError, match="torch.int8 or torch.float8_e4m3fn"):
            ops.rms_norm_static_quant(torch.empty(5, 64), x, w, torch.empty(1), EPS)


def _opcheck_cases():
    x, r, w = make(t=3, h=32)
    s = torch.tensor([0.05])
    i8 = torch.empty(3, 32, dtype=torch.int8)
    f8 = torch.empty(3, 32, dtype=torch.float8_e4m3fn)
    return [
        (ops.rms_norm.default, (torch.empty_like(x), x, w, EPS)),
        (ops.fused_add_rms_norm.default, (x.clone(), r.clone(), w, EPS)),
        (ops.rms_norm_static_quant.default, (i8, x, w, s, EPS)),
        (ops.rms_norm_static_quant.default, (f8, x, w, s, EPS)),
        (ops.fused_add_rms_norm_static_quant.default, (i8, x, r.clone(), w, s, EPS)),
        (ops.rms_norm_dynamic_quant.default, (i8, x, w, torch.empty(3, 1), EPS, None)),
        (ops.rms_norm_dynamic_quant.default, (f8, x, w, torch.empty(3, 1), EPS, r.clone())),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args, test_utils=opcheck_utils(args))


def opcheck_utils(args):
    """All opcheck tests, except that ``test_schema`` is skipped for fp8 tensors: its
    aliasing check multiplies outputs, which CPU torch does not implement for float8."""
    utils = [
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    ]
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        utils.remove("test_schema")
    return utils
