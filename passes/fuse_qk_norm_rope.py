"""Fuse Qwen3-style per-head q/k RMSNorm and rotary embedding into ``piecewise.qk_norm_rope``.

Matched form (``models.decoder.DecoderAttention`` with ``qk_norm``; rotate-half RoPE with
separate ``cos_cache``/``sin_cache [max_pos, D]`` indexed by ``positions``)::

    q, k, v = qkv.split([Hq*D, Hkv*D, Hkv*D], -1)
    q = rope(rms_norm(q.view(-1, Hq, D), q_weight))     # decomposed: ~40 aten nodes
    k = rope(rms_norm(k.view(-1, Hkv, D), k_weight))
    v = v.view(-1, Hkv, D)
    -> uses of (q, k, v)

After (the op wants one ``cos_sin`` table ``[*, D] = cat(cos[:, :D/2], sin[:, :D/2])``; it is
gathered for this step's tokens only, so the op indexes it with ``arange(T)``)::

    cs  = cat(index(cos_cache, [positions])[:, :D/2], index(sin_cache, [positions])[:, :D/2])
    af  = auto_functionalized(piecewise.qk_norm_rope, qkv=qkv, positions=arange(T),
                              q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cs,
                              num_heads=Hq, num_kv_heads=Hkv, head_dim=D, eps=eps,
                              is_neox=True)
    q, k, v = af[1].split([Hq*D, Hkv*D, Hkv*D], -1) viewed as [T, H, D]

``num_heads``/``num_kv_heads``/``eps`` are pattern wildcards; ``D`` comes from the weights.
"""

from __future__ import annotations

from typing import Iterable

import torch

import passes.ops.rope  # noqa: F401  (registers piecewise::qk_norm_rope)
from passes.fusion_patterns import EPS_DUMMY, rms_norm_hf, rope_neox
from passes.pattern_fusion import FusionPattern, PatternFusionPass, call_mutating, float_dtypes
from passes.registry import register_pass

# Trace values of the head counts: they become wildcards, so they must not equal any other
# integer in the traced pattern (dims, head_dim=16, its half 8, the token count 7).
NUM_HEADS_DUMMY, NUM_KV_HEADS_DUMMY = 5, 3


def _split(qkv, num_heads, num_kv_heads, head_dim):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(-1, num_heads, head_dim),
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
    )


def qk_norm_rope_pattern(
    qkv, positions, q_weight, k_weight, cos_cache, sin_cache, eps, num_heads, num_kv_heads
):
    q, k, v = _split(qkv, num_heads, num_kv_heads, q_weight.shape[0])
    q = rms_norm_hf(q, q_weight, eps)
    k = rms_norm_hf(k, k_weight, eps)
    q, k = rope_neox(positions, q, k, cos_cache, sin_cache)
    return q, k, v


def qk_norm_rope_replacement(
    qkv, positions, q_weight, k_weight, cos_cache, sin_cache, eps, num_heads, num_kv_heads
):
    head_dim = q_weight.shape[0]
    half = head_dim // 2
    cos_sin = torch.cat((cos_cache[positions][:, :half], sin_cache[positions][:, :half]), dim=-1)
    token_index = torch.arange(qkv.shape[0], device=qkv.device)
    (new_qkv,) = call_mutating(
        torch.ops.piecewise.qk_norm_rope.default,
        qkv=qkv,
        positions=token_index,
        q_weight=q_weight,
        k_weight=k_weight,
        cos_sin_cache=cos_sin,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=eps,
        is_neox=True,
    )
    return _split(new_qkv, num_heads, num_kv_heads, head_dim)


def _example_inputs(dtype: torch.dtype) -> list:
    t, d, width = 7, 16, (NUM_HEADS_DUMMY + 2 * NUM_KV_HEADS_DUMMY) * 16
    return [
        torch.randn(t, width, dtype=dtype),
        torch.arange(t),
        torch.randn(d, dtype=dtype),
        torch.randn(d, dtype=dtype),
        torch.randn(32, d, dtype=dtype),
        torch.randn(32, d, dtype=dtype),
    ]


# Experimental (O3) on both device types.
@register_pass(
    "fuse_qk_norm_rope", after=("noop_elimination",), levels={"cpu": 3, "cuda": 3}, fusion=True
)
class FuseQKNormRoPEPass(PatternFusionPass):
    __doc__ = __doc__

    def patterns(self) -> Iterable[FusionPattern]:
        for dtype in float_dtypes(self.context):
            yield FusionPattern(
                f"qk_norm_rope_neox_{dtype}",
                qk_norm_rope_pattern,
                qk_norm_rope_replacement,
                lambda dtype=dtype: _example_inputs(dtype),
                scalars={
                    "eps": EPS_DUMMY,
                    "num_heads": NUM_HEADS_DUMMY,
                    "num_kv_heads": NUM_KV_HEADS_DUMMY,
                },
            )
