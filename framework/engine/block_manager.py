"""KV block manager: a free list, reference counts and (optionally) a prefix cache.

With prefix caching, every *full* block a request has computed is registered under a hash
chain key ``(parent block hash, block token ids)``: two requests whose token sequences agree
up to a block boundary share the blocks before it.  A block whose reference count drops to 0
keeps its contents and its key and goes to an LRU; it is evicted (loses its key) only when an
allocation finds the free list empty.  ``num_free`` counts free *and* evictable blocks.

Block 0 is the null block (padded block-table entries point at it) and is never handed out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from framework.engine.kv_cache import NULL_BLOCK

NO_PARENT = b""


def chain_hashes(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes = NO_PARENT
) -> list[bytes]:
    """Hash chain (SHA-256 of parent digest + block token ids) of the full blocks of
    ``tokens`` from full block ``start`` on: a collision would silently share wrong K/V, so
    the hash is cryptographic rather than Python's 64-bit ``hash``."""
    out = []
    for b in range(start, len(tokens) // block_size):
        block = array("q", tokens[b * block_size : (b + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prefix_cache_queried_tokens": self.queried_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_evictions": self.evictions,
        }


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    NULL_BLOCK = NULL_BLOCK

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_blocks - 1, 0, -1))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # ref 0, still keyed
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ counts
    @property
    def num_usable(self) -> int:
        """Blocks a request can ever get (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(
                f"out of KV cache blocks: need {n}, {self.num_free} free of {self.num_usable}"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.stats.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference of each block; the last reference frees (or caches) it.  Blocks
        are released last-first, so a request's tail is evicted before its prefix."""
        for b in reversed(blocks):
            if b == self.NULL_BLOCK:
                continue
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks cached for the longest prefix of ``hashes`` (no references taken)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (removes them from the LRU)."""
        for b in blocks:
            if self._ref[b] == 0:
                self._lru.pop(b)
            self._ref[b] += 1

    def register(self, block: int, block_hash: bytes) -> int:
        """Key a computed full block; returns the block that now holds the key (an equal
        block registered earlier keeps it)."""
        if block in self._hash_of:
            return block
        existing = self._block_of.get(block_hash)
        if existing is not None:
            return existing
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return block

    def check(self) -> None:
        """Invariants (tests): every block is exactly one of free, cached-unreferenced or
        referenced."""
        free, lru = set(self._free), set(self._lru)
        used = {b for b in range(1, self.num_blocks) if self._ref[b] > 0}
        assert not (free & lru) and not (free & used) and not (lru & used), "overlap"
        assert len(free) + len(lru) + len(used) == self.num_usable, "lost blocks"
        assert all(b in self._hash_of for b in lru), "LRU block without a key"

    def cached_block(self, block_hash: bytes) -> Optional[int]:
        return self._block_of.get(block_hash)
