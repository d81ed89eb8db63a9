"""Dummy batches (THE one path: warm-up, calibration and CUDA-graph capture all use it) and
start-up CUDA-graph capture: run every key of the dispatcher through the runner, largest
first, on dummy requests whose KV lives in the null block."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional, Sequence

from framework.core.forward_context import BatchDescriptor, CUDAGraphMode
from framework.cudagraph.graph_setup import GraphSetup
from framework.engine.kv_cache import NULL_BLOCK
from framework.engine.request import Request, ScheduledChunk


def split_tokens(num_tokens: int, max_per_request: int, max_requests: int) -> list[int]:
    """Prefill requests of at most ``max_per_request`` tokens each (what a block-table row
    holds), the fewest that carry ``num_tokens``, and never more than ``max_requests``: a
    batch no step could schedule (more tokens than ``max_num_seqs`` full requests) is cut to
    the most one could hold.  Under a forced descriptor the rest of the key's tokens are
    padding rows, exactly as in a real step padded up to that key."""
    if max_per_request <= 0 or max_requests <= 0:
        raise ValueError(f"split_tokens: {max_per_request=}, {max_requests=} must be positive")
    num_tokens = min(num_tokens, max_per_request * max_requests)
    full, rest = divmod(num_tokens, max_per_request)
    return [max_per_request] * full + ([rest] if rest else [])


def dummy_sizes(desc: BatchDescriptor, max_per_request: int, max_requests: int) -> list[int]:
    """Tokens per dummy request for a dispatcher key: one token each (1 + k for speculative
    verify keys) for a uniform key, else the fewest prefill requests that hold every token."""
    if desc.uniform and desc.num_reqs:
        return [desc.num_tokens // desc.num_reqs] * desc.num_reqs
    return split_tokens(desc.num_tokens, max_per_request, max_requests)


@contextlib.contextmanager
def dummy_batch(
    sizes: Sequence[int],
    block_size: int,
    *,
    token_ids: Optional[Sequence[int]] = None,
    allocate: Optional[Callable[[int], list[int]]] = None,
    free: Optional[Callable[[list[int]], None]] = None,
) -> Iterator[list[ScheduledChunk]]:
    """Prefill chunks of throw-away requests (negative ids), ``sizes[i]`` tokens each.

    Their KV lives in the null block, unless ``allocate``/``free`` (a block manager's) give
    them real blocks, freed on exit: a forward whose attention must see the tokens written
    before it (calibration) needs that.  ``token_ids``: the tokens, concatenated (default
    zeros)."""
    if (allocate is None) != (free is None):
        raise ValueError("dummy_batch: pass both allocate and free, or neither")
    if token_ids is not None and len(token_ids) != sum(sizes):
        raise ValueError(
            f"dummy_batch: {len(token_ids)} token_ids for {sum(sizes)} tokens ({list(sizes)})"
        )
    chunks, taken, at = [], [], 0
    try:
        for i, n in enumerate(sizes):
            ids = list(token_ids[at : at + n]) if token_ids is not None else [0] * n
            at += n
            req = Request(-(i + 2), ids, max_new_tokens=1)
            num_blocks = -(-n // block_size)
            if allocate is not None:
                req.block_ids = allocate(num_blocks)
                taken.append(req.block_ids)
            else:
                req.block_ids = [NULL_BLOCK] * num_blocks
            chunks.append(ScheduledChunk(req, 0, n))
        yield chunks
    finally:
        for blocks in taken:
            free(blocks)


def capture_graphs(runner, setup: GraphSetup, *, progress: bool = True) -> dict[str, float]:
    """Capture every key of the dispatcher, largest first; each key runs once without graphs
    first so kernel compilation and library set-up never happen inside a capture.  Returns
    this setup's own capture count and the wall time."""
    plan = setup.dispatcher.capture_plan() if setup.mode != CUDAGraphMode.NONE else []
    if not plan:
        return {"captures": 0, "capture_time_s": 0.0}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan), desc="capturing CUDA graphs", leave=False)
    for mode, desc in plan:
        sizes = dummy_sizes(desc, runner.max_request_tokens, runner.max_num_seqs)
        with dummy_batch(sizes, runner.block_size) as chunks:
            runner.execute(chunks, force=(CUDAGraphMode.NONE, desc), record=False)
            runner.execute(chunks, force=(mode, desc), record=False)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"captures": setup.stats().captures, "capture_time_s": time.perf_counter() - t0}
