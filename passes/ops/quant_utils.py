"""Shared quantization arithmetic of the fused ops (plain torch; also the test oracle).

Conventions, identical in the Triton kernels:

* quantized value ``q = clamp(round(x / scale), -127..127 range)``, computed in fp32;
  int8 rounds half to even (like ``torch.round`` and CUDA ``rint``) and clamps to
  [-128, 127]; fp8 e4m3 clamps to [-448, 448] then casts (round to nearest even).
* dynamic per-token scale ``= max(absmax(row) / qmax, MIN_DYNAMIC_SCALE)``; the floor keeps
  all-zero rows finite (they quantize to 0).
* scales are fp32; static scales are 1-element tensors, per-token scales ``[..., 1]``.
"""

from __future__ import annotations

import torch

INT8_MIN, INT8_MAX = -128, 127
FP8_E4M3_MAX = 448.0
MIN_DYNAMIC_SCALE = 1e-10

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def quant_max(dtype: torch.dtype) -> float:
    """Largest magnitude a per-token scale maps to (127 for int8, 448 for fp8 e4m3)."""
    if dtype == torch.int8:
        return float(INT8_MAX)
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    raise ValueError(
        f"quantized output dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}"
    )


def check_out(name: str, out: torch.Tensor, shape: torch.Size | tuple) -> None:
    """Fail with the op and tensor named when ``out`` is not a quantized tensor of ``shape``."""
    quant_max(out.dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded and clamped into ``dtype``; ``scale`` broadcasts against ``x``."""
    y = x.float() / scale.float()
    if dtype == torch.int8:
        return y.round_().clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    qmax = quant_max(dtype)
    return y.clamp_(-qmax, qmax).to(dtype)


def per_token_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales ``[..., 1]`` mapping each row's absmax onto the dtype's range."""
    absmax = x.float().abs().amax(dim=-1, keepdim=True)
    return (absmax / quant_max(dtype)).clamp_(min=MIN_DYNAMIC_SCALE)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` (test helper and weight-only fallback)."""
    return q.float() * scale.float()
