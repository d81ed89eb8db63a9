"""Rotary position embeddings (RoPE): inverse frequencies per scaling type, and the cos/sin cache.

Scaling types are a registry filled by :func:`register_rope_type`; each entry turns
``(head_dim, theta, params)`` into the fp32 inverse frequencies ``[head_dim // 2]``.  The math
mirrors ``transformers.modeling_rope_utils`` exactly, so logits match Hugging Face to fp32
round-off.  Any other type is rejected when the config is read (:func:`check_rope_scaling`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from framework.core.registry import Registry

InvFreqFn = Callable[[int, float, Mapping[str, Any]], torch.Tensor]
ROPE_TYPES: Registry[InvFreqFn] = Registry("RoPE type")


def register_rope_type(
    name: str, required: tuple[str, ...] = ()
) -> Callable[[InvFreqFn], InvFreqFn]:
    """Register an inverse-frequency function; ``required`` lists the keys it reads."""
    return ROPE_TYPES.register(name, required=required)


def supported_rope_types() -> list[str]:
    return ROPE_TYPES.names()


def _base_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    # Same expression as transformers (int64 arange cast to float) so the values are bit-equal.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)  # [D/2] fp32


@register_rope_type("default")
def _default_inv_freq(head_dim: int, theta: float, params: Mapping[str, Any]) -> torch.Tensor:
    return _base_inv_freq(head_dim, theta)


@register_rope_type("linear", required=("factor",))
def _linear_inv_freq(head_dim: int, theta: float, params: Mapping[str, Any]) -> torch.Tensor:
    # Scaling positions by 1/factor equals scaling the frequencies by 1/factor.
    return _base_inv_freq(head_dim, theta) / float(params["factor"])


@register_rope_type(
    "llama3",
    required=("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
)
def _llama3_inv_freq(head_dim: int, theta: float, params: Mapping[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(head_dim, theta)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def check_rope_scaling(scaling: Optional[Mapping[str, Any]], field: str = "rope_scaling") -> None:
    """Raise a ``ValueError`` naming ``field`` for an unsupported type or a missing key."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{field}: RoPE type {rope_type!r} is not supported; supported types are "
            f"{supported_rope_types()} (set {field} to null for plain RoPE)"
        )
    missing = [k for k in ROPE_TYPES.entry(rope_type).meta["required"] if k not in scaling]
    if missing:
        raise ValueError(
            f"{field}: RoPE type {rope_type!r} needs the key(s) {missing}; got {sorted(scaling)}"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{field}: partial_rotary_factor != 1 is not supported")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Optional[Mapping[str, Any]]
) -> torch.Tensor:
    """fp32 inverse frequencies ``[head_dim // 2]`` for the given scaling (None = plain RoPE)."""
    check_rope_scaling(scaling)
    params = scaling or {"rope_type": "default"}
    return ROPE_TYPES.get(params["rope_type"])(head_dim, theta, params)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin cache indexed by absolute positions.

    The caches are non-persistent buffers (not in the checkpoint): built in fp32 and cast to the
    model dtype, exactly like transformers' ``cos.to(x.dtype)``.  After building the model on the
    meta device, call :meth:`init_cache` once the module has real storage.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: Optional[Mapping[str, Any]],
        dtype: torch.dtype,
    ):
        super().__init__()
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer(
            "cos_cache", torch.empty(max_position, head_dim, dtype=dtype), persistent=False
        )  # [max_pos, D]
        self.register_buffer(
            "sin_cache", torch.empty(max_position, head_dim, dtype=dtype), persistent=False
        )  # [max_pos, D]
        if not self.cos_cache.is_meta:
            self.init_cache()

    @torch.no_grad()
    def init_cache(self) -> None:
        device = self.cos_cache.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)  # [D/2]
        pos = torch.arange(self.max_position, device=device).float()  # [max_pos]
        freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        self.cos_cache.copy_(emb.cos())
        self.sin_cache.copy_(emb.sin())

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated (q, k), same shapes."""
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cache[positions].unsqueeze(1)  # [T, 1, D]
        q = (q * cos) + (rotate_half(q) * sin)  # [T, Hq, D]
        k = (k * cos) + (rotate_half(k) * sin)  # [T, Hkv, D]
        return q, k

    def extra_repr(self) -> str:
        kind = self.scaling["rope_type"] if self.scaling else "default"
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, "
            f"theta={self.theta}, type={kind}"
        )
