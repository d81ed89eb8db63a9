"""oneDNN's packed linear weights, held in a plain tensor the model owns.

oneDNN runs ``mkldnn._linear_pointwise`` on a weight re-laid out by
``mkldnn._reorder_linear_weight``: an *opaque* tensor (``layout=torch._mkldnn``) that owns its
memory and cannot be a graph input.  To hold each weight once, in a layout both the small-M
kernel and oneDNN read, the packed bytes live in an ordinary dense tensor (a model parameter,
a graph input like any weight), together with oneDNN's memory descriptor (a small uint8
tensor), and each large-M call wraps those bytes in a non-owning oneDNN tensor
(:func:`view`, ~10-15 µs) for the duration of the call.

For bf16 on AVX512-BF16 machines oneDNN's blocked format (``BA16a64b2a``) is byte for byte the
small-M kernel's panel layout (``passes/small_m_linear.py``) whenever K is a multiple of 32
(N is zero-padded to whole 64-row panels by both; checked on torch 2.13 for e.g. 100x64,
320x2048, 2048x5632, and not so for K = 33, 48, 70).  :func:`reorder` returns oneDNN's bytes
and the caller compares them with its own layout before trusting that; where they differ
(other shapes, other ISAs) there is no descriptor and larger batches unpack the weight per
call (``F.linear``).

Every private torch API this needs is here (the compat package), each failing closed
(``None``): without them the packed op runs the public path (``F.linear`` on the weight
unpacked per call).  Checked on torch 2.13.0+cpu; on another version a hook that is missing
returns None, and the caller's byte comparison (oneDNN's layout against its own) still decides
whether a descriptor is trusted.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def available() -> bool:
    """oneDNN can prepack linear weights on this build."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class Packed:
    """oneDNN's packed form of a weight, alive until :meth:`release`: ``data`` is a dense 1-D
    view (the weight's dtype) of oneDNN's bytes, ``md`` the uint8 memory descriptor."""

    def __init__(self, opaque: torch.Tensor, data: torch.Tensor, md: torch.Tensor) -> None:
        self._opaque, self.data, self.md = opaque, data, md

    def release(self) -> None:
        self._opaque = self.data = None


@functools.lru_cache(maxsize=None)
def packs(dtype: torch.dtype) -> bool:
    """oneDNN re-lays out linear weights of ``dtype`` on this machine.  Not a given where
    oneDNN is built in: its bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only
    CPU, e.g. AMD Zen 3, raises).  Probed once per dtype on a small weight; a refusal is logged
    once, and :func:`reorder` then returns None for that dtype without asking again."""
    if not available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=dtype))
    except (AttributeError, RuntimeError) as e:
        logger.warning(
            "oneDNN cannot lay out %s linear weights here (%s); such linears use the small-M "
            "kernel up to its max_rows and F.linear above",
            dtype,
            str(e).splitlines()[0],
        )
        return False
    return True


def reorder(w: torch.Tensor) -> Optional[Packed]:
    """``w [N, K]`` re-laid out by oneDNN (one copy; ``w`` untouched), or None where this torch
    or this CPU cannot (:func:`packs`).  Copy ``data`` into a tensor of your own, then
    :meth:`Packed.release`."""
    if not available() or _shim() is None or not packs(w.dtype):
        return None
    try:
        opaque = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        md = torch.ops.mkldnn._get_mkldnn_serialized_md(opaque).clone()
        nbytes = int(torch.ops.mkldnn._nbytes(opaque))
        ptr = int(torch.ops.mkldnn.data_ptr(opaque))
    except (AttributeError, RuntimeError) as e:
        logger.warning("oneDNN weight layout unavailable (%s); linears use F.linear", e)
        return None
    if nbytes % w.element_size():
        return None
    data = torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=w.dtype)
    return Packed(opaque, data, md)


def view(w: torch.Tensor, md: torch.Tensor, n: int, k: int) -> Optional[torch.Tensor]:
    """A non-owning oneDNN tensor ``[n, k]`` over the packed bytes of ``w`` (described by
    ``md``), for one call of ``mkldnn._linear_pointwise``; ``w`` must outlive it."""
    shim = _shim()
    if shim is None:
        return None
    fn, layout, dtypes, cpu, capsule = shim
    code = dtypes.get(w.dtype)
    if code is None:
        return None
    sizes = (ctypes.c_int64 * 2)(n, k)
    strides = (ctypes.c_int64 * 2)(k, 1)
    handle = ctypes.c_void_p()
    rc = fn(
        w.data_ptr(),
        2,
        sizes,
        strides,
        0,
        code,
        cpu,
        0,
        ctypes.byref(handle),
        layout,
        md.data_ptr(),
        md.numel(),
    )
    if rc != 0 or not handle.value:
        return None
    return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule(handle.value, None, None))


def linear(x: torch.Tensor, w: torch.Tensor, md: torch.Tensor, bias, n: int, k: int):
    """``x @ W.T + bias`` with oneDNN on the packed bytes ``w``; None if no view can be made."""
    v = view(w, md, n, k)
    if v is None:
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), v, bias, "none", [], "")


def prepack(w: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's own opaque packed tensor of ``w [N, K]`` (what ``torch.compile``'s freezing
    makes), or None where this torch or this CPU cannot (:func:`packs`); for
    :func:`linear_prepacked`."""
    if not packs(w.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def linear_prepacked(x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ W.T + bias`` with oneDNN on a tensor from :func:`prepack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def _shim():
    """The AOTInductor C shim that makes a oneDNN tensor over existing memory, or None."""
    if not available() or not hasattr(torch._C, "_aoti"):
        return None
    if not hasattr(torch._C._aoti, "alloc_tensor_by_stealing_from_void_ptr"):
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.aoti_torch_create_tensor_from_blob_v2
        i64p = ctypes.POINTER(ctypes.c_int64)
        fn.restype = ctypes.c_int32
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            i64p,
            i64p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_int64,
        ]
        for name in ("aoti_torch_layout__mkldnn", "aoti_torch_device_type_cpu"):
            getattr(lib, name).restype = ctypes.c_int32
        lib.aoti_torch_dtype_bfloat16.restype = ctypes.c_int32
        lib.aoti_torch_dtype_float32.restype = ctypes.c_int32
        dtypes = {
            torch.bfloat16: lib.aoti_torch_dtype_bfloat16(),
            torch.float32: lib.aoti_torch_dtype_float32(),
        }
        capsule = ctypes.pythonapi.PyCapsule_New
        capsule.restype = ctypes.py_object
        capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return (
            fn,
            lib.aoti_torch_layout__mkldnn(),
            dtypes,
            lib.aoti_torch_device_type_cpu(),
            capsule,
        )
    except (OSError, AttributeError) as e:
        logger.warning("oneDNN tensor views unavailable (%s); large-M linears use F.linear", e)
        return None
