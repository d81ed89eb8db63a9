"""``piecewise::fused_moe_packed``: the routed experts on weights re-laid out once (bf16, CPU).

The stacked experts of a MoE layer (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) are re-laid out once
after loading, as the dense linears are (:mod:`passes.ops.packed_linear`): each expert's gate-up and
down weight in the small-M kernel's panel layout (:func:`passes.small_m_linear.pack`), stacked
per expert,

    w13 [E, *panel_shape(2I, H)]      w2 [E, *panel_shape(H, I)]

as the module's own tensors (the plain originals released: one copy), and the module's
``moe_method`` (:class:`PackedExpertsMethod`) emits::

    piecewise::fused_moe_packed(x [T, H], topk_weights [T, K], topk_ids [T, K], w13, w2,
                                w13_md: Optional, w2_md: Optional, intermediate_size: int,
                                max_rows: int) -> [T, H] of x.dtype

Tokens are grouped by expert as in ``piecewise::fused_moe`` (:func:`passes.ops.moe.
combine_by_expert`, same arithmetic; at batch 1 the K experts' contributions are added
directly, no sort).  Per expert hit, gate-up and down each run

* the small-M kernel (:func:`passes.small_m_linear.run_packed`) on that expert's panels for a
  group of at most ``max_rows`` rows (decode: only the top-k experts' bytes are streamed);
* oneDNN on the same bytes for a larger group (prefill), where oneDNN's blocked layout is the
  panel layout (bf16 on AVX512-BF16 without AMX, the reduction dimension a multiple of 32:
  checked once per shape at packing, then ``w13_md`` / ``w2_md`` hold oneDNN's descriptor);
* everywhere else (AMX CPUs, whose oneDNN lays bf16 out otherwise; other K; AVX2-only CPUs)
  the small-M kernel, ``max_rows`` rows at a time.  Unpacking the expert's weight for each
  call and running ``F.linear`` on it, as this op did before, cost 2.7x the slices on a
  512-row group of the bench model's gate-up on an AMX Xeon (450 against 164 µs; oneDNN on
  the plain weight 158 µs: ``results/moe_prefill_slices_2026-12-07.md``).

Registration: :func:`framework.core.ops.define_op`, the Python body below as the op's
``CompositeExplicitAutograd`` kernel; :func:`passes.native_ops.load` (called by
:meth:`PackedExpertsMethod.process`) adds the C++ CPU kernel (``csrc/fused_moe_packed.cpp``: a
decode step's whole layer in one dispatcher call, bit-identical to the Python body; calls with a
group above ``max_rows`` handed to the body's twin ``piecewise::fused_moe_packed_python``).
Functional (no mutation, the output never aliases an input); passes ``opcheck``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from framework.compat import onednn
from framework.core.ops import define_op
from passes import native_ops
from passes import small_m_linear as small_m
from passes.ops.moe import combine_by_expert
from passes.ops.packed_linear import in_row_slices

NAME = "piecewise::fused_moe_packed"


def _linear(x2: Tensor, w: Tensor, md: Optional[Tensor], n: int, k: int, max_rows: int) -> Tensor:
    """``x2 [M, k] @ W.T`` for one expert's panels ``w`` of ``W [n, k]``."""
    if md is not None and x2.shape[0] > max_rows:
        out = onednn.linear(x2, w, md, None, n, k)
        if out is not None:
            return out
        return F.linear(x2, small_m.unpack(w, n, k))  # oneDNN refused its own descriptor
    # a decode group, or a larger one with no oneDNN view of the panels: the kernel, max_rows
    # rows at a time (never the expert unpacked per call: see the module docstring)
    return in_row_slices(lambda xs: small_m.run_packed(xs, w, None, n), x2, max_rows)


def fused_moe_packed_cpu(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_md: Optional[Tensor],
    w2_md: Optional[Tensor],
    intermediate_size: int,
    max_rows: int,
) -> Tensor:
    if x.dtype != w13.dtype or x.dim() != 2:
        raise TypeError(
            f"{NAME}: x must be [T, H] of the experts' dtype {w13.dtype}, got "
            f"{tuple(x.shape)} {x.dtype}"
        )
    I, H = intermediate_size, x.shape[1]  # noqa: E741

    def expert(e: int, xs: Tensor) -> Tensor:
        h = _linear(xs, w13.select(0, e), w13_md, 2 * I, H, max_rows)  # [n, 2I]: gate, then up
        a = F.silu(h[:, :I]).mul_(h[:, I:])  # [n, I]
        return _linear(a, w2.select(0, e), w2_md, H, I, max_rows)  # [n, H]

    return combine_by_expert(x, topk_weights, topk_ids, expert)


def _fake(
    x, topk_weights, topk_ids, w13, w2, w13_md, w2_md, intermediate_size: int, max_rows: int
) -> Tensor:
    E = w13.shape[0]
    H, I = x.shape[-1], intermediate_size  # noqa: E741
    want13 = (E, *small_m.panel_shape(2 * I, H))
    want2 = (E, *small_m.panel_shape(H, I))
    if x.dim() != 2 or tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
        raise ValueError(
            f"{NAME}: x [T, H] {tuple(x.shape)} with intermediate size {I} needs packed "
            f"w13 {want13} and w2 {want2}; got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"{NAME}: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [T, K]"
        )
    if x.dtype != w13.dtype or w2.dtype != w13.dtype:
        raise TypeError(f"{NAME}: x {x.dtype}, w13 {w13.dtype} and w2 {w2.dtype} must agree")
    return torch.empty_like(x)


