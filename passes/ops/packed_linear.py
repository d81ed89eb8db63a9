"""``piecewise::packed_linear``: a linear on a weight the layer holds re-laid out, once.

Inductor prepacks weights for oneDNN only when they are constants (freezing); in a piecewise
graph weights are graph inputs.  So the engine re-lays every CPU linear weight once after
loading (:meth:`PackedLinearMethod.process`, as vLLM's ``process_weights_after_loading``): the
layer's ``weight`` *becomes* the packed tensor, the original is released, and the layer's
``linear_method`` emits this op.  One copy per weight, visible to the graph (a graph input
like any parameter), to memory accounting and to the cache key; no side cache.

Layouts (:attr:`PackedLinearMethod.layout`):

* ``panel`` (bf16): the small-M kernel's ``[ceil(N/64), ceil(K/2), 64, 2]``
  (:func:`passes.small_m_linear.pack`).  Up to ``max_rows`` rows run that kernel; more rows
  run oneDNN on the same bytes, which on AVX512-BF16 machines without AMX are oneDNN's own
  packed layout (checked per weight at packing: then ``weight_md`` holds oneDNN's
  descriptor).  Where they are not (AMX CPUs: oneDNN's AMX blocking; K not a multiple of
  32), or oneDNN views are unavailable (AVX2-only CPUs: oneDNN lays out no bf16 there),
  larger batches run the small-M kernel ``max_rows`` rows at a time: every row then has the
  bits it has in a decode step, and it is 5.6-6x faster than unpacking the weight for a bf16
  ``F.linear`` (AVX2 machine, 128-512 rows of the default model's shapes; torch's bf16 GEMM
  there runs at 16 GFLOP/s against 98 in fp32).
* ``onednn`` (fp32, or bf16 without the small-M kernel): oneDNN's packed bytes, every call on
  oneDNN.

Registration: :func:`framework.core.ops.define_op`, the Python body below as the op's
``CompositeExplicitAutograd`` kernel; :func:`passes.native_ops.load` adds the C++ CPU kernel
(``csrc/torch_ops.cpp``: the small-M calls in C++, every other call handed to the same Python
body under the name ``piecewise::packed_linear_python``).  The op is functional (no mutation,
output never aliases an input) and passes ``opcheck``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from framework.compat import onednn
from framework.core.ops import define_op, direct_call, direct_recorder
from passes import native_ops
from passes import small_m_linear as small_m

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def in_row_slices(run, x2: torch.Tensor, rows: int) -> torch.Tensor:
    """``run(x2)`` with ``x2`` cut into slices of at most ``rows`` rows, the outputs stacked
    (one call when it has no more): a small-M kernel taking a call past its ``max_rows``
    (the packed ops, bf16 and int8, dense and experts, where torch has no fast GEMM)."""
    if x2.shape[0] <= rows:
        return run(x2)
    return torch.cat([run(x2[i : i + rows]) for i in range(0, x2.shape[0], rows)])


def mkldnn_available() -> bool:
    return onednn.available()


def packed_linear_cpu(
    x: torch.Tensor,
    w: torch.Tensor,
    md: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    out_features: int,
    in_features: int,
    max_rows: int,
) -> torch.Tensor:
    n, k = out_features, in_features
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x.dtype != w.dtype:
        raise TypeError(f"piecewise::packed_linear: x ({x.dtype}) and w ({w.dtype}) differ")
    panel = w.dim() == 4
    rows = x2.shape[0]
    if panel and (rows <= max_rows or (md is None and max_rows > 0)):
        if bias is not None and (bias.shape != (n,) or bias.dtype != w.dtype):
            # the kernel reads the bias as w's dtype: a float32 bias would be read as garbage
            raise ValueError(
                f"piecewise::packed_linear: bias {tuple(bias.shape)} {bias.dtype} for "
                f"w ({n}, {k}) {w.dtype}"
            )
        # past max_rows no oneDNN view of these bytes: the kernel, max_rows rows at a time
        out = in_row_slices(lambda xs: small_m.run_packed(xs, w, bias, n), x2, max_rows)
    else:
        out = onednn.linear(x2, w, md, bias, n, k) if md is not None else None
        if out is None:
            if not panel:
                raise RuntimeError(
                    "piecewise::packed_linear: a oneDNN-packed weight but no oneDNN view "
                    "(this torch build lacks the hooks framework/compat/onednn.py uses)"
                )
            out = F.linear(x2, small_m.unpack(w, n, k), bias)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _fake(x, w, md, bias, out_features: int, in_features: int, max_rows: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(
            f"piecewise::packed_linear: x has {x.shape[-1]} features, the weight "
            f"{in_features} (w [{out_features}, {in_features}], packed {tuple(w.shape)})"
        )
    return x.new_empty((*x.shape[:-1], out_features))


packed_linear = define_op("piecewise::packed_linear", fake=_fake)(packed_linear_cpu)
packed_linear_python = define_op("piecewise::packed_linear_python", fake=_fake, default_key="cpu")(
    packed_linear_cpu
)
"""The Python body alone: what the C++ kernel hands the calls it does not take (and the
"before" of the per-call overhead benchmark, ``experiments/bench/op_overhead.py``)."""


def first_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [rows] int64, value [rows] float32) of each row's first maximum, a NaN first (a
    row holding one gets its first NaN's index and NaN), a row of -inf index 0: the greedy
    sampler's rules, in plain torch."""
    f = logits.float()
    nan = f.isnan()
    idx = torch.where(nan.any(-1), nan.byte().argmax(-1), f.argmax(-1))
    return idx, f.gather(-1, idx[:, None])[:, 0]


