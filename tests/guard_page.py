"""A tensor whose last byte is the last readable byte before an unmapped page: a kernel that
reads past the end of its operand faults (the test process dies) instead of reading whatever
follows in the heap.  Linux (``mprotect`` through libc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

PROT_NONE = 0


def before_guard_page(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``t`` ending exactly where a ``PROT_NONE`` page begins (its start is
    64-byte aligned when ``t``'s size in bytes is a multiple of 64).  The copy keeps the
    mapping alive (``torch.frombuffer`` holds a reference to it)."""
    raw = t.contiguous().view(-1).view(torch.uint8)
    size, page = raw.numel(), mmap.PAGESIZE
    pages = -(-size // page)
    region = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mprotect(ctypes.c_void_p(base + pages * page), page, PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")
    offset = pages * page - size
    out = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
    out.copy_(raw)
    assert out.data_ptr() + size == base + pages * page  # the next byte is the guard page's
    return out.view(t.dtype).view(t.shape)
