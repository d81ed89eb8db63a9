"""Which attention backend a model gets, and the CUDA-graph mode its backends allow.

The mode logic itself (the downgrade table) lives in one place,
:mod:`framework.core.cudagraph_mode`; this module supplies the backends' support level: a model
is only as graph-safe as its least capable attention layer.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from backends.attention.common import get_backend
from backends.attention.cpu_paged_build import compiler
from framework.core.cudagraph_mode import AttentionCGSupport, effective_cudagraph_mode
from framework.core.forward_context import CUDAGraphMode

logger = logging.getLogger(__name__)

_S = AttentionCGSupport


def default_backend(device: "torch.device | str") -> str:
    """The attention backend a model gets when none is named.

    CPU: ``cpu_paged``, the fused kernel (4-5x faster than the plain-torch backend per layer
    call at decode sizes, measured by ``python -m experiments.bench.attention``), when a C++
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


def select_cudagraph_mode(
    requested: CUDAGraphMode,
    backend_names: Iterable[str],
    *,
    uniform_decode_query_len: int = 1,
    piecewise_available: bool = True,
) -> CUDAGraphMode:
    """:func:`min_support` + :func:`~framework.core.cudagraph_mode.effective_cudagraph_mode`,
    logging the one line when the mode changes."""
    mode, reason = effective_cudagraph_mode(
        requested,
        piecewise_compiled=piecewise_available,
        support=min_support(backend_names),
        uniform_decode_query_len=uniform_decode_query_len,
    )
    if reason is not None:
        logger.warning(
            "cudagraph_mode %s -> %s: %s", CUDAGraphMode.parse(requested).name, mode.name, reason
        )
    return mode