fused_moe_packed = define_op(NAME, fake=_fake)(fused_moe_packed_cpu)
fused_moe_packed_python = define_op(f"{NAME}_python", fake=_fake, default_key="cpu")(
    fused_moe_packed_cpu
)
"""The Python body alone: the reference the C++ kernel is checked against, and what it hands
the calls it does not take (a group above ``max_rows``, other dtypes or layouts)."""


def pack_experts(w: Tensor) -> Tensor:
    """Stacked ``w [E, N, K]`` -> ``[E, *panel_shape(N, K)]``, each expert :func:`small_m.pack`
    ed (a new tensor; ``w`` untouched)."""
    E, n, k = w.shape
    packed = w.new_empty((E, *small_m.panel_shape(n, k)))
    for e in range(E):
        packed[e].copy_(small_m.pack(w[e]))
    return packed


def unpack_experts(packed: Tensor, n: int, k: int) -> Tensor:
    """The plain ``[E, n, k]`` of :func:`pack_experts` (a new tensor)."""
    return torch.stack([small_m.unpack(p, n, k) for p in packed])


class PackedExpertsMethod:
    """The ``moe_method`` of a stacked-experts module (``w13 [E, 2I, H]``, ``w2 [E, H, I]``)
    whose weights were re-laid out once (:meth:`process`); ``apply`` emits
    ``piecewise::fused_moe_packed``.  ``max_rows`` (> 0) is the engine's
    ``KernelConfig.max_rows()``: part of the traced graph and of the code digest."""

    def __init__(self, max_rows: int) -> None:
        if max_rows <= 0:
            raise ValueError(f"PackedExpertsMethod: max_rows must be > 0, got {max_rows}")
        self.max_rows = max_rows
        self.intermediate_size = self.hidden_size = 0

    @staticmethod
    def applies_to(experts: nn.Module, max_rows: int) -> bool:
        """bf16 CPU experts no other method took (quantization), with the kernel built here."""
        w13, w2 = getattr(experts, "w13", None), getattr(experts, "w2", None)
        return (
            max_rows > 0
            and isinstance(w13, Tensor)
            and isinstance(w2, Tensor)
            and w13.dim() == 3
            and w2.dim() == 3
            and w13.device.type == "cpu"
            and w13.dtype in small_m.DTYPES
            and w2.dtype == w13.dtype
            and getattr(experts, "moe_method", None) is None
            and small_m.kernel_available()
        )

    def rows_independent(self, experts: nn.Module) -> bool:
        """Every expert group runs the kernel, past ``max_rows`` in slices (no oneDNN view of
        either stack: AMX and AVX2-only CPUs, and K not a multiple of 32), and a token's
        top-k outputs are summed in expert order: a row's bits never depend on the rows
        beside it."""
        return (
            self.max_rows > 0
            and getattr(experts, "w13_md", None) is None
            and getattr(experts, "w2_md", None) is None
        )

    def process(self, experts: nn.Module, layouts: Optional[dict] = None) -> None:
        """Re-lay ``experts.w13`` and ``experts.w2`` once; the module then holds only the
        packed stacks (and ``w13_md`` / ``w2_md``).  At most two copies of one stack exist at
        any moment.  ``layouts``: a dict kept over one model's experts, remembering per
        (N, K, dtype) whether oneDNN reads the panel layout (and its descriptor)."""
        E, two_i, H = experts.w13.shape
        I = two_i // 2  # noqa: E741
        if tuple(experts.w2.shape) != (E, H, I) or two_i % 2:
            raise ValueError(
                f"PackedExpertsMethod: w13 {tuple(experts.w13.shape)} and w2 "
                f"{tuple(experts.w2.shape)} are not [E, 2I, H] and [E, H, I]"
            )
        native_ops.load()  # the op's C++ kernel (else its Python body runs)
        layouts = {} if layouts is None else layouts
        for attr, n, k in (("w13", 2 * I, H), ("w2", H, I)):
            plain = getattr(experts, attr).detach()
            packed = pack_experts(plain)
            md = _onednn_md(plain[0], packed[0], layouts)
            del plain
            delattr(experts, attr)  # the original goes: one copy
            experts.register_parameter(attr, nn.Parameter(packed, requires_grad=False))
            experts.register_buffer(f"{attr}_md", md, persistent=False)
        self.intermediate_size, self.hidden_size = I, H

    def apply(self, experts: nn.Module, x: Tensor, topk_weights: Tensor, topk_ids: Tensor):
        return fused_moe_packed(
            x,
            topk_weights,
            topk_ids,
            experts.w13,
            experts.w2,
            experts.w13_md,
            experts.w2_md,
            self.intermediate_size,
            self.max_rows,
        )

    def plain_weights(self, experts: nn.Module) -> tuple[Tensor, Tensor]:
        """New plain ``(w13 [E, 2I, H], w2 [E, H, I])`` of the packed module (tests,
        benchmarks: what the unpacked op would read)."""
        I, H = self.intermediate_size, self.hidden_size  # noqa: E741
        return unpack_experts(experts.w13, 2 * I, H), unpack_experts(experts.w2, H, I)

    def __repr__(self) -> str:
        return f"PackedExpertsMethod(max_rows={self.max_rows})"


def _onednn_md(w: Tensor, panels: Tensor, layouts: dict) -> Optional[Tensor]:
    """oneDNN's descriptor for a weight of ``w``'s shape when oneDNN's packed bytes of ``w``
    are its panels ``panels`` (then oneDNN runs large batches on the panels), else None.
    Found once per (shape, dtype) and remembered in ``layouts``."""
    key = (*w.shape, w.dtype)
    if key not in layouts:
        got = onednn.reorder(w)
        md = None
        if got is not None:
            flat = panels.reshape(-1)
            if got.data.numel() == flat.numel() and torch.equal(got.data, flat):
                md = got.md
            got.release()
        layouts[key] = md
    return layouts[key]
