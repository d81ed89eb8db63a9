"""Plain activation quantization: static per-tensor and dynamic per-token.

These are the ops a quantized linear emits before its scaled matmul; the fusion passes fold
them into a preceding RMSNorm or SiLU-and-mul.  Arithmetic: :mod:`passes.ops.quant_utils`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from framework.core.ops import define_op, if_installed
from passes.ops.quant_utils import (
    INT8_MAX,
    INT8_MIN,
    MIN_DYNAMIC_SCALE,
    check_out,
    quant_max,
    quantize,
)

_TRITON = "passes.ops.triton.activation"  # shares the row kernel with silu_and_mul


def static_scaled_quant_torch(out: Tensor, x: Tensor, scale: Tensor) -> None:
    """``out = quant(x / scale)``; out int8 or float8_e4m3fn with x's shape, scale fp32 [1]."""
    out.copy_(quantize(x, scale, out.dtype))


def dynamic_per_token_quant_torch(out: Tensor, x: Tensor, scales: Tensor) -> None:
    """Per-row absmax quant of ``x [T, K]`` into ``out``; fp32 scales ``[T, 1]`` written."""
    # Same arithmetic as per_token_scales + quantize, in fewer eager kernels (this is the
    # unfused CPU hot path): one fp32 scratch copy, absmax via an inf-norm, in-place steps.
    y = x.to(torch.float32, copy=True)
    torch.linalg.vector_norm(y, float("inf"), dim=-1, keepdim=True, out=scales)
    scales.div_(quant_max(out.dtype)).clamp_(min=MIN_DYNAMIC_SCALE)
    y.div_(scales)
    if out.dtype == torch.int8:
        y.round_().clamp_(INT8_MIN, INT8_MAX)
    else:
        y.clamp_(-quant_max(out.dtype), quant_max(out.dtype))
    out.copy_(y)


def _static_scaled_quant_fake(out, x, scale) -> None:
    check_out("piecewise::static_scaled_quant", out, x.shape)


def _dynamic_per_token_quant_fake(out, x, scales) -> None:
    check_out("piecewise::dynamic_per_token_quant", out, x.shape)


static_scaled_quant = define_op(
    "piecewise::static_scaled_quant",
    mutates_args=("out",),
    fake=_static_scaled_quant_fake,
    cuda=if_installed("triton", f"{_TRITON}:static_scaled_quant"),
)(static_scaled_quant_torch)
dynamic_per_token_quant = define_op(
    "piecewise::dynamic_per_token_quant",
    mutates_args=("out", "scales"),
    fake=_dynamic_per_token_quant_fake,
    cuda=if_installed("triton", f"{_TRITON}:dynamic_per_token_quant"),
)(dynamic_per_token_quant_torch)
