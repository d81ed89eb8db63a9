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


def quant_buffers(x: torch.Tensor, qdtype: torch.dtype = Q_INT8):
    """Example quantized output and per-token scales for ``x`` (trace inputs)."""
    return (torch.empty(x.shape, dtype=qdtype),
            torch.empty((*x.shape[:-1], 1), dtype=torch.float32))
