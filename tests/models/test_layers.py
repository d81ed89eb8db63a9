"""RMSNorm and MergedLinear (layers added for the decoder family)."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from models.layers import Linear, MergedLinear, RMSNorm


def test_rmsnorm_equals_transformers_bitwise():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 32, dtype=dtype)
        ours, ref = RMSNorm(32, eps=1e-5, dtype=dtype), LlamaRMSNorm(32, eps=1e-5).to(dtype)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(32))
            ref.weight.copy_(ours.weight)
        assert torch.equal(ours(x), ref(x)), dtype


def test_merged_linear_blocks():
    layer = MergedLinear(8, [6, 2, 2], bias=True)
    assert isinstance(layer, Linear) and layer.weight.shape == (10, 8)
    assert [layer.shard_bounds(i) for i in range(3)] == [(0, 6), (6, 2), (8, 2)]
