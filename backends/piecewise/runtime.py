"""The runtime object that replaces one compiled piece of the split graph.

It holds ``compile_range -> entry``.  Single-size entries win over the range containing them.
Dispatch reads the token count from the arguments (a SymInt argument or the token dim of a
tensor argument) and looks the entry up in a table indexed by token count: O(1) per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from framework.core.compile_range import CompileRange


@dataclass
class RangeEntry:
    compile_range: CompileRange
    runnable: Callable
    source: str
    """'compiled', 'loaded' or 'shared' (reused from an identical piece)."""


class PiecewiseRuntime:
    """Callable standing in for one piece; dispatches each call on its token count."""

    def __init__(
        self,
        name: str,
        entries: list[RangeEntry],
        max_num_tokens: int,
        size_from: tuple[int, Optional[int]],
    ):
        self.name = name
        self.entries = {e.compile_range: e for e in entries}
        self.max_num_tokens = max_num_tokens
        self._arg, self._dim = size_from
        by_size: list[Optional[RangeEntry]] = [None] * (max_num_tokens + 1)
        for e in sorted(entries, key=lambda e: e.compile_range.is_single_size):
            r = e.compile_range
            for n in range(r.start, min(r.end, max_num_tokens) + 1):
                by_size[n] = e
        missing = [n for n in range(1, max_num_tokens + 1) if by_size[n] is None]
        if missing:
            raise ValueError(
                f"piece {name}: no compiled entry covers token counts "
                f"{missing[:5]}...; compile ranges must cover 1..{max_num_tokens}"
            )
        self._by_size = by_size
        self._table = [e.runnable if e else None for e in by_size]

    def entry_for(self, num_tokens: int) -> RangeEntry:
        """The entry a call with ``num_tokens`` tokens runs (exact size first, else range)."""
        self._lookup(num_tokens)
        return self._by_size[num_tokens]

    def _lookup(self, n: int) -> Callable:
        if not 0 < n <= self.max_num_tokens:
            raise ValueError(
                f"piece {self.name}: {n} tokens is outside 1..{self.max_num_tokens}"
                f" (max_num_tokens); raise max_num_tokens"
            )
        return self._table[n]

    def __call__(self, *args):
        a = args[self._arg]
        n = a if self._dim is None else a.shape[self._dim]
        if 0 < n <= self.max_num_tokens:
            return self._table[n](*args)
        return self._lookup(n)(*args)
