"""piecewise::qk_norm_rope vs an HF-style reference (per-head RMSNorm then rotate_half)."""

import pytest
import torch

import passes.ops  # noqa: F401  (registers the ops)

ops = torch.ops.piecewise
HQ, HKV, D, EPS = 4, 2, 16, 1e-6


def cos_sin_cache(max_pos=32, d=D, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def ref_head_norm(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def ref_rope(x, pos, cache, is_neox):
    """HF Llama ``rotate_half`` (neox) / GPT-J ``rotate_every_two`` with full-width cos/sin."""
    cos, sin = cache.double()[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    if is_neox:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def make(t=5, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    positions = torch.tensor([0, 3, 7, 31, 2][:t])
    return qkv, positions, qw, kw


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_matches_reference(is_neox, dtype):
    qkv, pos, qw, kw = make(dtype=dtype)
    cache = cos_sin_cache()
    q, k, v = qkv.double().split([HQ * D, HKV * D, HKV * D], dim=-1)
    want_q = ref_rope(ref_head_norm(q.unflatten(-1, (HQ, D)), qw), pos, cache, is_neox)
    want_k = ref_rope(ref_head_norm(k.unflatten(-1, (HKV, D)), kw), pos, cache, is_neox)
    v_before = qkv[:, (HQ + HKV) * D :].clone()
    ops.qk_norm_rope(qkv, pos, qw, kw, cache, HQ, HKV, D, EPS, is_neox)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(qkv[:, : HQ * D].double(), want_q.flatten(1), **tol)
    torch.testing.assert_close(qkv[:, HQ * D : (HQ + HKV) * D].double(), want_k.flatten(1), **tol)
    assert torch.equal(qkv[:, (HQ + HKV) * D :], v_before)


def test_position_zero_is_plain_norm():
    qkv, _, qw, kw = make(t=1)
    q = qkv[:, : HQ * D].double().unflatten(-1, (HQ, D))
    ops.qk_norm_rope(qkv, torch.tensor([0]), qw, kw, cos_sin_cache(), HQ, HKV, D, EPS, True)
    torch.testing.assert_close(
        qkv[:, : HQ * D].double(), ref_head_norm(q, qw).flatten(1), atol=3e-2, rtol=1e-2
    )


@pytest.mark.parametrize("is_neox", [True, False])
def test_opcheck(is_neox):
    qkv, pos, qw, kw = make(t=3)
    torch.library.opcheck(
        ops.qk_norm_rope.default, (qkv, pos[:3], qw, kw, cos_sin_cache(), HQ, HKV, D, EPS, is_neox)
    )


def test_fake_rejects_wrong_packed_width():
    with torch._subclasses.FakeTensorMode():
        with pytest.raises(ValueError, match=r"qkv must be \[T, \(num_heads"):
            ops.qk_norm_rope(
                torch.empty(2, 10),
                torch.zeros(2, dtype=torch.long),
                torch.empty(D),
                torch.empty(D),
                torch.empty(8, D),
                HQ,
                HKV,
                D,
                EPS,
                True,
            )
