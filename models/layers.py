"""Layers shared by model families.

``Linear`` keeps its math swappable without model-code changes: quantization (and any other
linear method) installs ``layer.linear_method`` -- an object with ``apply(layer, x)`` -- and
replaces or adds the layer's parameters/buffers once, at load time.  The model file never
imports a quantization scheme.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearMethod(Protocol):
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W: [out_features, in_features]``, ``x: [T, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.linear_method: Optional[LinearMethod] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_method is not None:
            return self.linear_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        method = type(self.linear_method).__name__ if self.linear_method else "dense"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, " \
               f"method={method}"
