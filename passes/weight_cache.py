"""A derived copy of a weight (a packed layout), made once per weight and kept as long as it.

Keyed by (data_ptr, shape, dtype); remade only if the weight is modified in place (its version
counter moves).  A finalizer drops the entry with the weight, so neither a dead model's copy is
kept alive nor can another tensor reuse the address while the entry exists.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class WeightCache:
    """``cache.get(w)`` returns ``make(w)``, computed on first use per weight."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._make = make
        self._entries: dict[tuple, tuple[torch.Tensor, int]] = {}

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), tuple(w.shape), w.dtype)
        entry = self._entries.get(key)
        if entry is None or entry[1] != w._version:
            if entry is None:
                weakref.finalize(w, self._entries.pop, key, None)
            entry = (self._make(w), w._version)
            self._entries[key] = entry
        return entry[0]

    def values(self) -> list[torch.Tensor]:
        """The cached copies."""
        return [entry[0] for entry in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
