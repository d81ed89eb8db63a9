"""One way to define every ``piecewise::`` custom op (attention, packed linear, fused ops).

``define_op`` declares an op with ``torch.library`` (schema inferred from the Python signature,
mutated arguments marked), registers its fake (meta) implementation and one implementation
per dispatch key::

    @define_op("piecewise::rms_norm", mutates_args=("out",), fake=_rms_norm_fake,
               cuda="passes.ops.triton.norm:rms_norm")
    def rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
        ...   # the plain-torch implementation: every device without its own kernel

Device keys: the decorated function serves ``CompositeExplicitAutograd`` (any device) unless
``default_key`` says otherwise; ``cpu=`` / ``cuda=`` add device kernels, each a callable or a
``"package.module:function"`` path imported on first call (so importing an op module never
imports Triton). The torch dispatcher picks the kernel: there is no Python-level dispatch.

Ops are plain ``torch.library.Library`` definitions, not ``torch.library.custom_op``: on the
hot path (attention runs once per layer per step) custom_op's Python wrapper cost ~50 µs per
call against ~3 µs for a Library kernel (measured side by side, torch 2.13 CPU). Outputs never
alias inputs (write into a mutated ``out`` argument instead).

``set_direct_call(qualname, fn)`` / ``direct_call(qualname)``: an op whose CPU kernel is also a
function of a native Python module (``passes/native_ops.py``) can be called without the
dispatcher; the lean pieces do (``backends/piecewise/inductor_lean.py``), a decode step's
dozens of linear calls ~1.1 µs cheaper each.

``with override_kernel(qualname, device, fn):`` swaps one device's kernel for the calls made
in that block, in that thread (or asyncio task) only: compiled graphs called inside it use the
new kernel, and another engine or thread running at the same time does not see it.  The first
override of an (op, device) installs a trampoline kernel that reads a ``ContextVar`` (one
look-up per call); outside any override it calls the registered kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import threading
import warnings
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from framework.compat.ops import OpOverload, dispatch_observed

NAMESPACE = "piecewise"
KernelRef = Union[Callable, str]
"""A callable, or ``"package.module:function"`` imported on first call."""

DEVICE_KEYS = {"default": "CompositeExplicitAutograd", "cpu": "CPU", "cuda": "CUDA"}

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_KERNELS: dict[str, dict[str, KernelRef]] = {}
"""qualname -> device ("default", "cpu", "cuda") -> what was registered (for overrides).  It
mirrors torch's dispatcher, which is one per process (an op is defined once per process,
whatever engine uses it), so it is process-wide too; :data:`_REGISTRY_LOCK` guards both."""
_REGISTRY_LOCK = threading.RLock()
"""Held while a kernel (or an override's trampoline) is registered and :data:`_KERNELS` /
:data:`_TRAMPOLINES` change: two threads overriding one op at once install one trampoline."""


def if_installed(package: str, ref: str) -> Optional[str]:
    """``ref`` when ``package`` can be imported (it is not imported here), else None: how an
    op declares a kernel that needs an optional package, e.g. Triton for ``cuda=``."""
    return ref if importlib.util.find_spec(package) is not None else None


def _split(qualname: str) -> str:
    ns, sep, name = qualname.partition("::")
    if not sep or ns != NAMESPACE or not name:
        raise ValueError(f"op name must look like '{NAMESPACE}::rms_norm', got {qualname!r}")
    return name


def resolve_kernel(ref: KernelRef) -> Callable:
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _lazy(ref: KernelRef) -> Callable:
    if callable(ref):
        return ref
    resolved: list[Callable] = []

    def kernel(*args, **kwargs):
        if not resolved:
            resolved.append(resolve_kernel(ref))
        return resolved[0](*args, **kwargs)

    kernel.__name__ = ref.rpartition(":")[2]
    return kernel


def _register(qualname: str, device: str, ref: KernelRef) -> None:
    if device not in DEVICE_KEYS:
        raise ValueError(f"{qualname}: unknown device {device!r}; use one of {sorted(DEVICE_KEYS)}")
    with _REGISTRY_LOCK, warnings.catch_warnings():  # re-registering is what an override is for
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        _LIB.impl(_split(qualname), _lazy(ref), DEVICE_KEYS[device], allow_override=True)
        _KERNELS.setdefault(qualname, {})[device] = ref


def define_op(
    qualname: str,
    *,
    mutates_args: Sequence[str] = (),
    fake: Callable,
    schema: Optional[str] = None,
    default_key: str = "default",
    cpu: Optional[KernelRef] = None,
    cuda: Optional[KernelRef] = None,
) -> Callable[[Callable], OpOverload]:
    """Decorator: define ``qualname`` with the decorated function as its ``default_key``
    kernel; returns the op's default overload (``torch.ops.piecewise.<name>.default``)."""
    name = _split(qualname)

    def deco(fn: Callable) -> OpOverload:
        sig = schema or torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIB.define(name + sig)
        torch.library.register_fake(qualname, fake, lib=_LIB)
        _register(qualname, default_key, fn)
        for device, ref in (("cpu", cpu), ("cuda", cuda)):
            if ref is not None:
                _register(qualname, device, ref)
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return deco


_OVERRIDES: contextvars.ContextVar[dict[tuple[str, str], Callable]] = contextvars.ContextVar(
    "piecewise_kernel_overrides", default={}
)
"""(qualname, device) -> the kernel that replaces it in the current context (never mutated:
each ``override_kernel`` block sets a new dict and restores the old one)."""
_TRAMPOLINES: set[tuple[str, str]] = set()
"""(qualname, device) whose registered kernel is a trampoline reading :data:`_OVERRIDES`."""
_DIRECT: dict[str, Callable] = {}
"""qualname -> its CPU kernel as a plain Python callable (:func:`set_direct_call`)."""
_RECORDERS: dict[str, Callable] = {}
"""qualname -> its recording direct kernel (:func:`set_direct_recorder`)."""


def _trampoline(qualname: str, device: str, ref: KernelRef) -> Callable:
    base = _lazy(ref)
    key = (qualname, device)

    def kernel(*args, **kwargs):
        fn = _OVERRIDES.get().get(key)
        return (fn or base)(*args, **kwargs)

    kernel.__name__ = getattr(base, "__name__", "kernel")
    return kernel


@contextlib.contextmanager
def override_kernel(qualname: str, device: str, kernel: KernelRef) -> Iterator[None]:
    """Within the block, and only in the current thread / task, ``qualname`` runs ``kernel``
    on ``device`` (``"default"`` for the op's device-independent kernel, ``"cpu"``,
    ``"cuda"``); a device without a kernel of its own otherwise runs the default one."""
    if qualname not in _KERNELS:
        raise KeyError(f"override_kernel: unknown op {qualname!r}; defined ops: {sorted(_KERNELS)}")
    if device not in DEVICE_KEYS:
        raise ValueError(f"{qualname}: unknown device {device!r}; use one of {sorted(DEVICE_KEYS)}")
    if kernel is None:
        raise ValueError(f"override_kernel({qualname!r}): give the kernel to run in the block")
    key = (qualname, device)
    with _REGISTRY_LOCK:
        if key not in _TRAMPOLINES:
            table = _KERNELS[qualname]
            ref = table.get(device, table["default"])
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=".*Overriding a previously registered kernel"
                )
                _LIB.impl(
                    _split(qualname),
                    _trampoline(qualname, device, ref),
                    DEVICE_KEYS[device],
                    allow_override=True,
                )
            _TRAMPOLINES.add(key)
    token = _OVERRIDES.set({**_OVERRIDES.get(), key: resolve_kernel(kernel)})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def set_direct_call(qualname: str, fn: Callable) -> None:
    """Register ``fn`` as ``qualname``'s CPU kernel callable from Python without the
    dispatcher (a native op library's Python module function: the function the op's CPU
    dispatch key runs).  Process-wide, like the kernel it mirrors."""
    _split(qualname)
    with _REGISTRY_LOCK:
        _DIRECT[qualname] = fn


