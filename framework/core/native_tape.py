"""The native calls of one forward, collected in order while it runs: what a whole-forward
replay (``backends/piecewise/forward_replay.py``) is made of.

A forward that runs with a :class:`NativeTapeSink` on its context
(:attr:`framework.core.forward_context.ForwardContext.native_tape`) asks every part that
runs native code -- each lean piece's replay (``backends/piecewise/replay.py``), the fused
CPU attention (``backends/attention/cpu_paged.py``) -- to *report*: either the native calls
it made, each a C function's address and its arguments as 64-bit words, with the object that
keeps their buffers alive, or why it cannot (:meth:`NativeTapeSink.refuse`).  The sink only
collects; the caller that set it decides whether the reports cover the whole forward (every
part reported, none refused) and only then replays them.
"""

from __future__ import annotations

from typing import Any, Optional

NativeCall = tuple[int, int, list[int], str]
"""``(function address, kind, argument words, label)``; kind 0: the function returns nothing,
1: it returns an int, nonzero on error."""


def native_call(recorded: list[int], label: str) -> NativeCall:
    """A recording kernel's ``[address, kind, word...]`` (``framework.core.ops
    set_direct_recorder``) as a :data:`NativeCall` named ``label``."""
    return (recorded[0], recorded[1], list(recorded[2:]), label)


class NativeTapeSink:
    """Reports of the parts of one forward, in the order they ran."""

    __slots__ = ("calls", "parts", "reports", "refusal")

    def __init__(self) -> None:
        self.calls: list[NativeCall] = []
        self.parts: list[Any] = []
        """What keeps the reported calls' buffers alive (a piece's tape, ...)."""
        self.reports = 0
        """Parts that reported, refusals included."""
        self.refusal: Optional[str] = None
        """The first part's reason it could not report its calls (None: none refused)."""

    def add(self, calls: list[NativeCall], part: Any) -> None:
        """A part ran ``calls``; ``part`` keeps their buffers alive."""
        self.calls.extend(calls)
        if part is not None:
            self.parts.append(part)
        self.reports += 1

    def refuse(self, why: str) -> None:
        """A part ran but cannot say which native calls it made."""
        self.reports += 1
        if self.refusal is None:
            self.refusal = why


__all__ = ["NativeCall", "NativeTapeSink", "native_call"]
