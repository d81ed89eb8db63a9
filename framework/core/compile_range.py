"""The token range a piece is compiled for: the backend builds them, passes read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class CompileRange:
    """Inclusive token range ``[start, end]``; ``start == end`` is a single concrete size."""

    start: int
    end: int

    @property
    def is_single_size(self) -> bool:
        return self.start == self.end

    def __contains__(self, n: int) -> bool:
        return self.start <= n <= self.end

    def __str__(self) -> str:
        return f"size_{self.start}" if self.is_single_size else f"range_{self.start}_{self.end}"
