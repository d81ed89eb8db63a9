"""Reconcile the requested CUDA-graph mode with what the model's attention backends support.

A FULL graph captures attention too, so it is only valid for the batches the backend can run
inside a graph.  The model's support is the minimum over its attention layers; the requested
configuration mode is then downgraded to the strongest mode that stays correct, with one
reason string for the one log line.

Downgrade table (``q`` = uniform decode query length; "no pieces" = the model is not
piecewise-compiled, so PIECEWISE graphs have nothing to wrap):

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

ALWAYS keeps every mode.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from backends.attention.common import AttentionCGSupport, get_backend
from backends.attention.cpu_paged_build import compiler
from framework.core.forward_context import CUDAGraphMode

logger = logging.getLogger(__name__)

_M = CUDAGraphMode
_S = AttentionCGSupport


def default_backend(device: "torch.device | str") -> str:
    """The attention backend a model gets when none is named.

    CPU: ``cpu_paged``, the fused kernel (4-5x faster than the plain-torch backend per layer
    call at decode sizes, measured by ``python -m experiments.bench_attention``), when a C++
    compiler is there to build it; otherwise ``torch``.  Other devices keep ``torch`` (the
    Triton backend is chosen explicitly on GPU, as before).
    """
    if torch.device(device).type == "cpu" and compiler() is not None:
        return "cpu_paged"
    return "torch"


def min_support(backend_names: Iterable[str]) -> AttentionCGSupport:
    """The weakest support level among the named backends (a model is only as graph-safe as
    its least capable attention layer); ALWAYS when there are no attention layers."""
    levels = [get_backend(name).cudagraph_support for name in backend_names]
    return min(levels, default=_S.ALWAYS)


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    support: AttentionCGSupport,
    *,
    uniform_decode_query_len: int = 1,
    piecewise_available: bool = True,
) -> tuple[CUDAGraphMode, Optional[str]]:
    """The mode to use given the backends' ``support``, and why it changed (None if not).

    ``piecewise_available``: False when the model is not piecewise-compiled, so a downgrade
    cannot fall back to PIECEWISE graphs.
    """
    requested = CUDAGraphMode.parse(requested)
    support = AttentionCGSupport(support)
    if not requested.has_full() or support is _S.ALWAYS:
        return requested, None
    effective = support
    if support is _S.UNIFORM_SINGLE_TOKEN_DECODE and uniform_decode_query_len > 1:
        # Decode batches have q > 1 tokens per request: the backend cannot run any of them.
        effective = _S.NEVER
    piecewise_or_none = _M.PIECEWISE if piecewise_available else _M.NONE
    level = support.name
    if effective is _S.NEVER:
        why = (
            f"attention backend support is {level}"
            + (
                f" and uniform_decode_query_len={uniform_decode_query_len} > 1"
                if effective is not support
                else ""
            )
            + ": attention cannot be captured in a CUDA graph"
        )
        if requested is _M.FULL_DECODE_ONLY:
            return _M.NONE, why + "; running without graphs"
        if piecewise_or_none is _M.PIECEWISE:
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


def select_cudagraph_mode(
    requested: CUDAGraphMode,
    backend_names: Iterable[str],
    *,
    uniform_decode_query_len: int = 1,
    piecewise_available: bool = True,
) -> CUDAGraphMode:
    """:func:`min_support` + :func:`resolve_cudagraph_mode`, logging the one line when the
    mode changes."""
    support = min_support(backend_names)
    mode, reason = resolve_cudagraph_mode(
        requested,
        support,
        uniform_decode_query_len=uniform_decode_query_len,
        piecewise_available=piecewise_available,
    )
    if reason is not None:
        logger.warning(
            "cudagraph_mode %s -> %s: %s", CUDAGraphMode.parse(requested).name, mode.name, reason
        )
    return mode
