"""Paged KV cache: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per
attention layer and a free-list block allocator shared by all layers.

Block 0 is reserved as the *null block*: padded block-table entries point at it, so a CUDA
graph captured for a larger batch reads valid (if meaningless) memory for padded requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    spec: KVCacheSpec, layer_names: list[str], num_blocks: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return {name: torch.zeros(shape, dtype=spec.dtype, device=device) for name in layer_names}


class BlockAllocator:
    """Free list of KV blocks; block 0 is never handed out (the null block)."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"out of KV cache blocks: need {n}, {len(self._free)} free of "
                f"{self.num_blocks}; raise max_num_seqs/max_model_len or the "
                f"KV cache memory budget"
            )
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
