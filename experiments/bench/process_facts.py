"""What a benchmark process can say of itself and of the machine while it ran, from ``/proc``
and ``mincore(2)``: its resident and peak memory, the backing of that memory, the CPU time the
machine spent elsewhere (other processes, the hypervisor's steal), and how much of its weight
files the page cache held before it loaded them.  Standard library only (the page-cache
fraction imports the torch-free :mod:`framework.core.page_cache`), so a worker that must not
import torch (``experiments.bench.peer_worker``'s llama.cpp and CTranslate2 contenders) can
use all of it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def proc_status() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def smaps_rollup() -> dict[str, int]:
    """Bytes of this process's memory by backing (``AnonHugePages``: anonymous THP;
    ``FilePmdMapped``: file pages mapped as 2 MB; ``Anonymous``, ``Rss``)."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            key, _, value = line.partition(":")
            parts = value.split()
            if key in ("Rss", "Anonymous", "AnonHugePages", "FilePmdMapped", "Shared_Hugetlb"):
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def cpu_times() -> list[int]:
    """The machine's ``cpu`` line of ``/proc/stat`` (user nice system idle iowait irq softirq
    steal ...), in clock ticks."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def self_ticks() -> int:
    """This process's user + system CPU time, in clock ticks."""
    try:
        f = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except (OSError, ValueError, IndexError):
        return 0


def load_report(before: tuple[list[int], int, float], after: tuple[list[int], int, float]):
    """Of the machine's CPU time while this process ran: the share this process used, the
    share other processes used, the hypervisor's steal (all as fractions of the CPUs' time)."""
    (c0, s0, t0), (c1, s1, t1) = before, after
    if not c0 or not c1:
        return {}
    d = [b - a for a, b in zip(c0, c1)]
    total = sum(d[:8]) or 1
    busy = total - d[3] - d[4]  # minus idle and iowait
    steal = d[7] if len(d) > 7 else 0
    mine = s1 - s0
    return {
        "wall_s": t1 - t0,
        "self_frac": mine / total,
        "others_frac": max(0, busy - steal - mine) / total,
        "steal_frac": steal / total,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]
        if Path("/proc/loadavg").exists()
        else [],
    }


def snapshot() -> tuple[list[int], int, float]:
    return cpu_times(), self_ticks(), time.perf_counter()


def page_cache_report(files: list[Path]) -> dict[str, Any]:
    """What the page cache held of each file before the load (fraction of its pages) and of
    all of them (by bytes): a contender that finds its weights on disk, not in memory, starts
    (or, mapping lazily, runs its first tokens) at the disk's speed."""
    from framework.core.page_cache import file_resident_fraction

    out: dict[str, Any] = {"files": {}}
    held = total = 0
    for f in files:
        frac = file_resident_fraction(f)
        out["files"][f.name] = frac
        if frac is not None:
            size = f.stat().st_size
            held, total = held + frac * size, total + size
    out["fraction"] = held / total if total else None
    return out