def set_direct_recorder(qualname: str, fn: Callable) -> None:
    """Register ``fn`` as ``qualname``'s recording direct kernel: called as the direct kernel
    is, it returns ``(output, native_call)``, where ``native_call`` is the C function the call
    ran and its arguments as 64-bit words (``[address, 1, word, ...]``: the function returns
    an int, nonzero on error), or empty where the call cannot be replayed from its arguments
    alone.  What a lean piece records to replay its calls (``backends/piecewise/replay.py``).
    Process-wide, like the direct kernel."""
    _split(qualname)
    with _REGISTRY_LOCK:
        _RECORDERS[qualname] = fn


def direct_recorder(qualname: str) -> Optional[Callable]:
    """``qualname``'s recording direct kernel (:func:`set_direct_recorder`), or None."""
    return _RECORDERS.get(qualname)


def direct_kernel(qualname: str) -> Optional[Callable]:
    """``qualname``'s registered direct kernel itself (:func:`set_direct_call`), or None: for
    callers that check :func:`direct_calls_allowed` once for a batch of calls (a lean piece
    does, per piece call) and pass positional arguments only."""
    return _DIRECT.get(qualname)


def direct_calls_allowed() -> bool:
    """False while an :func:`override_kernel` block is active in the calling context or a
    Python dispatch mode or the profiler watches the thread
    (``framework.compat.ops.dispatch_observed``): then every op call must go through the
    dispatcher, which the override rebinds and the watchers see."""
    return not _OVERRIDES.get() and not dispatch_observed()


def direct_call(qualname: str) -> Optional[Callable]:
    """A callable running ``qualname``'s registered direct kernel (:func:`set_direct_call`),
    or None where there is none.  Only for what a lean piece calls at run time: CPU tensors,
    no autograd.  It goes through the dispatcher while any :func:`override_kernel` block is
    active in the calling context (an override is never bypassed), while a Python dispatch
    mode or the profiler watches the thread (``framework.compat.ops.dispatch_observed``: they
    see every call), and for keyword arguments.  Saves the dispatcher's boxing of the
    arguments: ~2.8 -> ~1.7 µs a call on a 64x64 linear (``experiments.bench.op_overhead``)."""
    fn = _DIRECT.get(qualname)
    if fn is None:
        return None
    name = _split(qualname)
    allowed = direct_calls_allowed

    def call(*args, **kwargs):
        if kwargs or not allowed():  # (the module functions take positional arguments)
            return getattr(torch.ops.piecewise, name).default(*args, **kwargs)
        return fn(*args)

    call.__name__ = call.__qualname__ = f"direct_{name}"
    return call


def registered_kernels() -> dict[str, dict[str, str]]:
    """``{op: {device: description}}`` for logging, reports and tests."""
    return {
        op: {
            dev: (ref if isinstance(ref, str) else f"{ref.__module__}.{ref.__qualname__}")
            for dev, ref in table.items()
        }
        for op, table in sorted(_KERNELS.items())
    }
