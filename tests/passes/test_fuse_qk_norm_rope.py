import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op
from model_forms import rms_norm

from framework.core.config import PassConfig
from models.rotary import RotaryEmbedding
from passes.manager import PassManager

aten, ops = torch.ops.aten, torch.ops.piecewise
HQ, HKV, D = 4, 2, 16


def qk_norm_rope(qkv, positions, q_w, k_w, cos_cache, sin_cache):
    """models.decoder.DecoderAttention.forward up to attention, Qwen3 (qk_norm) flavour."""
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q = q.view(-1, HQ, D)
    k = k.view(-1, HKV, D)
    v = v.view(-1, HKV, D)
    q = rms_norm(q, q_w)
    k = rms_norm(k, k_w)
    rope = _Rope(cos_cache, sin_cache)
    q, k = RotaryEmbedding.forward(rope, positions, q, k)
    return q * 1, k * 1, v * 1  # consumers (the attention op in a real piece)


class _Rope:  # the state RotaryEmbedding.forward reads
    def __init__(self, cos_cache, sin_cache):
        self.cos_cache, self.sin_cache = cos_cache, sin_cache


def test_qk_norm_rope_fused():
    dtype = torch.bfloat16
    pm = PassManager(PassConfig(passes=["noop_elimination", "fuse_qk_norm_rope"]), dtype=dtype)
    backend = TestBackend(pm)
    rotary = RotaryEmbedding(D, 64, 10000.0, None, dtype)
    args = [
        torch.randn(6, (HQ + 2 * HKV) * D, dtype=dtype),
        torch.tensor([3, 9, 0, 1, 2, 40]),
        torch.randn(D, dtype=dtype),
        torch.randn(D, dtype=dtype),
        rotary.cos_cache,
        rotary.sin_cache,
    ]
    out = compile_with(qk_norm_rope, backend, *args)
    assert count_op(backend.graph_before, aten.rsqrt) == 2
    assert count_op(backend.graph_after, ops.qk_norm_rope) == 1
    assert count_op(backend.graph_after, aten.rsqrt) == 0
    assert pm.stats()["fuse_qk_norm_rope"]["total_matches"] == 1
    assert_close_to_eager(out, qk_norm_rope(*args), dtype)
