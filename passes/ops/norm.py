"""RMSNorm family: plain, fused residual add, and with static / dynamic activation quant.

``rms_norm(x) = x * rsqrt(mean(x^2, -1) + eps) * weight`` computed in fp32 and cast once to the
output dtype (the model's unfused form casts before multiplying by ``weight``; the difference is
one bf16 rounding, inside every bf16 tolerance).  The residual add happens in the input dtype,
exactly as the unfused model computes ``x + residual``, and the *rounded* sum is normalised.

All ops write into arguments listed in ``mutates_args`` and return ``None``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from framework.core.ops import define_op, if_installed
from passes.ops.quant_utils import check_out, per_token_scales, quantize

_TRITON = "passes.ops.triton.norm"


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fp32 ``rms_norm(x) * weight``."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _check_hidden(name: str, x: Tensor, weight: Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"{name}: weight has shape {tuple(weight.shape)}, expected "
            f"({x.shape[-1]},) = x's hidden size"
        )


# --- plain-torch implementations (CPU path and oracle) --------------------------------------


def rms_norm_torch(out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    """``out = rms_norm(x) * weight`` (``out`` has x's shape, any float dtype)."""
    out.copy_(_rms(x, weight, eps))


def fused_add_rms_norm_torch(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual <- x + residual``; ``x <- rms_norm(residual) * weight``."""
    residual.add_(x)
    x.copy_(_rms(residual, weight, eps))


def rms_norm_static_quant_torch(
    out: Tensor, x: Tensor, weight: Tensor, scale: Tensor, eps: float
) -> None:
    """``out = quant(rms_norm(x) * weight / scale)``; out int8 or float8_e4m3fn, scale [1]."""
    out.copy_(quantize(_rms(x, weight, eps), scale, out.dtype))


def fused_add_rms_norm_static_quant_torch(
    out: Tensor, x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float
) -> None:
    """``residual <- x + residual`` (in place); ``out = quant(rms_norm(residual)*weight/scale)``;
    ``x`` is left unchanged."""
    residual.add_(x)
    out.copy_(quantize(_rms(residual, weight, eps), scale, out.dtype))


def rms_norm_dynamic_quant_torch(
    out: Tensor, x: Tensor, weight: Tensor, scales: Tensor, eps: float, residual: Optional[Tensor]
) -> None:
    """Dynamic per-token quant of ``rms_norm(h) * weight`` into ``out``, its fp32 scales
    ``[T, 1]`` into ``scales``; ``h = x``, or with ``residual`` given ``residual <- x +
    residual`` first (in place) and ``h = residual``."""
    if residual is not None:
        residual.add_(x)
        x = residual
    y = _rms(x, weight, eps)
    s = per_token_scales(y, out.dtype)
    scales.copy_(s)
    out.copy_(quantize(y, s, out.dtype))


# --- the custom ops ---------------------------------------------------------------------------


def _cuda(name: str) -> Optional[str]:
    return if_installed("triton", f"{_TRITON}:{name}")


def _rms_norm_fake(out, x, weight, eps) -> None:
    _check_hidden("piecewise::rms_norm", x, weight)


def _fused_add_rms_norm_fake(x, residual, weight, eps) -> None:
    _check_hidden("piecewise::fused_add_rms_norm", x, weight)


def _rms_norm_static_quant_fake(out, x, weight, scale, eps) -> None:
    _check_hidden("piecewise::rms_norm_static_quant", x, weight)
    check_out("piecewise::rms_norm_static_quant", out, x.shape)


def _fused_add_rms_norm_static_quant_fake(out, x, residual, weight, scale, eps) -> None:
    _check_hidden("piecewise::fused_add_rms_norm_static_quant", x, weight)
    check_out("piecewise::fused_add_rms_norm_static_quant", out, x.shape)


def _rms_norm_dynamic_quant_fake(out, x, weight, scales, eps, residual) -> None:
    _check_hidden("piecewise::rms_norm_dynamic_quant", x, weight)
    check_out("piecewise::rms_norm_dynamic_quant", out, x.shape)


rms_norm = define_op(
    "piecewise::rms_norm", mutates_args=("out",), fake=_rms_norm_fake, cuda=_cuda("rms_norm")
)(rms_norm_torch)
fused_add_rms_norm = define_op(
    "piecewise::fused_add_rms_norm",
    mutates_args=("x", "residual"),
    fake=_fused_add_rms_norm_fake,
    cuda=_cuda("fused_add_rms_norm"),
)(fused_add_rms_norm_torch)
rms_norm_static_quant = define_op(
    "piecewise::rms_norm_static_quant",
    mutates_args=("out",),
    fake=_rms_norm_static_quant_fake,
    cuda=_cuda("rms_norm_static_quant"),
)(rms_norm_static_quant_torch)
fused_add_rms_norm_static_quant = define_op(
    "piecewise::fused_add_rms_norm_static_quant",
    mutates_args=("out", "residual"),
    fake=_fused_add_rms_norm_static_quant_fake,
    cuda=_cuda("fused_add_rms_norm_static_quant"),
)(fused_add_rms_norm_static_quant_torch)
rms_norm_dynamic_quant = define_op(
    "piecewise::rms_norm_dynamic_quant",
    mutates_args=("out", "scales", "residual"),
    fake=_rms_norm_dynamic_quant_fake,
    cuda=_cuda("rms_norm_dynamic_quant"),
)(rms_norm_dynamic_quant_torch)
