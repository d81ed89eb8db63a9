"""``piecewise::prepacked_linear(x, w, bias)``: a linear on a oneDNN-prepacked copy of ``w``.

Inductor prepacks weights for oneDNN only when they are constants (freezing); weights that
arrive as graph inputs are multiplied unpacked.  This op hides the packed tensor (opaque
``layout=torch._mkldnn``, which cannot be an Inductor graph input) behind a custom op: the
weight is packed ONCE per (address, shape, dtype) -- and again only if it is modified in place
(its version counter moves) -- then every call runs ``mkldnn._linear_pointwise``.

Registration: :func:`framework.core.ops.define_op` with a CPU kernel only (the op exists
for oneDNN); the op is functional (no mutation, output never aliases an input) and passes
``opcheck``.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from framework.core.ops import define_op

_PACKED: dict[tuple, tuple[torch.Tensor, int]] = {}
"""(data_ptr, shape, dtype) -> (packed weight, weight version).  An entry lives exactly as long
as its weight (a finalizer drops it), so neither a dead model's packed copy is kept alive nor
can another tensor reuse the address while the entry exists."""

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed form of ``w [N, K]``, packed on first use."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype)
    entry = _PACKED.get(key)
    if entry is None or entry[1] != w._version:
        if entry is None:
            weakref.finalize(w, _PACKED.pop, key, None)
        entry = (torch.ops.mkldnn._reorder_linear_weight(w.contiguous()), w._version)
        _PACKED[key] = entry
    return entry[0]


def clear_packed_weights() -> None:
    """Drop every packed weight (e.g. before loading new weights into the same buffers)."""
    _PACKED.clear()


def prepacked_linear_cpu(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    if x.dtype != w.dtype or w.dtype not in PACKABLE_DTYPES:
        raise TypeError(
            f"piecewise::prepacked_linear: x ({x.dtype}) and w ({w.dtype}) must "
            f"share a dtype in {PACKABLE_DTYPES}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed_weight(w), bias, "none", [], "")
    return out.reshape(*lead, w.shape[0])


def _fake(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"piecewise::prepacked_linear: x has {x.shape[-1]} features, w is "
            f"{tuple(w.shape)} ([out_features, in_features])"
        )
    return x.new_empty((*x.shape[:-1], w.shape[0]))


prepacked_linear = define_op("piecewise::prepacked_linear", fake=_fake, default_key="cpu")(
    prepacked_linear_cpu
)


class PrepackedLinearMethod:
    """A ``linear_method`` for layers that run outside compiled graphs (the LM head): the
    same prepacked oneDNN path the ``prepack_linear`` pass gives graph linears."""

    @staticmethod
    def applies_to(layer: torch.nn.Module) -> bool:
        w = getattr(layer, "weight", None)
        return (
            mkldnn_available()
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.device.type == "cpu"
            and w.dtype in PACKABLE_DTYPES
            and getattr(layer, "linear_method", None) is None
        )

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return prepacked_linear(x, layer.weight, layer.bias)
