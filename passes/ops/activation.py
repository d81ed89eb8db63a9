"""SiLU-and-mul (the gated MLP activation), alone and with static / dynamic output quant.

``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`` in fp32, written once into ``out [..., I]``.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from framework.core.ops import define_op, if_installed
from passes.ops.quant_utils import check_out, per_token_scales, quantize

_TRITON = "passes.ops.triton.activation"


def _silu_mul(x: Tensor) -> Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _gated_shape(name: str, x: Tensor) -> tuple[int, ...]:
    if x.shape[-1] % 2:
        raise ValueError(
            f"{name}: x's last dimension must be even (gate and up halves), got {x.shape[-1]}"
        )
    return (*x.shape[:-1], x.shape[-1] // 2)


def silu_and_mul_torch(out: Tensor, x: Tensor) -> None:
    """``out [T, I] = silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``."""
    out.copy_(_silu_mul(x))


def silu_and_mul_static_quant_torch(out: Tensor, x: Tensor, scale: Tensor) -> None:
    """``out = quant(silu_and_mul(x) / scale)``; out int8 or float8_e4m3fn, scale fp32 [1]."""
    out.copy_(quantize(_silu_mul(x), scale, out.dtype))


def silu_and_mul_dynamic_quant_torch(out: Tensor, x: Tensor, scales: Tensor) -> None:
    """Dynamic per-token quant of ``silu_and_mul(x)``; fp32 scales ``[T, 1]`` written."""
    y = _silu_mul(x)
    s = per_token_scales(y, out.dtype)
    scales.copy_(s)
    out.copy_(quantize(y, s, out.dtype))


def _cuda(name: str) -> Optional[str]:
    return if_installed("triton", f"{_TRITON}:{name}")


def _silu_and_mul_fake(out, x) -> None:
    shape = _gated_shape("piecewise::silu_and_mul", x)
    if tuple(out.shape) != shape:
        raise ValueError(
            f"piecewise::silu_and_mul: out has shape {tuple(out.shape)}, expected {shape}"
        )


def _silu_and_mul_static_quant_fake(out, x, scale) -> None:
    check_out(
        "piecewise::silu_and_mul_static_quant",
        out,
        _gated_shape("piecewise::silu_and_mul_static_quant", x),
    )


def _silu_and_mul_dynamic_quant_fake(out, x, scales) -> None:
    check_out(
        "piecewise::silu_and_mul_dynamic_quant",
        out,
        _gated_shape("piecewise::silu_and_mul_dynamic_quant", x),
    )


silu_and_mul = define_op(
    "piecewise::silu_and_mul",
    mutates_args=("out",),
    fake=_silu_and_mul_fake,
    cuda=_cuda("silu_and_mul"),
)(silu_and_mul_torch)
silu_and_mul_static_quant = define_op(
    "piecewise::silu_and_mul_static_quant",
    mutates_args=("out",),
    fake=_silu_and_mul_static_quant_fake,
    cuda=_cuda("silu_and_mul_static_quant"),
)(silu_and_mul_static_quant_torch)
silu_and_mul_dynamic_quant = define_op(
    "piecewise::silu_and_mul_dynamic_quant",
    mutates_args=("out", "scales"),
    fake=_silu_and_mul_dynamic_quant_fake,
    cuda=_cuda("silu_and_mul_dynamic_quant"),
)(silu_and_mul_dynamic_quant_torch)
