"""Quantization helpers shared by the Triton kernels (same arithmetic as
:mod:`passes.ops.quant_utils`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from passes.ops.quant_utils import MIN_DYNAMIC_SCALE, quant_max  # noqa: F401  (re-exported)


@triton.jit
def quantize_values(y, scale, IS_INT8: tl.constexpr, QMAX: tl.constexpr):
    """fp32 ``y / scale`` rounded half-to-even (int8) and clamped; caller casts on store."""
    v = tl.div_rn(y, scale)  # IEEE division, like torch (plain `/` is approximate on CUDA)
    if IS_INT8:
        r = tl.floor(v + 0.5)
        tie = (r - v) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        v = tl.where(tie & odd, r - 1.0, r)
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
    else:
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    return v


def quant_params(out: torch.Tensor) -> dict:
    """Constexpr kwargs describing the quantized output dtype."""
    return dict(IS_INT8=out.dtype == torch.int8, QMAX=quant_max(out.dtype))


def rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as ``[rows, last]`` without copying (kernels write through it)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name}: cannot view shape {tuple(t.shape)} with strides "
            f"{t.stride()} as rows; pass a contiguous tensor"
        ) from None
