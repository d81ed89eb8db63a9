"""Op objects, FX, fake tensors, dispatch modes, pytree and private ops.

Every name here was checked on torch 2.11.0 and 2.13.0 (:data:`~framework.compat.CHECKED_ON`).
These are the types and helpers every FX pass needs and torch exposes only under private
module names; they are required (no public path), so a missing one fails at import with
:class:`~framework.compat.Unavailable` naming it.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from framework.compat.versions import Unavailable


def _attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"{module}.{name}", str(e)) from e


# torch._ops (torch 2.11, 2.13): the classes of ``torch.ops.<ns>.<op>[.<overload>]`` objects.
OpOverload = _attr("torch._ops", "OpOverload")
OpOverloadPacket = _attr("torch._ops", "OpOverloadPacket")
HigherOrderOperator = _attr("torch._ops", "HigherOrderOperator")

# torch._subclasses (torch 2.11, 2.13).
FakeTensor = _attr("torch._subclasses.fake_tensor", "FakeTensor")
FakeTensorMode = _attr("torch._subclasses.fake_tensor", "FakeTensorMode")
unset_fake_temporarily = _attr("torch._subclasses.fake_tensor", "unset_fake_temporarily")

# torch._dispatch.python (torch 2.11, 2.13): run ops without the Python dispatcher.
no_python_dispatcher = _attr("torch._dispatch.python", "no_python_dispatcher")

# torch.utils._python_dispatch / torch.utils._pytree (torch 2.11, 2.13).
TorchDispatchMode = _attr("torch.utils._python_dispatch", "TorchDispatchMode")
tree_flatten = _attr("torch.utils._pytree", "tree_flatten")
tree_unflatten = _attr("torch.utils._pytree", "tree_unflatten")
tree_map_only = _attr("torch.utils._pytree", "tree_map_only")

# torch._higher_order_ops.auto_functionalize (torch 2.11, 2.13): the functionalized form of a
# mutating custom op in a traced graph, and the names of its mutated arguments.
auto_functionalized = _attr("torch._higher_order_ops.auto_functionalize", "auto_functionalized")
auto_functionalized_v2 = _attr(
    "torch._higher_order_ops.auto_functionalize", "auto_functionalized_v2"
)
get_mutable_args = _attr("torch._higher_order_ops.auto_functionalize", "get_mutable_args")


# torch._C (torch 2.11, 2.13): the depth of this thread's Python dispatch-mode stack and
# whether the profiler records ops.  Optional: where either is missing, dispatch_observed()
# says True and callers keep the dispatcher.
_DISPATCH_STACK_LEN = getattr(torch._C, "_len_torch_dispatch_stack", None)
_PROFILER_ENABLED = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)


def dispatch_observed() -> bool:
    """Whether something watches this thread's op calls through the dispatcher: a Python
    dispatch mode (fake tensors, the CUDA-graph emulation's capture, an op counter) or the
    profiler.  A call that skips the dispatcher would be hidden from them, so it must not
    (``framework.core.ops.direct_call``).  True where this torch cannot tell."""
    if _DISPATCH_STACK_LEN is None or _PROFILER_ENABLED is None:
        return True
    return _DISPATCH_STACK_LEN() > 0 or _PROFILER_ENABLED()


# Underscore aten ops (torch 2.11, 2.13) that graphs contain and passes match by identity.
LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
"""What ``Tensor.item()`` dispatches to: a read of a device value on the host."""
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
"""The view decompositions emit for ``reshape`` of a fresh tensor."""


def qualified_name(target: Any) -> str:
    """The name FX's code generation gives a callable (``torch.fx.node._get_qualified_name``,
    torch 2.11, 2.13); raises for a callable FX cannot name."""
    return torch.fx.node._get_qualified_name(target)


def c10d_functional() -> Any:
    """The functional-collectives op namespace (``torch.ops._c10d_functional``, torch 2.11,
    2.13: ``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``wait_tensor``), the ops Dynamo traces for ``torch.distributed`` collectives."""
    return torch.ops._c10d_functional


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32 matrix product (``torch._int_mm``, torch 2.11, 2.13); without it,
    the public int32 ``matmul`` (exact, slower; CPU only)."""
    fn = getattr(torch, "_int_mm", None)
    if fn is not None:
        return fn(a, b)
    return torch.matmul(a.to(torch.int32), b.to(torch.int32))


def weight_int8pack_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> Optional[torch.Tensor]:
    """``x @ (w_q * w_scale[:, None])^T`` for int8 ``w_q [N, K]``, in x's dtype, through
    ``torch.ops.aten._weight_int8pack_mm`` (torch 2.11, 2.13); None where this torch has no
    such op (the caller dequantises and runs the public ``F.linear``)."""
    try:
        op = torch.ops.aten._weight_int8pack_mm
    except (AttributeError, RuntimeError):  # an unknown aten op raises one of these
        return None
    return op(x, w_q, w_scale)
