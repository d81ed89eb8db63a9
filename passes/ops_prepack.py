"""``piecewise::prepacked_linear(x, w, bias)``: a linear on a oneDNN-prepacked copy of ``w``.

Inductor prepacks weights for oneDNN only when they are constants (freezing); weights that
arrive as graph inputs are multiplied unpacked.  This op hides the packed tensor (opaque
``layout=torch._mkldnn``, which cannot be an Inductor graph input) behind a custom op: the
weight is packed ONCE per (address, shape, dtype) -- and again only if it is modified in place
(its version counter moves) -- then every call runs ``mkldnn._linear_pointwise``.

Decode-sized bf16 calls (at most ``small_m_linear.MAX_ROWS`` rows) run the hand-written
small-M kernel instead (:mod:`passes.small_m_linear`, its own packed layout, cached the same
way): oneDNN reaches ~12-17 GB/s on a GEMV here, the kernel streams the weight at close to the
machine's read bandwidth.  ``PIECEWISE_SMALL_M_LINEAR=0`` keeps every call on oneDNN.

Registration: :func:`framework.core.ops.define_op` with a CPU kernel only (the op exists
for oneDNN); the op is functional (no mutation, output never aliases an input) and passes
``opcheck``.
"""

from __future__ import annotations

from typing import Optional

import torch

from framework.core.ops import define_op
from passes.small_m_linear import clear_packed_weights as clear_small_m_weights
from passes.small_m_linear import run as small_m_run
from passes.small_m_linear import use_small_m
from passes.weight_cache import WeightCache

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed form of ``w [N, K]``, packed on first use."""
    return _PACKED.get(w)


_PACKED = WeightCache(lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous()))
"""One oneDNN-packed copy per weight, as long as the weight lives (remade if modified)."""


def clear_packed_weights() -> None:
    """Drop every packed weight, oneDNN's and the small-M kernel's (e.g. before loading new
    weights into the same buffers)."""
    _PACKED.clear()
    clear_small_m_weights()


def prepacked_linear_cpu(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    if x.dtype != w.dtype or w.dtype not in PACKABLE_DTYPES:
        raise TypeError(
            f"piecewise::prepacked_linear: x ({x.dtype}) and w ({w.dtype}) must "
            f"share a dtype in {PACKABLE_DTYPES}"
        )
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if use_small_m(x2, w):  # decode-sized bf16: the hand-written kernel (passes/small_m_linear.py)
        if bias is not None and (bias.shape != w.shape[:1] or bias.dtype != w.dtype):
            # the kernel reads the bias as w's dtype: a float32 bias would be read as garbage
            raise ValueError(
                f"piecewise::prepacked_linear: bias {tuple(bias.shape)} {bias.dtype} for "
                f"w {tuple(w.shape)} {w.dtype}"
            )
        out = small_m_run(x2, w, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), packed_weight(w), bias, "none", [], ""
        )
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w.shape[0])


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
