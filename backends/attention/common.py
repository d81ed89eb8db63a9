"""Attention metadata, backend registry, CUDA-graph support levels, and the attention op.

The model calls ``torch.ops.piecewise.attention(q, k, v, out, layer_name, scale, window)``.
That op is what the compile backend splits around: it is opaque to Dynamo and Inductor,
runs eagerly, reads its per-layer metadata and KV cache from the forward context, and
dispatches to the attention backend named in the metadata (a registry, not an if-chain).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import torch

from framework.core.attention_metadata import AttentionMetadata
from framework.core.cudagraph_mode import AttentionCGSupport  # noqa: F401  (backends set it)
from framework.core.forward_context import get_forward_context
from framework.core.ops import define_op, set_direct_call
from framework.core.registry import Registry


class AttentionBackend:
    """Base class of attention backends; subclasses register with :func:`register_backend`."""

    name: ClassVar[str]
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int,
    ) -> None:
        """Write k/v into ``kv_cache`` at ``md.slot_mapping`` and attention into ``out``.

        Shapes: q/out ``[T, Hq, D]``, k/v ``[T, Hkv, D]``,
        kv_cache ``[2, num_blocks, block_size, Hkv, D]``.
        """
        raise NotImplementedError


BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend", entry_point_group="piecewise.attention_backends"
)


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        return BACKENDS.add(name, cls)

    return deco


def get_backend(name: str) -> type[AttentionBackend]:
    return BACKENDS.get(name)


def available_backends() -> list[str]:
    return BACKENDS.names()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
    scale: float,
    sliding_window: int,
) -> None:
    """Paged causal attention of one layer; the KV cache and metadata come from the forward
    context.  ``sliding_window`` <= 0 means no window."""
    ctx = get_forward_context()
    md: Optional[AttentionMetadata] = ctx.attn_metadata.get(layer_name)
    if md is None:
        raise RuntimeError(
            f"no attention metadata for layer {layer_name!r} in the forward "
            f"context (layers with metadata: {sorted(ctx.attn_metadata)[:4]}...)"
        )
    BACKENDS.get(md.attention_backend).forward(
        q, k, v, out, ctx.kv_caches[layer_name], md, scale, sliding_window
    )


def _attention_fake(q, k, v, out, layer_name, scale, sliding_window) -> None:
    return None


attention_op = define_op(
    "piecewise::attention",
    fake=_attention_fake,
    schema="(Tensor q, Tensor k, Tensor v, Tensor(a!) out, str layer_name, float scale, "
    "int sliding_window) -> ()",
)(attention)
# The op's one kernel is this Python body: the split module may call it without the
# dispatcher (backends/piecewise/split.py: bind_direct_splitting_ops).
set_direct_call("piecewise::attention", attention)
