"""Typed, per-instance engine statistics: what one ``LLM``'s construction took.

Each ``LLM`` owns its own :class:`StartupStats`; capture counts come from the engine's own
CUDA-graph wrappers (:meth:`framework.cudagraph.setup.GraphSetup.stats`), never from a
process-wide sum, so a second engine in one process reports its own captures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class StartupStats:
    load_s: float = 0.0
    """Construction up to the warm-up forward: weights, KV cache, graph set-up, and on a warm
    start the artifact restore (``warm_restore_s`` in the stats is part of it)."""
    compile_s: Optional[float] = None
    """The warm-up forward that traces/compiles (None at level 0: nothing compiles)."""
    captures: int = 0
    """CUDA graphs this engine captured at start-up."""
    capture_time_s: float = 0.0
    startup_s: float = 0.0
    """The whole construction."""

    def as_dict(self) -> dict[str, float]:
        """The keys ``LLM.stats`` has always reported (``compile_s`` only when it ran)."""
        out: dict[str, float] = {"load_s": self.load_s}
        if self.compile_s is not None:
            out["compile_s"] = self.compile_s
        out["captures"] = self.captures
        out["capture_time_s"] = self.capture_time_s
        out["startup_s"] = self.startup_s
        return out
