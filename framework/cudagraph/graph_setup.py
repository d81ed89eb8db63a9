"""CUDA-graph set-up for an LLM: pick the mode the attention backend supports, build the
dispatcher, wrap pieces (PIECEWISE) and/or the whole forward (FULL). Capturing at start-up
drives the runner, so it lives in the engine (``framework.engine.capture``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from backends.attention.selector import select_cudagraph_mode
from framework.core.config import CompilationConfig, CompilationMode
from framework.core.forward_context import CUDAGraphMode
from framework.cudagraph.dispatcher import CudagraphDispatcher
from framework.cudagraph.wrapper import CUDAGraphOps, CUDAGraphStats, CUDAGraphWrapper, sum_stats

logger = logging.getLogger(__name__)


@dataclass
class GraphSetup:
    mode: CUDAGraphMode
    dispatcher: CudagraphDispatcher
    graph_ops: Any = None
    debug: bool = False
    wrappers: list[CUDAGraphWrapper] = field(default_factory=list)
    """Every wrapper this set-up made: its engine's graphs, and only its engine's."""

    def stats(self) -> CUDAGraphStats:
        """This set-up's captures, replays and capture time (per engine, not per process)."""
        return sum_stats(self.wrappers)

    def _wrap(self, runnable: Callable, mode: CUDAGraphMode, name: str) -> CUDAGraphWrapper:
        w = CUDAGraphWrapper(runnable, mode, debug=self.debug, graph_ops=self.graph_ops, name=name)
        self.wrappers.append(w)
        return w

    def wrap_piece(self) -> Optional[Callable]:
        if not self.mode.has_piecewise():
            return None

        def wrap(runnable, info):
            return self._wrap(runnable, CUDAGraphMode.PIECEWISE, info.name)

        return wrap

    def wrap_forward(self, forward: Callable) -> Callable:
        if not self.mode.has_full():
            return forward
        return self._wrap(forward, CUDAGraphMode.FULL, "model")


def setup_graphs(
    config: CompilationConfig,
    *,
    attention_backend: str,
    max_num_seqs: int,
    graph_ops: Any = None,
    uniform_decode_query_len: int = 1,
) -> GraphSetup:
    """``uniform_decode_query_len``: query tokens per request of a uniform batch (1; 1 + k
    with speculative decoding, whose verify steps are then the uniform batches)."""
    mode = config.cudagraph_mode
    q = uniform_decode_query_len
    if mode != CUDAGraphMode.NONE:
        mode = select_cudagraph_mode(
            mode,
            [attention_backend],
            uniform_decode_query_len=q,
            piecewise_available=config.mode == CompilationMode.PIECEWISE,
        )
    dispatcher = CudagraphDispatcher(
        mode,
        config.cudagraph_capture_sizes,
        config.max_num_tokens,
        q,
        max_num_reqs=max_num_seqs,
    )
    if graph_ops is None and mode != CUDAGraphMode.NONE:
        graph_ops = CUDAGraphOps()  # this engine's own: its own memory pool
    return GraphSetup(mode, dispatcher, graph_ops, config.cudagraph_debug)
