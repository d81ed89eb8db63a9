"""QK-norm + rotary embedding (Qwen3 style), in place on the q and k parts of packed qkv.

``qkv [T, (Hq + 2*Hkv) * D]`` holds q heads, then k heads, then v heads.  For q and k: per-head
RMSNorm over ``D`` with ``q_weight`` / ``k_weight [D]``, then rotary embedding at
``positions [T]`` using ``cos_sin_cache [max_pos, D] = cat(cos[:, :D/2], sin[:, :D/2])``
(vLLM's layout).  ``is_neox``: rotate halves (HF Llama/Qwen ``rotate_half``); otherwise rotate
interleaved pairs (GPT-J).  v is untouched.  Norm and rotation run in fp32 with one rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from framework.core.ops import define_op, if_installed

_TRITON = "passes.ops.triton.rope"


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """Rotate ``x [..., D]`` by ``cos``/``sin`` broadcastable to ``[..., D/2]``."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def qk_norm_rope_torch(
    qkv: Tensor,
    positions: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos_sin_cache: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
) -> None:
    """In place on ``qkv``: per-head RMSNorm of q and k, then rotary embedding."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]: broadcast over heads
    for start, size, weight in ((0, q_size, q_weight), (q_size, kv_size, k_weight)):
        part = qkv[:, start : start + size].unflatten(-1, (size // head_dim, head_dim))
        h = part.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        part.copy_(apply_rotary(h, cos, sin, is_neox))


def _qk_norm_rope_fake(
    qkv,
    positions,
    q_weight,
    k_weight,
    cos_sin_cache,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
) -> None:
    name = "piecewise::qk_norm_rope"
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[-1] != width:
        raise ValueError(
            f"{name}: qkv must be [T, (num_heads + 2*num_kv_heads)*head_dim] = "
            f"[T, {width}], got {tuple(qkv.shape)}"
        )
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    for label, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,):
            raise ValueError(f"{name}: {label} has shape {tuple(w.shape)}, expected ({head_dim},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"{name}: cos_sin_cache must be [max_pos, head_dim={head_dim}], got "
            f"{tuple(cos_sin_cache.shape)}"
        )


qk_norm_rope = define_op(
    "piecewise::qk_norm_rope",
    mutates_args=("qkv",),
    fake=_qk_norm_rope_fake,
    cuda=if_installed("triton", f"{_TRITON}:qk_norm_rope"),
)(qk_norm_rope_torch)
