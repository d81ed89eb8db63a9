"""Plain-torch reference forms the fusion patterns are written in.

These are the computations as the models write them (Hugging Face style); the pattern matcher
traces them with Inductor's decompositions, so a model that computes the same thing the same
way produces the same aten subgraph and matches.  Keep them literally in the model's form:
an algebraically equal rewrite (``x.to(dt) * w`` for ``w * x.to(dt)``) is a different graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS_DUMMY = 1.2345e-5
"""Trace value of ``eps``: a wildcard in every pattern (must not clash with other constants)."""

Q_INT8 = torch.int8


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward``: normalise in fp32, cast back, then scale by ``weight``."""
    dtype = x.dtype
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def silu_and_mul_hf(x: torch.Tensor) -> torch.Tensor:
    """Gated MLP activation on a merged gate/up projection ``x [T, 2I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_sliced(x: torch.Tensor) -> torch.Tensor:
    """``models.decoder.DecoderMLP``: the same activation written with slices."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def quant_buffers(x: torch.Tensor, qdtype: torch.dtype = Q_INT8):
    """Example quantized output and per-token scales for ``x`` (trace inputs)."""
    return (
        torch.empty(x.shape, dtype=qdtype),
        torch.empty((*x.shape[:-1], 1), dtype=torch.float32),
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``models.rotary.rotate_half``: (x1, x2) -> (-x2, x1) over the halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_neox(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
):
    """``models.rotary.RotaryEmbedding.forward``: q [T, Hq, D], k [T, Hkv, D]; caches
    ``[max_pos, D]`` with duplicated halves, indexed by ``positions [T]``."""
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    return q, k
