"""The attention layer as the model sees it: one call of the ``piecewise::attention`` custom op.

The module holds no weights.  It knows its ``layer_name`` -- the key under which the forward
context holds this layer's metadata and KV cache -- and calls the opaque op, which is where the
compile backend splits the graph.  Importing ``backends.attention`` registers the op.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import backends.attention  # noqa: F401  (registers torch.ops.piecewise.attention)


class PagedAttention(nn.Module):
    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = -1,
    ):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> attention output [T, Hq, D]."""
        out = torch.empty_like(q)  # [T, Hq, D]
        torch.ops.piecewise.attention(
            q, k, v, out, self.layer_name, self.scale, self.sliding_window
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name!r}, heads={self.num_heads}/{self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.sliding_window}"
        )
