"""Tensors in transparent huge pages (2 MB on x86-64): where the weights a decode step streams
live.

A batch-1 decode step reads every linear's weight once.  Torch's CPU allocator hands a large
tensor whatever pages ``malloc`` got: with transparent huge pages in ``madvise`` mode (the
default of many distributions) that is 4 KB pages, one TLB entry per 4 KB, and on a virtual
machine every TLB miss walks the guest's and the host's page tables.  Streaming the 1.1B
model's linears from 4 KB pages was 1.21x slower at 2 threads than from 2 MB pages
(``python -m experiments.bench.page_size``).

:class:`HugePageAllocator` places a tensor in memory of its own: an anonymous private mapping
(``mmap``), the tensor starting on a 2 MB boundary inside it, the whole 2 MB blocks it covers
advised ``MADV_HUGEPAGE`` *before* anything touches them (the kernel then backs each block
with one huge page at first touch) and its tail (under 2 MB) ``MADV_NOHUGEPAGE`` (so no huge
page is filled for a few bytes).  The tensor is a view of that mapping (``torch.frombuffer``):
the mapping is unmapped when the last tensor using it is freed -- nothing to release by hand.

Weights are placed in *slabs* (:meth:`HugePageAllocator.for_weights`): shared mappings of
``slab_bytes`` (a tensor larger than that gets a slab of its own size, rounded up to 2 MB),
every byte advised ``MADV_HUGEPAGE``, tensors carved from them one after another at
:data:`SLAB_ALIGN`.  A model's small weights (a 1 MB qkv, a 16 KB router) and the tails of its
large ones then lie in huge pages too, where a mapping per tensor would cost up to 2 MB each;
what a slab wastes is the unused part of its last touched huge page.  On the default tiny
model, whose qkv, o and down weights are 0.5-1.4 MB each (24 MB of its 80), moving those
into a slab made the bf16 batch-1 decode step 1.07x faster (median of per-round ratios,
``experiments/bench/results/weight_slabs_2026-12-05.md``).  A slab is unmapped when its allocator
(one per model load, dropped once the weights are placed) and the last tensor using it are
gone: a model's weights are freed together, so they share slabs; the KV caches keep a mapping
per tensor (the default allocator).

It fails closed: where huge pages cannot be had (transparent huge pages ``never``, no
``/sys/kernel/mm/transparent_hugepage``, not Linux, a refused ``mmap``) tensors go to torch's
allocator as before, and the allocator says so once, in one log line.  Tensors smaller than
``min_bytes`` (default one huge page) always do: a whole mapping would cost more than it saves.

:func:`page_backing` reports, from ``/proc/self/smaps``, how much of a tensor's range is
resident and how much of it in huge pages (anonymous ``AnonHugePages`` or file-backed
``FilePmdMapped``): what the kernel really did.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
"""The transparent huge page size this module aligns to (x86-64, and arm64 with 4 KB pages)."""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
MADV_POPULATE_READ = 22
"""Linux 5.14+: fault a range in (readable) now rather than at first touch."""
MADV_COLLAPSE = 25
"""Linux 6.1+: collapse a range into huge pages now, synchronously."""
SLAB_ALIGN = 4096
"""Where a tensor starts inside a slab: a small-page boundary (vector loads need 64 bytes)."""
WEIGHT_SLAB_BYTES = 32 << 20
"""The slab size of :meth:`HugePageAllocator.for_weights`."""


def thp_mode(path: Path = THP_ENABLED) -> Optional[str]:
    """The transparent huge page mode (``always``, ``madvise`` or ``never``: the bracketed
    word of ``path``), None where the file is absent or unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def madvise(address: int, length: int, advice: int) -> Optional[int]:
    """``madvise(2)`` on a range of this process (page-aligned ``address``); None on success,
    else the ``errno``.  No-op (``errno`` ENOSYS) off Linux."""
    if not sys.platform.startswith("linux"):
        return 38
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    if fn(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0:
        return None
    return ctypes.get_errno() or -1


@dataclass
class HugePageAllocator:
    """Places tensors in huge-page memory (see the module docstring).  One per model load: it
    counts what it placed (``huge_bytes``: tensors in advised mappings; ``plain_bytes``:
    tensors left to torch's allocator) and logs once when huge pages are unavailable.

    ``mode``: the transparent huge page mode to assume (default: read from sysfs); huge pages
    are used in ``always`` and ``madvise`` modes.  ``min_bytes``: smaller tensors stay on
    torch's allocator.  ``slab_bytes``: 0 gives every tensor a mapping of its own (2 MB
    aligned, its tail under 2 MB in small pages); above 0 tensors share slabs of that size
    (see the module docstring)."""

    mode: Optional[str] = field(default_factory=thp_mode)
    min_bytes: int = HUGE_PAGE
    slab_bytes: int = 0
    huge_bytes: int = 0
    plain_bytes: int = 0
    failures: int = 0
    slabs: int = 0
    """Slabs mapped so far."""
    _said: bool = field(default=False, repr=False, init=False)
    _free: list = field(default_factory=list, repr=False, init=False)
    """Per slab with room left: [its bytes (uint8, 2 MB aligned), the next free offset]."""

    @classmethod
    def for_weights(cls, **kw) -> "HugePageAllocator":
        """The allocator of a model's streamed weights: every tensor of a small page or more,
        in shared slabs of :data:`WEIGHT_SLAB_BYTES`."""
        kw.setdefault("min_bytes", SLAB_ALIGN)
        kw.setdefault("slab_bytes", WEIGHT_SLAB_BYTES)
        return cls(**kw)

    @property
    def enabled(self) -> bool:
        return self.mode in ("always", "madvise") and sys.platform.startswith("linux")

    def available(self) -> bool:
        """Whether huge pages can be had here (:attr:`enabled`); the first False is logged."""
        if not self.enabled:
            self._fall_back(f"transparent_hugepage is {self.mode or 'not available'}")
        return self.enabled

    def _fall_back(self, why: str) -> None:
        if not self._said:
            self._said = True
            logger.info("huge pages unavailable (%s): large weights stay in normal pages", why)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor; in huge-page memory when it is at least
        ``min_bytes`` and huge pages are available, else from torch's allocator.  Its pages
        are not touched here (the first write faults them in, as huge pages)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes >= self.min_bytes and self.available():
            t = self._carved(nbytes) if self.slab_bytes > 0 else self._mapped(nbytes)
            if t is not None:
                self.huge_bytes += nbytes
                return t.view(dtype).view(tuple(shape))
        self.plain_bytes += nbytes
        return torch.empty(tuple(shape), dtype=dtype)

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU tensor ``src`` placed as :meth:`empty` places it."""
        out = self.empty(src.shape, src.dtype)
        out.copy_(src.detach())
        return out

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in huge-page memory: a copy there when ``t`` is at least ``min_bytes`` and huge
        pages are available, else ``t`` itself (the first such refusal is logged)."""
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or not self.available():
            return t
        return self.copy(t)

    def _carved(self, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` from the first slab with room (a new slab where none has); None (one
        log line) where a new slab is refused."""
        for slab in self._free:
            start = -slab[1] % SLAB_ALIGN + slab[1]
            if start + nbytes <= slab[0].numel():
                slab[1] = start + nbytes
                return slab[0][start : start + nbytes]
        size = max(self.slab_bytes, nbytes)
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
        try:
            bytes_ = fresh_mapping(size, huge=True)
        except OSError as e:
            self.failures += 1
            self._fall_back(str(e))
            return None
        self.slabs += 1
        self._free.append([bytes_, nbytes])
        return bytes_[:nbytes]

    def _mapped(self, nbytes: int) -> Optional[torch.Tensor]:
        """:func:`fresh_mapping` of ``nbytes`` advised huge; None (one log line) where the
        mapping or the advice is refused."""
        try:
            return fresh_mapping(nbytes, huge=True)
        except OSError as e:
            self.failures += 1
            self._fall_back(str(e))
            return None


def fresh_mapping(nbytes: int, huge: bool) -> torch.Tensor:
    """``nbytes`` (uint8, untouched) starting on a huge-page boundary of an anonymous private
    mapping of their own, advised before any first touch: its whole huge pages
    ``MADV_HUGEPAGE`` and the rest ``MADV_NOHUGEPAGE`` when ``huge``, all of it
    ``MADV_NOHUGEPAGE`` otherwise.  A mapping of its own, not torch's allocator: ``malloc``
    may hand back pages an earlier tensor already faulted in, whose page size is decided.
    The mapping is unmapped with the last tensor using it.  Raises OSError naming what was
    refused (the ``mmap`` or the advice)."""
    try:
        # Private anonymous (a shared one is shmem, which follows shmem_enabled instead).
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    except (OSError, ValueError) as e:
        raise OSError(f"mmap of {nbytes + HUGE_PAGE} bytes refused: {e}") from e
    flat = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping: unmapped with it
    start = -flat.data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE if huge else 0
    if whole:
        err = madvise(flat.data_ptr() + start, whole, MADV_HUGEPAGE)
        if err is not None:
            raise OSError(f"madvise(MADV_HUGEPAGE) failed, errno {err}")
    if len(m) > start + whole:  # best effort: a tail without advice is in small pages anyway
        madvise(flat.data_ptr() + start + whole, len(m) - start - whole, MADV_NOHUGEPAGE)
    return flat[start : start + nbytes]


@dataclass
class PageBacking:
    """How a range of this process's memory is backed (bytes), from ``/proc/self/smaps``:
    ``size`` of the mappings it overlaps, ``rss`` resident, ``anon_huge`` in anonymous huge
    pages, ``file_pmd`` in file pages mapped as huge pages, ``advised`` the mappings advised
    ``MADV_HUGEPAGE`` (``hg`` in their ``VmFlags``).  smaps reports per mapping, so
    ranges are counted whole mapping by whole mapping: give tensors that own their mapping,
    or read the figures as the mappings'."""

    size: int = 0
    rss: int = 0
    anon_huge: int = 0
    file_pmd: int = 0
    mappings: int = 0
    advised: int = 0

    @property
    def huge(self) -> int:
        return self.anon_huge + self.file_pmd


def page_backing(tensors: list[torch.Tensor] | torch.Tensor) -> PageBacking:
    """The :class:`PageBacking` of the mappings that hold ``tensors``' bytes (each mapping
    once).  Empty off Linux."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()
    ]
    out = PageBacking()
    fields = {"Rss:": "rss", "AnonHugePages:": "anon_huge", "FilePmdMapped:": "file_pmd"}
    try:
        f = open("/proc/self/smaps")
    except OSError:
        return out
    with f:
        cur = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = any(a < hi and b > lo for a, b in spans)
                if cur:
                    out.size += hi - lo
                    out.mappings += 1
            elif cur and head in fields:
                name = fields[head]
                setattr(out, name, getattr(out, name) + int(line.split()[1]) * 1024)
            elif cur and head == "VmFlags:" and "hg" in line.split()[1:]:
                out.advised += 1
    return out
