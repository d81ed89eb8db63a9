"""CUDA-graph set-up for an LLM: pick the mode the attention backend supports, build the
dispatcher, wrap pieces (PIECEWISE) and/or the whole forward (FULL), capture at start-up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from framework.config import CompilationConfig, CompilationMode
from framework.cudagraph import CUDAGraphWrapper, total_stats
from framework.dispatcher import CudagraphDispatcher
from framework.forward_context import CUDAGraphMode
from framework.kv_cache import BlockAllocator
from framework.scheduler import Request, ScheduledChunk

logger = logging.getLogger(__name__)


@dataclass
class GraphSetup:
    mode: CUDAGraphMode
    dispatcher: CudagraphDispatcher
    graph_ops: Any = None
    debug: bool = False

    def wrap_piece(self) -> Optional[Callable]:
        if not self.mode.has_piecewise():
            return None

        def wrap(runnable, info):
            return CUDAGraphWrapper(runnable, CUDAGraphMode.PIECEWISE, debug=self.debug,
                                    graph_ops=self.graph_ops, name=info.name)
        return wrap

    def wrap_forward(self, forward: Callable) -> Callable:
        if not self.mode.has_full():
            return forward
        return CUDAGraphWrapper(forward, CUDAGraphMode.FULL, debug=self.debug,
                                graph_ops=self.graph_ops, name="model")


def setup_graphs(config: CompilationConfig, *, attention_backend: str, max_num_seqs: int,
                 graph_ops: Any = None) -> GraphSetup:
    from backends.attention.selector import select_cudagraph_mode

    mode = config.cudagraph_mode
    if mode != CUDAGraphMode.NONE:
        mode = select_cudagraph_mode(mode, [attention_backend],
                                     piecewise_available=config.mode == CompilationMode.PIECEWISE)
    dispatcher = CudagraphDispatcher(mode, config.cudagraph_capture_sizes,
                                     config.max_num_tokens, max_num_reqs=max_num_seqs)
    return GraphSetup(mode, dispatcher, graph_ops, config.cudagraph_debug)


def _dummy_chunks(desc, block_size: int) -> list[ScheduledChunk]:
    """Requests whose KV lives in the null block: one token each for a uniform (decode) key,
    else one request holding every token."""
    if desc.uniform and desc.num_reqs:
        sizes = [desc.num_tokens // desc.num_reqs] * desc.num_reqs
    else:
        sizes = [desc.num_tokens]
    chunks = []
    for i, n in enumerate(sizes):
        req = Request(-(i + 2), [0] * n, max_new_tokens=1)
        req.block_ids = [BlockAllocator.NULL_BLOCK] * -(-n // block_size)
        chunks.append(ScheduledChunk(req, 0, n))
    return chunks


def capture_graphs(runner, setup: GraphSetup, *, progress: bool = True) -> dict[str, float]:
    """Capture every key of the dispatcher, largest first; each key runs once without graphs
    first so kernel compilation and library set-up never happen inside a capture."""
    plan = setup.dispatcher.capture_plan() if setup.mode != CUDAGraphMode.NONE else []
    if not plan:
        return {"captures": 0, "capture_time_s": 0.0}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(plan), desc="capturing CUDA graphs", leave=False)
    for mode, desc in plan:
        chunks = _dummy_chunks(desc, runner.block_size)
        runner.execute(chunks, force=(CUDAGraphMode.NONE, desc))
        runner.execute(chunks, force=(mode, desc))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if runner.trace is not None:
        runner.trace.clear()
    for times in runner.step_times.values():
        times.clear()
    stats = total_stats()
    return {"captures": stats.captures, "capture_time_s": time.perf_counter() - t0}
