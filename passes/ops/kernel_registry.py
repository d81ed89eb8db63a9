"""Which implementation runs behind each ``piecewise::`` custom op, per device type.

Every op body is one line: ``kernel_for(QUALNAME, tensor.device.type)(*args)``.  The table maps
``qualified op name -> device type -> callable``; the entry ``"default"`` is the plain-torch
implementation (the CPU path and the test oracle) and serves every device without its own entry.

A platform swaps a kernel without touching the op or any graph that already holds it::

    from passes.ops.kernel_registry import override_kernel
    override_kernel("piecewise::rms_norm", "cuda", my_rms_norm)   # returns the previous one

Because ops look their kernel up at call time, the override rebinds every reference at once
(compiled graphs call the op, the op calls the table).  GPU kernels are registered *lazily* by
import path, so importing ``passes.ops`` never imports Triton and works on CPU-only machines.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, Union

DEFAULT = "default"

KernelRef = Union[Callable, str]
"""A callable, or ``"package.module:function"`` imported on first use."""

_KERNELS: dict[str, dict[str, KernelRef]] = {}


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def register_kernel(qualname: str, device_type: str = DEFAULT,
                    kernel: KernelRef | None = None):
    """Register ``kernel`` for ``qualname`` on ``device_type``; usable as a decorator."""
    if "::" not in qualname:
        raise ValueError(f"register_kernel: qualname must look like 'piecewise::rms_norm', "
                         f"got {qualname!r}")

    def deco(fn: KernelRef) -> KernelRef:
        _KERNELS.setdefault(qualname, {})[device_type] = fn
        return fn

    return deco if kernel is None else deco(kernel)


def override_kernel(qualname: str, device_type: str, kernel: KernelRef | None) -> KernelRef | None:
    """Replace (or with ``None`` remove) the kernel of one op on one device type.

    Returns the previous entry so callers can restore it."""
    if qualname not in _KERNELS:
        raise KeyError(f"override_kernel: unknown op {qualname!r}; registered ops: "
                       f"{sorted(_KERNELS)}")
    table = _KERNELS[qualname]
    previous = table.get(device_type)
    if kernel is None:
        table.pop(device_type, None)
    else:
        table[device_type] = kernel
    return previous


def _resolve(ref: KernelRef) -> Callable:
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def kernel_for(qualname: str, device_type: str) -> Callable:
    """The callable that implements ``qualname`` on ``device_type`` (falls back to default)."""
    try:
        table = _KERNELS[qualname]
    except KeyError:
        raise KeyError(f"no kernels registered for {qualname!r}; registered ops: "
                       f"{sorted(_KERNELS)}") from None
    key = device_type if device_type in table else DEFAULT
    ref = table[key]
    if not callable(ref):  # lazy import path: resolve once and cache the callable
        ref = table[key] = _resolve(ref)
    return ref


def registered_kernels() -> dict[str, dict[str, str]]:
    """Snapshot ``{op: {device: description}}`` for logging and reports."""
    return {op: {dev: (ref if isinstance(ref, str) else f"{ref.__module__}.{ref.__qualname__}")
                 for dev, ref in table.items()}
            for op, table in sorted(_KERNELS.items())}
