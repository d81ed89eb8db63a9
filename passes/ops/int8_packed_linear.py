"""int8 linears on weights re-laid out once for the small-M int8 kernels.

After quantization (:mod:`passes.quant_schemes`) an ``int8_per_token`` layer holds ``W_q [N, K]``
int8 and computes ``dynamic_per_token_quant(x)`` + ``int8_scaled_mm`` (``torch._int_mm``);
an ``int8_per_channel_weight_only`` layer holds ``W_q`` and runs ``int8_weight_only_mm``.  On
CPU the engine's model preparation then re-lays ``W_q`` once into the kernels' panels
(:meth:`PackedInt8LinearMethod.process`, :func:`passes.int8_small_m.pack`): the layer's
``weight`` *becomes* the packed tensor (the plain one is released: one copy), with fp32
per-channel ``weight_scale [N]`` and, for W8A8, ``weight_comp [N]`` (the u8-offset
compensation).  Its ``linear_method`` then emits one op per linear::

    y = piecewise.int8_packed_linear.default(x, w, w_scale, w_comp, bias, N, K, max_rows)
    y = piecewise.int8_wo_packed_linear.default(x, w, w_scale, bias, N, K, max_rows)

Up to ``max_rows`` rows (``KernelConfig.int8_small_m_max_rows``) the C++ kernel runs, the
activations quantised in its prologue; more rows run the reference path on the unpacked
weight (``dynamic_per_token_quant`` + ``torch._int_mm`` + epilogue; weight-only: the existing
``int8_weight_only_mm``).  Both give the same result for W8A8, bit for bit.  Where torch's int8
GEMMs have no fast path (AVX2 without VNNI: :func:`passes.int8_small_m.takes_every_row_count`)
larger calls run the kernel too, ``max_rows`` rows at a time, as bf16 does there; on AMX the
W8A8 kernel takes larger calls whole (its tile path is a GEMM:
:func:`passes.int8_small_m.w8a8_takes_every_row_count`).

Quant fusions: the activation quantisation of a packed layer lives inside its op at every
row count (the graph is traced once, for every size), so the graph holds no
``dynamic_per_token_quant`` for ``fuse_rmsnorm_quant`` / ``fuse_silu_mul_quant`` to fuse
into the norm or the activation: on CPU those passes only run at O3, where Inductor's own
fusion beats them, and at decode sizes a separate norm+quant op would cost one more op call
and a write and read of the quantised activations that the prologue avoids.  Layers left
unpacked (``int8_small_m_max_rows = 0``, other devices, static activation scales) keep the
quant op and the fusions.

Registration: :func:`framework.core.ops.define_op`; the Python body is the op's
``CompositeExplicitAutograd`` kernel and, under ``piecewise::<op>_python``, what the C++ CPU
kernel (:mod:`passes.native_ops`) hands the calls it does not take.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from framework.compat.ops import int_mm
from framework.core.ops import define_op
from passes import int8_small_m as i8
from passes import native_ops
from passes.ops.activation_quant import dynamic_per_token_quant_torch
from passes.ops.packed_linear import in_row_slices
from passes.ops.scaled_mm import _epilogue, int8_weight_only_mm_torch
from passes.quant_schemes import Int8DynamicPerToken, Int8WeightOnly


def _kernel_rows(x2: Tensor, bias: Optional[Tensor], max_rows: int, one_call: bool = False) -> int:
    """Rows per kernel call for this call (``max_rows``: one call up to it; past it the whole
    call at once where ``one_call`` (:func:`passes.int8_small_m.w8a8_takes_every_row_count`:
    W8A8 on AMX), else slices of ``max_rows`` where the kernels take every row count
    (:func:`passes.int8_small_m.takes_every_row_count`: AVX2 without VNNI)), or 0 for
    torch's path."""
    if not (
        max_rows > 0
        and x2.dtype in i8.DTYPES
        and (bias is None or bias.dtype == x2.dtype)
        and i8.kernel_available()
    ):
        return 0
    if x2.shape[0] <= max_rows:
        return max_rows
    if one_call:
        return x2.shape[0]
    return max_rows if i8.takes_every_row_count() else 0


def int8_packed_linear_impl(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    w_comp: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    in_features: int,
    max_rows: int,
) -> Tensor:
    n, k = out_features, in_features
    x2 = x.reshape(-1, k)
    step = _kernel_rows(x2, bias, max_rows, i8.w8a8_takes_every_row_count())
    if step:
        out = in_row_slices(lambda xs: i8.run_packed(xs, w, w_scale, w_comp, bias, n), x2, step)
    else:
        x_q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
        scales = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
        dynamic_per_token_quant_torch(x_q, x2, scales)
        acc = int_mm(x_q, i8.unpack(w, n, k).t())
        out = _epilogue(acc, scales, w_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], n)


def int8_wo_packed_linear_impl(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor],
    out_features: int,
    in_features: int,
    max_rows: int,
) -> Tensor:
    n, k = out_features, in_features
    x2 = x.reshape(-1, k)
    step = _kernel_rows(x2, bias, max_rows)
    if step:
        out = in_row_slices(lambda xs: i8.run_packed_weight_only(xs, w, w_scale, bias, n), x2, step)
    else:
        out = int8_weight_only_mm_torch(x2, i8.unpack(w, n, k), w_scale.to(x.dtype), bias)
    return out.view(*x.shape[:-1], n)


