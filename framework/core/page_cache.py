"""How much of a file the page cache holds right now (``mincore(2)``), read without touching it.

A warm start maps the processed weights (:mod:`framework.cache.weights`) and its warm-up
forward touches every page once.  Where the page cache still holds the file, that costs
page-table work only (the 1.1B model: about 0.7 s for the whole ``LLM(...)``); where it does
not, the warm-up reads the file from disk (2.2 GB: 1.5-2.5 s more on the VMs measured here).
What pushes a file out is not always this process's doing: another process's reads, or a
host that reclaims idle memory (the 2026-12 AMD EPYC VMs run DAMON, which pages out memory
untouched for a minute).  ``LLM.stats["weights_page_cache_frac"]`` reports the fraction found,
so a slow warm start can be told from a slow program; the peer benchmark records the same
fraction for every contender's weight files.  Where the file is not all there,
:func:`read_ahead` reads it in on a thread, front to back, while the start goes on: at the
disk's sequential rate rather than the warm-up's faults' (the 1.1B warm start from disk: median
1.98 s against 2.70 s, ``experiments/bench/results/warm_start_1.1b_read_ahead_2026-12-07.txt``).

The fractions are None where the answer is unknown (not Linux, a file that cannot be mapped,
a refused call), and the read-ahead gives up quietly: instruments and hints, never a reason
to fail a start.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Optional

PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(i & 1 for i in range(256))
"""``bytes.translate`` table: each byte of mincore's vector to its defined (lowest) bit."""


def resident_fraction(address: int, length: int) -> Optional[float]:
    """The fraction of the pages of ``[address, address + length)`` of this process that
    are resident (for a file mapping not yet touched: held by the page cache).  ``address``
    must be page-aligned (a mapping's start is)."""
    if not sys.platform.startswith("linux") or length <= 0 or address % PAGE:
        return None
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    fn = ctypes.CDLL(None, use_errno=True).mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    if fn(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        return None
    return bytes(vec).translate(_LOW_BIT).count(1) / pages


def file_resident_fraction(path: str | Path) -> Optional[float]:
    """The fraction of ``path``'s pages the page cache holds, from a private mapping of it
    that is never touched (no page is read; the file's access times are left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        # ACCESS_COPY (MAP_PRIVATE, writable) so ctypes can take the mapping's address;
        # nothing is written, so no page is copied.
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        os.close(fd)
        return None
    os.close(fd)
    try:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            return resident_fraction(ctypes.addressof(anchor), size)
        finally:
            del anchor  # the mapping cannot close while ctypes holds its buffer
    finally:
        m.close()


def evict(path: str | Path) -> Optional[float]:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (``fsync``, then
    ``posix_fadvise(DONTNEED)``: no privileges needed; pages some process maps stay) and
    return the fraction still held, as :func:`file_resident_fraction` does.  For measuring a
    start that finds its files on disk (``--evict`` of ``experiments.bench.warm_start`` and
    ``experiments.bench.peers``).  Some filesystems (tmpfs) hold files only in the page cache
    and keep them."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return None
    finally:
        os.close(fd)
    return file_resident_fraction(path)


def evict_tree(*paths: str | Path) -> int:
    """:func:`evict` every file under ``paths`` (files or folders; absent ones are skipped)
    and return the bytes the page cache still holds of them."""
    held = 0
    for top in map(Path, paths):
        files = [top] if top.is_file() else (f for f in top.rglob("*") if f.is_file())
        for f in files:
            if not f.is_symlink():
                held += int((evict(f) or 0.0) * f.stat().st_size)
    return held


def read_ahead(path: str | Path, chunk: int = 2 << 20) -> threading.Thread:
    """Start reading ``path`` into the page cache, front to back, on a daemon thread, and
    return it: ``posix_fadvise(WILLNEED)`` chunk by chunk (the kernel reads ahead at most
    ``max(read_ahead_kb, io_pages)`` per call, so one call for the whole file reads its first
    megabytes only).  The caller goes on; what it touches later is in memory, or in flight."""

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, chunk):
                os.posix_fadvise(fd, off, min(chunk, size - off), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name=f"read-ahead {Path(path).name}", daemon=True)
    t.start()
    return t
