"""The per-forward context: what a forward pass needs besides its tensor arguments.

Set by :func:`set_forward_context` around each model call and read by the attention op and
the CUDA-graph wrappers through :func:`get_forward_context`.  The current context is a
:class:`contextvars.ContextVar`: it belongs to the thread (and asyncio task) that set it, so
two engines, or two threads, in one process never see each other's forward.  Keeping this
state out of the model's arguments is what lets Dynamo trace the model once with only
``input_ids`` and ``positions`` as graph inputs.

This module is a leaf: it imports nothing from the project, so ``backends`` (attention ops,
CUDA-graph wrappers) and ``models`` can read it without importing the rest of ``framework``.
"""

from __future__ import annotations

import enum
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch

if TYPE_CHECKING:  # a leaf still: the type is only named
    from framework.core.native_tape import NativeTapeSink


class CUDAGraphMode(enum.Enum):
    """How CUDA graphs wrap the model.  The runtime modes are NONE, PIECEWISE and FULL;
    FULL_DECODE_ONLY and FULL_AND_PIECEWISE are configuration modes the dispatcher resolves
    per step into one runtime mode."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    @classmethod
    def parse(cls, value: "CUDAGraphMode | str | None") -> "CUDAGraphMode | None":
        if value is None or isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(
                f"unknown CUDAGraphMode {value!r}; expected one of {[m.name for m in cls]}"
            ) from None

    def has_full(self) -> bool:
        return self in (
            CUDAGraphMode.FULL,
            CUDAGraphMode.FULL_DECODE_ONLY,
            CUDAGraphMode.FULL_AND_PIECEWISE,
        )

    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass(frozen=True)
class BatchDescriptor:
    """The minimal key of a CUDA graph.

    ``num_tokens`` is the padded token count; ``num_reqs`` is ``None`` for piecewise graphs
    (they do not depend on how tokens split into requests); ``uniform`` means every request
    has the same query length (pure decode is the common case).
    """

    num_tokens: int
    num_reqs: Optional[int] = None
    uniform: bool = False


@dataclass
class ForwardContext:
    """Everything a forward reads besides its tensor arguments."""

    attn_metadata: Mapping[str, Any]
    """Attention metadata per attention layer name (layers usually share one object)."""
    kv_caches: Mapping[str, torch.Tensor]
    """The paged KV cache tensor of each attention layer, by layer name."""
    slot_mapping: Optional[torch.Tensor] = None
    """Flat KV-cache slot of every (padded) token; -1 marks padding."""
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    """The one runtime mode (NONE, PIECEWISE or FULL) active for this forward."""
    batch_descriptor: Optional[BatchDescriptor] = None
    """The (padded) descriptor the dispatcher chose for this forward."""
    padding_mask: Optional[torch.Tensor] = None
    """Bool [num_padded_tokens]: True for real tokens, False for padding."""
    cpu_replay: bool = False
    """CPU pieces may replay the native calls they recorded for the same inputs and return
    the buffers of that recording (``backends/piecewise/replay.py``): set by a caller that is
    done with every piece output before the same piece runs again on the same inputs (the
    engine's runner, for steps of at most ``CompilationConfig.cpu_replay_max_tokens``)."""
    native_tape: Optional["NativeTapeSink"] = None
    """Set while a whole forward is being recorded (``backends/piecewise/forward_replay.py``):
    every part that runs native code reports its calls to it, or why it cannot."""


_current: ContextVar[Optional[ForwardContext]] = ContextVar(
    "piecewise_forward_context", default=None
)
"""The forward in progress in this thread / task (None outside a forward)."""


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; raises outside a forward."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no forward context is set: the attention op and CUDA-graph wrappers read their "
            "metadata from it. Wrap the model call in "
            "`with framework.core.forward_context.set_forward_context(...)` (the runner does "
            "this; the context belongs to the thread that set it)."
        )
    return ctx


def is_forward_context_available() -> bool:
    return _current.get() is not None


def cpu_replay_requested() -> bool:
    """The forward in progress lets CPU pieces replay (:attr:`ForwardContext.cpu_replay`)."""
    ctx = _current.get()
    return ctx is not None and ctx.cpu_replay


def native_tape_sink() -> Optional["NativeTapeSink"]:
    """The sink of the forward being recorded (:attr:`ForwardContext.native_tape`), or None."""
    ctx = _current.get()
    return None if ctx is None else ctx.native_tape


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the current forward context of this thread for the duration of the block."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