def _check(name: str, x, w, w_scale, n: int, k: int) -> None:
    if x.shape[-1] != k:
        raise ValueError(
            f"{name}: x has {x.shape[-1]} features, the weight {k} (w [{n}, {k}], packed "
            f"{tuple(w.shape)})"
        )
    if w.dtype != torch.int8 or tuple(w.shape) != i8.panel_shape(n, k):
        raise ValueError(
            f"{name}: w must be int8 {i8.panel_shape(n, k)} (packed [{n}, {k}]), got "
            f"{w.dtype} {tuple(w.shape)}"
        )
    if w_scale.numel() != n or w_scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: w_scale must be float32 [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}"
        )


def _int8_fake(x, w, w_scale, w_comp, bias, out_features: int, in_features: int, max_rows: int):
    _check("piecewise::int8_packed_linear", x, w, w_scale, out_features, in_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _wo_fake(x, w, w_scale, bias, out_features: int, in_features: int, max_rows: int):
    _check("piecewise::int8_wo_packed_linear", x, w, w_scale, out_features, in_features)
    return x.new_empty((*x.shape[:-1], out_features))


int8_packed_linear = define_op("piecewise::int8_packed_linear", fake=_int8_fake)(
    int8_packed_linear_impl
)
int8_packed_linear_python = define_op(
    "piecewise::int8_packed_linear_python", fake=_int8_fake, default_key="cpu"
)(int8_packed_linear_impl)
int8_wo_packed_linear = define_op("piecewise::int8_wo_packed_linear", fake=_wo_fake)(
    int8_wo_packed_linear_impl
)
int8_wo_packed_linear_python = define_op(
    "piecewise::int8_wo_packed_linear_python", fake=_wo_fake, default_key="cpu"
)(int8_wo_packed_linear_impl)

PACKED_OPS = (int8_packed_linear, int8_wo_packed_linear)


class PackedInt8LinearMethod:
    """The ``linear_method`` of an int8 layer whose weight was re-laid out once
    (:meth:`process`), replacing its quantization scheme (W8A8 dynamic per token, or weight-only).

    ``max_rows``: rows up to which the kernel runs; part of the method (a constant of the
    traced graph), from the engine's ``KernelConfig``."""

    def __init__(self, scheme, max_rows: int) -> None:
        self.scheme = scheme
        self.weight_only = isinstance(scheme, Int8WeightOnly)
        self.max_rows = max_rows
        self.out_features = self.in_features = 0

    @staticmethod
    def applies_to(layer: nn.Module) -> bool:
        """An int8 layer of a scheme the kernels implement, on CPU, not yet packed."""
        w = getattr(layer, "weight", None)
        return (
            type(getattr(layer, "linear_method", None)) in (Int8DynamicPerToken, Int8WeightOnly)
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.dtype == torch.int8
            and w.device.type == "cpu"
            and isinstance(getattr(layer, "weight_scale", None), torch.Tensor)
        )

    def rows_independent(self, layer: nn.Module) -> bool:
        """Every call of ``layer`` runs the kernel -- past ``max_rows`` in slices where the
        kernels take every row count (AVX2 without VNNI), or W8A8 in one call where its tile
        path does (AMX: :func:`passes.int8_small_m.w8a8_takes_every_row_count`) -- and the
        activations are quantized per row (W8A8) or not at all: a row's bits never depend on
        the rows beside it."""
        bias = getattr(layer, "bias", None)
        every_count = i8.takes_every_row_count() or (
            not self.weight_only and i8.w8a8_takes_every_row_count()
        )
        return self.max_rows > 0 and every_count and (bias is None or bias.dtype in i8.DTYPES)

    def process(self, layer: nn.Module) -> bool:
        """Re-lay ``layer.weight`` once; the layer then holds only the packed tensor, fp32
        ``weight_scale [N]`` and (W8A8) ``weight_comp [N]``.  False (layer unchanged) where the
        kernels are not built here."""
        if not i8.kernel_available():
            return False
        native_ops.load()
        w = layer.weight.detach()
        n, k = w.shape
        scale = layer.weight_scale.detach().float().reshape(-1)
        scale = (scale.expand(n) if scale.numel() == 1 else scale).contiguous().clone()
        comp = None if self.weight_only else i8.compensation(w)
        packed = i8.pack(w)
        del layer.weight
        del w
        layer.weight = nn.Parameter(packed, requires_grad=False)
        del layer.weight_scale
        layer.register_buffer("weight_scale", scale)
        if comp is not None:
            layer.register_buffer("weight_comp", comp)
        self.out_features, self.in_features = n, k
        return True

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        if self.weight_only:
            return int8_wo_packed_linear(
                x,
                layer.weight,
                layer.weight_scale,
                layer.bias,
                self.out_features,
                self.in_features,
                self.max_rows,
            )
        return int8_packed_linear(
            x,
            layer.weight,
            layer.weight_scale,
            layer.weight_comp,
            layer.bias,
            self.out_features,
            self.in_features,
            self.max_rows,
        )

    def __repr__(self) -> str:
        kind = "weight_only" if self.weight_only else "dynamic_per_token"
        return f"PackedInt8LinearMethod({kind}, max_rows={self.max_rows})"
