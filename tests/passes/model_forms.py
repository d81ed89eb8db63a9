"""The computations the fusion passes must match, written as the models and the quantized
linears write them (models.layers.RMSNorm, models.decoder.DecoderMLP, passes.quant_schemes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import passes.ops  # noqa: F401  (registers the piecewise ops)
from models.layers import RMSNorm

ops = torch.ops.piecewise
EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The model's ``RMSNorm.forward`` itself, with ``weight`` as a function input."""
    return RMSNorm.forward(_NormState(weight, eps), x)


class _NormState:  # what RMSNorm.forward reads from self
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def dynamic_quant(x: torch.Tensor, qdtype: torch.dtype = torch.int8):
    x = x.reshape(-1, x.shape[-1])
    x_q = torch.empty(x.shape, dtype=qdtype, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    ops.dynamic_per_token_quant(x_q, x, scales)
    return x_q, scales


def static_quant(x: torch.Tensor, scale: torch.Tensor, qdtype: torch.dtype = torch.int8):
    x = x.reshape(-1, x.shape[-1])
    x_q = torch.empty(x.shape, dtype=qdtype, device=x.device)
    ops.static_scaled_quant(x_q, x, scale)
    return x_q


def quantize_weight(w: torch.Tensor):
    """Per-channel int8 ``[N, K]`` weight and fp32 ``[1, N]`` scales (test data)."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
    return (w.float() / scale).round().clamp(-128, 127).to(torch.int8), scale.t().contiguous()


def int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_s = dynamic_quant(x)
    return ops.int8_scaled_mm(x_q, x_s, w_q.t(), w_scale, None, x.dtype)
