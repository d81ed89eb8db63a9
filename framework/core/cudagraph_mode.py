"""The effective CUDA-graph mode: the one place that turns a requested mode into the mode that
runs, given what is available (CUDA, piecewise compilation, the attention backends' support).

Two callers supply what they know when they run: :meth:`CompilationConfig.resolve` (CUDA and
piecewise compilation; the attention backend is not chosen yet, so ``support=ALWAYS``) and
``backends.attention.selector.select_cudagraph_mode`` (the backends' support). The function
is idempotent, so applying it again with more facts never undoes an earlier downgrade.

Downgrade table for the attention support (``q`` = uniform decode query length; "no pieces" =
the model is not piecewise-compiled, so PIECEWISE graphs have nothing to wrap):

======================  =====================  ========================  ==================
requested               UNIFORM_BATCH          UNIFORM_SINGLE_TOKEN      NEVER
                                               _DECODE (and q > 1: as
                                               NEVER)
======================  =====================  ========================  ==================
FULL                    FULL_AND_PIECEWISE     FULL_AND_PIECEWISE        PIECEWISE
                        (no pieces:            (no pieces:               (no pieces: NONE)
                        FULL_DECODE_ONLY)      FULL_DECODE_ONLY)
FULL_AND_PIECEWISE      unchanged              unchanged                 PIECEWISE
FULL_DECODE_ONLY        unchanged              unchanged                 NONE
PIECEWISE, NONE         unchanged              unchanged                 unchanged
======================  =====================  ========================  ==================

ALWAYS keeps every mode. Before the table: no CUDA -> NONE; a mode with piecewise graphs on a
model that is not piecewise-compiled -> FULL.
"""

from __future__ import annotations

import enum
from typing import Optional

from framework.core.forward_context import CUDAGraphMode

_M = CUDAGraphMode


class AttentionCGSupport(enum.IntEnum):
    """How much of a batch an attention backend can run inside a CUDA graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Only batches where every request decodes exactly one token."""
    UNIFORM_BATCH = 2
    """Batches where every request has the same query length."""
    ALWAYS = 3
    """Any batch, mixed prefill and decode included."""


_S = AttentionCGSupport


def effective_cudagraph_mode(
    requested: "CUDAGraphMode | str",
    *,
    has_cuda: bool = True,
    piecewise_compiled: bool = True,
    support: AttentionCGSupport = AttentionCGSupport.ALWAYS,
    uniform_decode_query_len: int = 1,
) -> tuple[CUDAGraphMode, Optional[str]]:
    """The mode that runs, and why it differs from ``requested`` (``None`` if it does not)."""
    requested = CUDAGraphMode.parse(requested)
    if requested is _M.NONE:
        return requested, None
    if not has_cuda:
        return _M.NONE, "CUDA is not available"
    mode, why = requested, None
    if not piecewise_compiled and mode.has_piecewise():
        mode, why = _M.FULL, "piecewise graphs need piecewise compilation; using FULL instead"
    mode, why_support = _for_support(
        mode, AttentionCGSupport(support), uniform_decode_query_len, piecewise_compiled
    )
    if why_support is not None:
        why = why_support if why is None else f"{why}; {why_support}"
    return mode, why


def _for_support(
    requested: CUDAGraphMode, support: AttentionCGSupport, q: int, piecewise_available: bool
) -> tuple[CUDAGraphMode, Optional[str]]:
    if not requested.has_full() or support is _S.ALWAYS:
        return requested, None
    effective = support
    if support is _S.UNIFORM_SINGLE_TOKEN_DECODE and q > 1:
        # Decode batches have q > 1 tokens per request: the backend cannot run any of them.
        effective = _S.NEVER
    level = support.name
    if effective is _S.NEVER:
        why = (
            f"attention backend support is {level}"
            + (f" and uniform_decode_query_len={q} > 1" if effective is not support else "")
            + ": attention cannot be captured in a CUDA graph"
        )
        if requested is _M.FULL_DECODE_ONLY:
            return _M.NONE, why + "; running without graphs"
        if piecewise_available:
            return _M.PIECEWISE, why + "; using piecewise graphs (attention runs eagerly)"
        return _M.NONE, why + " and the model is not piecewise-compiled; running without graphs"
    # UNIFORM_BATCH or UNIFORM_SINGLE_TOKEN_DECODE (with q == 1): uniform decode batches can
    # be captured whole; mixed batches cannot.
    if requested is _M.FULL:
        what = "uniform batches" if effective is _S.UNIFORM_BATCH else "single-token decode"
        if piecewise_available:
            return _M.FULL_AND_PIECEWISE, (
                f"attention backend support is {level}: full graphs only for {what}; "
                f"mixed batches use piecewise graphs"
            )
        return _M.FULL_DECODE_ONLY, (
            f"attention backend support is {level}: full graphs only for {what}; the model "
            f"is not piecewise-compiled, so mixed batches run without graphs"
        )
    return requested, None