def packed_linear_greedy_cpu(
    x: torch.Tensor,
    w: torch.Tensor,
    md: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    out_features: int,
    in_features: int,
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.ops.piecewise.packed_linear.default(
        x, w, md, bias, out_features, in_features, max_rows
    )
    idx, val = first_argmax(out)
    return out, idx, val


def _greedy_fake(x, w, md, bias, out_features: int, in_features: int, max_rows: int):
    if x.dim() != 2:
        raise ValueError(f"piecewise::packed_linear_greedy: x must be [rows, {in_features}]")
    rows = x.shape[0]
    return (
        _fake(x, w, md, bias, out_features, in_features, max_rows),
        x.new_empty((rows,), dtype=torch.int64),
        x.new_empty((rows,), dtype=torch.float32),
    )


packed_linear_greedy = define_op("piecewise::packed_linear_greedy", fake=_greedy_fake)(
    packed_linear_greedy_cpu
)
"""An LM head and the greedy choice in one call: (logits, index, maximum) per row.  Its C++
kernel (``csrc/torch_ops.cpp``) runs the small-M kernel's greedy epilogue, each thread
scanning the logits it has just stored; the Python body is :func:`packed_linear` and
:func:`first_argmax`."""


@functools.lru_cache(maxsize=1)
def _greedy_call() -> Callable:
    """The greedy head's op, as a direct call where the native library has one (asked once
    the library is loaded: ``PackedLinearMethod.apply_greedy`` checks that first)."""
    return direct_call("piecewise::packed_linear_greedy") or packed_linear_greedy


def _release_weight(layer: nn.Module) -> None:
    del layer.weight  # a tied weight is never processed, so this drops the last reference


def _same_as_panels(data: torch.Tensor, w: torch.Tensor, k: int, chunk: int = 64) -> bool:
    """oneDNN's bytes ``data`` equal the small-M panels of ``w``, compared a few panels at a
    time (no full second copy)."""
    n = w.shape[0]
    size = int(torch.Size(small_m.panel_shape(n, k)).numel())
    if data.numel() != size:
        return False
    per_panel = size // small_m.panel_shape(n, k)[0]
    rows = small_m.LANES * chunk
    for r0 in range(0, n, rows):
        part = small_m.pack(w.detach()[r0 : r0 + rows]).reshape(-1)
        start = (r0 // small_m.LANES) * per_panel
        if not torch.equal(data[start : start + part.numel()], part):
            return False
    return True


class PackedLinearMethod:
    """The ``linear_method`` of a layer whose weight was re-laid out once (:meth:`process`).

    ``max_rows``: rows up to which the small-M kernel runs (0: oneDNN for every call).  It is
    part of the method (and so of the traced graph and the code digest), from the engine's
    ``KernelConfig``."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.layout = ""
        self.out_features = self.in_features = 0

    def rows_independent(self, layer: nn.Module) -> bool:
        """Every call of ``layer``, whatever its row count, runs the small-M kernel, so a
        row's bits never depend on the rows beside it: the panel layout with no oneDNN view
        (AVX2-only CPUs), where batches past ``max_rows`` run the kernel in slices."""
        return (
            self.layout == "panel"
            and self.max_rows > 0
            and getattr(layer, "weight_md", None) is None
        )

    @staticmethod
    def applies_to(layer: nn.Module) -> bool:
        w = getattr(layer, "weight", None)
        return (
            mkldnn_available()
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.device.type == "cpu"
            and w.dtype in PACKABLE_DTYPES
            and getattr(layer, "linear_method", None) is None
        )

    def process(self, layer: nn.Module, layouts: Optional[dict] = None) -> bool:
        """Re-lay ``layer.weight`` (plain ``[N, K]``) once; the layer then holds only the packed
        tensor (and ``weight_md``).  Returns False (layer unchanged) where nothing reads a
        packed layout here.  At most two copies of this one weight exist at any moment.

        ``layouts``: a dict the caller keeps over one model's layers; whether oneDNN reads the
        panel layout of a (shape, dtype) is found once per shape (oneDNN re-lays the first
        weight of each shape, its bytes are compared with the panels) and remembered there."""
        n, k = layer.weight.shape
        dtype = layer.weight.dtype
        small = self.max_rows > 0 and dtype in small_m.DTYPES and small_m.kernel_available()
        if small:
            native_ops.load()  # the op's C++ kernel (else its Python body calls the kernel)
        layouts = {} if layouts is None else layouts
        key = (n, k, dtype, small)
        if small:
            self.layout = "panel"
            if key in layouts:
                md = layouts[key]
                packed = small_m.pack(layer.weight.detach())
                _release_weight(layer)
            else:
                got = onednn.reorder(layer.weight.detach())
                md = None
                if got is not None and _same_as_panels(got.data, layer.weight, k):
                    md = got.md
                    _release_weight(layer)  # the original goes before the copy is made
                    packed = got.data.view(small_m.panel_shape(n, k)).clone()
                    got.release()
                else:
                    got = None
                    packed = small_m.pack(layer.weight.detach())
                    _release_weight(layer)
                layouts[key] = md
        else:
            got = onednn.reorder(layer.weight.detach())
            if got is None:
                return False
            self.layout, self.max_rows, md = "onednn", 0, got.md
            _release_weight(layer)
            packed = got.data.clone()
            got.release()
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.register_buffer("weight_md", md, persistent=False)
        self.out_features, self.in_features = n, k
        return True

    def _op_args(self, layer: nn.Module, x: torch.Tensor) -> tuple:
        """The op's arguments for ``x`` through ``layer``: x, the panels, their oneDNN
        metadata, the bias, N, K and the small-M row limit."""
        n, k = self.out_features, self.in_features
        return (x, layer.weight, layer.weight_md, layer.bias, n, k, self.max_rows)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(*self._op_args(layer, x))

    def apply_greedy(
        self, layer: nn.Module, x: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(logits, first-maximum index, maximum) per row of ``x [rows, K]`` in one call
        (``piecewise::packed_linear_greedy``), or None where no C++ kernel would fuse it (then
        the caller computes the logits and the argmax apart, as fast as this would)."""
        if self.layout != "panel" or x.dim() != 2 or not native_ops.loaded():
            return None
        return _greedy_call()(*self._op_args(layer, x))

    def record_greedy(
        self, layer: nn.Module, x: torch.Tensor
    ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]]:
        """:meth:`apply_greedy` through the op's recording kernel: its three tensors and the
        native call it made (``[address, 1, word...]``; empty where its words alone cannot
        replay it), or None where no C++ kernel would fuse it."""
        recorder = direct_recorder("piecewise::packed_linear_greedy")
        if self.layout != "panel" or x.dim() != 2 or recorder is None:
            return None
        return recorder(*self._op_args(layer, x))

    def __repr__(self) -> str:
        return f"PackedLinearMethod({self.layout}, max_rows={self.max_rows})"
