"""Whether a tensor's bytes are a memory map of a given file (``/proc/self/maps``)."""

from __future__ import annotations

from pathlib import Path

import torch


def file_backed(t: torch.Tensor, path: str | Path) -> bool:
    """Whether ``t``'s first byte lies in a mapping of ``path``."""
    return address_mapped(t.data_ptr(), path)


def address_mapped(ptr: int, path: str | Path) -> bool:
    """Whether address ``ptr`` lies in a mapping of ``path``."""
    path = str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].strip() != path:
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False
