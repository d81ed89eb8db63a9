"""Start-up CUDA-graph capture: run every key of the dispatcher through the runner, largest
first, on dummy requests whose KV lives in the null block."""

from __future__ import annotations

import time

from framework.core.forward_context import CUDAGraphMode
from framework.cudagraph.setup import GraphSetup
from framework.cudagraph.wrapper import total_stats
from framework.engine.kv_cache import BlockAllocator
from framework.engine.scheduler import Request, ScheduledChunk


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
