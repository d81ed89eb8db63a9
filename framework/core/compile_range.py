"""The token range a piece is compiled for: the backend builds them, passes read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class CompileRange:
    """Inclusive token range ``[start, end]``; ``start == end`` is a single concrete size.

    The backend compiles every piece once per range: ``[1, e0], [e0+1, e1], ...`` up to
    ``max_num_tokens`` from ``compile_ranges_endpoints`` (general code, symbolic token count),
    plus one single-size range per ``compile_sizes`` entry (concrete shapes; it wins over the
    range holding it at dispatch).  A pass sees the range it is compiled for through
    ``GraphPass.is_applicable(compile_range)``: ``start``/``end`` are inclusive token counts,
    ``is_single_size`` tells a concrete-shape compile, and ``n in compile_range`` tests a size.
    """

    start: int
    end: int

    @property
    def is_single_size(self) -> bool:
        return self.start == self.end

    def __contains__(self, n: int) -> bool:
        return self.start <= n <= self.end

    def __str__(self) -> str:
        """``range_<start>-<end>``, the one name of a range everywhere: cache entry keys,
        debug-dump folders, pass statistics (``range_4-4`` is the single size 4)."""
        return range_name(self.start, self.end)


def range_name(start: int, end: int) -> str:
    """The name of the token range ``[start, end]`` (see :meth:`CompileRange.__str__`)."""
    return f"range_{start}-{end}"
