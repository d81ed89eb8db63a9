"""Paged KV cache: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per
attention layer and a free-list block allocator shared by all layers.

Block 0 is reserved as the *null block*: padded block-table entries point at it, so a CUDA
graph captured for a larger batch reads valid (if meaningless) memory for padded requests.

On CPU each layer's cache is placed in transparent huge pages (:mod:`framework.core.huge_pages`;
torch's allocator where they cannot be had).  A decode step reads a layer's KV blocks after
the step's weights went through the caches, scattered over the cache: in 2 MB pages those
reads need far fewer page walks.  The same caches swapped between 4 KB and 2 MB pages inside
one engine (``python -m experiments.bench.engine_ab --ab kv_pages``; tiny model, bf16, 2
threads, 8 alternating rounds): the median decode attention call 0.938x (b1), 0.904x (b8),
0.970x (b32) the time, the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from framework.core.huge_pages import HugePageAllocator


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def num_blocks_for(
    spec: KVCacheSpec, *, max_model_len: int, max_num_seqs: int, memory_bytes: int | None = None
) -> int:
    """Blocks for ``max_num_seqs`` full-length sequences, or what ``memory_bytes`` holds;
    plus the reserved null block.  A budget below one ``max_model_len`` sequence is allowed:
    the scheduler rejects, one by one, the requests that could never fit in it."""
    if memory_bytes is not None:
        blocks = memory_bytes // spec.bytes_per_block
        if blocks < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={memory_bytes} holds {blocks} blocks of "
                f"{spec.bytes_per_block} bytes; at least 2 are needed (one is the null "
                f"block); raise the budget"
            )
        return int(blocks)
    return max_num_seqs * -(-max_model_len // spec.block_size) + 1


def allocate_kv_caches(
    spec: KVCacheSpec,
    layer_names: list[str],
    num_blocks: int,
    device: torch.device | str,
    huge_pages: Optional[HugePageAllocator] = None,
) -> dict[str, torch.Tensor]:
    """One zeroed cache per layer; on CPU in huge pages from ``huge_pages`` (default: an
    allocator of its own), which falls back to torch's allocator by itself."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if torch.device(device).type != "cpu":
        return {name: torch.zeros(shape, dtype=spec.dtype, device=device) for name in layer_names}
    alloc = huge_pages if huge_pages is not None else HugePageAllocator()
    return {name: alloc.empty(shape, spec.dtype).zero_() for name in layer_names}


NULL_BLOCK = 0
"""Block 0 of every KV cache is never handed out: padded block-table entries point at it."""
