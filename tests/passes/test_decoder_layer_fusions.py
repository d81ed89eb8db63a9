"""All fusions together on a hand-written Llama-style layer with quantized linears (the ops a
``passes.quant_schemes`` linear emits), with the differential check on."""

import pytest
import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import dynamic_quant, rms_norm, silu_mul

from framework.core.config import PassConfig
from passes.manager import PassManager

aten, ops = torch.ops.aten, torch.ops.piecewise
H, INTER, LAYERS = 32, 64, 2
PASSES = [
    "noop_elimination",
    "fuse_add_rmsnorm",
    "fuse_rmsnorm_quant",
    "fuse_silu_mul_quant",
    "fix_functionalization",
]
PER_LAYER = {"fuse_add_rmsnorm": 2, "fuse_rmsnorm_quant": 2, "fuse_silu_mul_quant": 1}


def quantize(w, qdtype):
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    scale = w.float().abs().amax(dim=1, keepdim=True) / qmax
    q = w.float() / scale
    q = q.round().clamp(-128, 127).to(qdtype) if qdtype == torch.int8 else q.to(qdtype)
    return q, scale.t().contiguous()


def scaled_linear(x, w_q, w_s):
    x_q, x_s = dynamic_quant(x, w_q.dtype)
    mm = ops.int8_scaled_mm if w_q.dtype == torch.int8 else ops.fp8_scaled_mm
    return mm(x_q, x_s, w_q.t(), w_s, None, x.dtype)


def layers(attn_out, residual, *weights):
    """From one layer's attention output to the next layer's qkv projection (one piece)."""
    for i in range(LAYERS):
        w_post, w_next, gu_q, gu_s, down_q, down_s, qkv_q, qkv_s = weights[8 * i : 8 * i + 8]
        residual = attn_out + residual
        h = rms_norm(residual, w_post)
        h = scaled_linear(silu_mul(scaled_linear(h, gu_q, gu_s)), down_q, down_s)
        residual = h + residual
        attn_out = scaled_linear(rms_norm(residual, w_next), qkv_q, qkv_s)
        attn_out = attn_out[:, :H]  # stands in for attention + o_proj
    return attn_out, residual


class _Range:
    start, end = 1, 64


@pytest.mark.parametrize(
    "qdtype, dynamic_tokens",
    [(torch.int8, False), (torch.float8_e4m3fn, False), (torch.int8, True)],
    ids=["int8_per_token", "fp8_per_token", "int8_per_token-symbolic_tokens"],
)
def test_match_count_per_layer_and_numerics(qdtype, dynamic_tokens):
    dtype = torch.bfloat16
    torch.manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        weights += [torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype)]
        for n, k in ((2 * INTER, H), (H, INTER), (3 * H, H)):
            weights += quantize(torch.randn(n, k, dtype=dtype) / k**0.5, qdtype)
    args = [torch.randn(4, H, dtype=dtype), torch.randn(4, H, dtype=dtype), *weights]
    pm = PassManager(PassConfig(passes=PASSES, verify_passes=True), dtype=dtype)
    backend = TestBackend(pm)
    if dynamic_tokens:  # as in a piece: only the token count is symbolic
        torch._dynamo.reset()
        for a in args[:2]:
            torch._dynamo.mark_dynamic(a, 0)
        pm.set_current_piece("piece", _Range())  # verify runs with min(end, 8) tokens
        out = torch.compile(layers, backend=backend, fullgraph=True)(*args)
    else:
        out = compile_with(layers, backend, *args)

    stats = pm.stats()
    for name, per_layer in PER_LAYER.items():
        assert stats[name]["total_matches"] == per_layer * LAYERS, name
    after = backend.graph_after
    assert count_op(after, ops.rms_norm_dynamic_quant) == 2 * LAYERS
    assert count_op(after, ops.silu_and_mul_dynamic_quant) == LAYERS
    assert count_op(after, ops.dynamic_per_token_quant) == 0
    assert count_op(after, aten.rsqrt) == 0
    for name in PER_LAYER:  # verify_passes measured every fusion
        assert stats[name]["pieces"][0]["max_abs_error"] is not None
    assert pm.warn_unmatched() == []
    assert_close_to_eager(out, layers(*args), dtype, relative_to_max=True)
