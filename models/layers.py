"""Layers shared by model families.

``Linear`` keeps its math swappable without model-code changes: quantization (and any other
linear method) installs ``layer.linear_method`` -- an object with ``apply(layer, x)`` -- and
replaces or adds the layer's parameters/buffers once, at load time.  The model file never
imports a quantization scheme.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearMethod(Protocol):
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class GreedyLinearMethod(Protocol):
    """A linear method that can also pick each row's greedy token in the same call (an LM
    head's kernel scanning the logits it writes): ``(logits [rows, N], index [rows] int64,
    maximum [rows] float32)`` -- each row's first maximum, a NaN first -- or None where it
    cannot for this call."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...

    def apply_greedy(
        self, layer: "Linear", x: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...


@runtime_checkable
class RecordingGreedyLinearMethod(GreedyLinearMethod, Protocol):
    """A :class:`GreedyLinearMethod` that can also say which native call its greedy kernel
    made: ``((logits, index, maximum), [address, kind, word...])`` -- the C function and its
    arguments as 64-bit words, empty where the call cannot be replayed from its words alone
    -- or None where it has no greedy kernel for this call.  What a caller that replays the
    head among other native calls records (``framework/engine/spec/draft_loop.py``)."""

    def record_greedy(
        self, layer: "Linear", x: torch.Tensor
    ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]]: ...


class Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W: [out_features, in_features]``, ``x: [T, in_features]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.linear_method: Optional[LinearMethod] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_method is not None:
            return self.linear_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        method = type(self.linear_method).__name__ if self.linear_method else "dense"
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"method={method}"
        )


class MergedLinear(Linear):
    """One ``Linear`` computing several projections at once (q/k/v, gate/up): one GEMM instead
    of several.  ``output_sizes`` are the row blocks of the weight, in order; the loader copies
    each checkpoint tensor into its block, and quantization methods can read the block bounds
    (e.g. for per-shard scales)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ):
        super().__init__(in_features, sum(output_sizes), bias=bias, dtype=dtype, device=device)
        self.output_sizes = list(output_sizes)

    def shard_bounds(self, index: int) -> tuple[int, int]:
        """(start, size) of block ``index`` along the output dim."""
        return sum(self.output_sizes[:index]), self.output_sizes[index]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 and cast back
    before the weight multiply -- the Hugging Face formulation, written plainly so compiler
    passes can pattern-match it (and so bf16 results match transformers bit for bit)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None, device=None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
