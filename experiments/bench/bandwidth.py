"""This machine's memory read bandwidth, measured: the floor every roofline row divides by.

Two probes:

:func:`probe_read_bandwidth` (the floor of ``profile_step`` and the benchmarks' streaming
floors): a native read kernel, ``csrc/read_bandwidth.cpp``, built per machine by
:class:`framework.core.native_build.NativeLibrary`.  How it reads: a buffer well past the
last-level cache (default 1 GiB) is mmap'ed and first touched by the threads that read it,
in transparent huge pages (``MADV_HUGEPAGE``) and, as a second case, in 4 KB pages
(``MADV_NOHUGEPAGE``); ``threads`` OpenMP threads (default ``torch.get_num_threads()``), each
pinned to one allowed CPU for the call, read their contiguous share as 4 independent streams
with 2 accumulators each, 64-byte AVX-512 loads; three methods: plain loads, plain loads plus a
software prefetch 1 KB ahead per stream, and non-temporal (``vmovntdqa``) loads.  Best of
``repeats`` repetitions per (method, page size); the probe's figure is the best of them all.
The sum of the buffer's words comes back and is checked, so every byte was read.

:func:`measure_read_bandwidth`: ``torch.sum`` over a 256 MB float32 buffer (median): the read
rate torch's own reduction kernels reach, used where a row compares a torch kernel with torch
(``bench_attention``'s KV read rate).  It under-measures the machine: the native probe is
the floor.

    python -m experiments.bench.bandwidth [--megabytes 1024] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from framework.core.native_build import KernelBuildError, NativeLibrary, compiler

METHODS = ("plain", "prefetch", "stream")
"""The kernel's read methods, in its numbering."""


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.piecewise_read_bandwidth.argtypes = [i64, i32, i32, i32, i32, p, p, p]
    lib.piecewise_read_bandwidth.restype = ctypes.c_int
    lib.piecewise_read_bandwidth_isa.restype = ctypes.c_char_p
    lib.piecewise_read_buffers.argtypes = [p, p, i32, i32, i32, i32, p, p]
    lib.piecewise_read_buffers.restype = ctypes.c_int


LIBRARY = NativeLibrary(
    "read_bandwidth",
    Path(__file__).resolve().parent / "csrc" / "read_bandwidth.cpp",
    portable_env="PIECEWISE_READ_BANDWIDTH_PORTABLE",
    declare=_declare,
)


@functools.lru_cache(maxsize=None)
def probe_available() -> bool:
    """The native probe builds on this machine."""
    if compiler() is None:
        return False
    try:
        LIBRARY.load()
    except KernelBuildError:
        return False
    return True


def read_once(
    nbytes: int, *, threads: int, repeats: int, method: str = "plain", huge_pages: bool = True
) -> dict[str, Any]:
    """One (method, page size) case of the native probe: seconds per repetition, checked sum."""
    if method not in METHODS:
        raise ValueError(f"read_once: method must be one of {METHODS}, got {method!r}")
    if nbytes <= 0 or threads <= 0 or repeats <= 0:
        raise ValueError(
            f"read_once: nbytes, threads and repeats must be positive, got {nbytes}, "
            f"{threads}, {repeats}"
        )
    lib = LIBRARY.load()
    seconds = (ctypes.c_double * repeats)()
    total, used = ctypes.c_uint64(), ctypes.c_int64()
    rc = lib.piecewise_read_bandwidth(
        nbytes,
        threads,
        repeats,
        METHODS.index(method),
        int(huge_pages),
        ctypes.cast(seconds, ctypes.c_void_p),
        ctypes.cast(ctypes.pointer(total), ctypes.c_void_p),
        ctypes.cast(ctypes.pointer(used), ctypes.c_void_p),
    )
    if rc:
        raise RuntimeError(
            f"read_bandwidth kernel failed ({rc}) for {nbytes} bytes, {threads} threads"
        )
    words = used.value // 8
    expected = (words * (words - 1) // 2) % (1 << 64)
    if total.value != expected:
        raise RuntimeError(
            f"read_bandwidth: the kernel's sum {total.value} differs from the buffer's "
            f"{expected}: not every byte was read"
        )
    times = list(seconds)
    return {
        "method": method,
        "huge_pages": huge_pages,
        "threads": threads,
        "bytes": used.value,
        "seconds": times,
        "best_gb_s": used.value / min(times) / 1e9,
        "median_gb_s": used.value / statistics.median(times) / 1e9,
    }


def read_tensors(
    tensors: list[torch.Tensor],
    *,
    threads: Optional[int] = None,
    repeats: int = 5,
    method: str = "prefetch",
) -> dict[str, Any]:
    """Stream existing CPU tensors' storages where they lie (e.g. a model's weights, in the
    pages they were given) with the probe's kernel: how fast this process can read them."""
    if method not in METHODS:
        raise ValueError(f"read_tensors: method must be one of {METHODS}, got {method!r}")
    storages = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's) have none
            continue
        if st.nbytes() and t.device.type == "cpu":
            storages[st.data_ptr()] = st.nbytes()
    if not storages:
        raise ValueError("read_tensors: no CPU tensor with bytes")
    threads = threads or torch.get_num_threads()
    n = len(storages)
    ptrs = (ctypes.c_void_p * n)(*storages.keys())
    lens = (ctypes.c_int64 * n)(*storages.values())
    seconds = (ctypes.c_double * repeats)()
    total = ctypes.c_uint64()
    rc = LIBRARY.load().piecewise_read_buffers(
        ctypes.cast(ptrs, ctypes.c_void_p),
        ctypes.cast(lens, ctypes.c_void_p),
        n,
        threads,
        repeats,
        METHODS.index(method),
        ctypes.cast(seconds, ctypes.c_void_p),
        ctypes.cast(ctypes.pointer(total), ctypes.c_void_p),
    )
    if rc:
        raise RuntimeError(f"read_buffers kernel failed ({rc})")
    nbytes = sum(storages.values())
    times = list(seconds)
    return {
        "method": method,
        "threads": threads,
        "bytes": nbytes,
        "buffers": n,
        "sum": total.value,
        "seconds": times,
        "best_gb_s": nbytes / min(times) / 1e9,
        "median_gb_s": nbytes / statistics.median(times) / 1e9,
    }


def probe_read_bandwidth(
    megabytes: int = 1024,
    repeats: int = 7,
    threads: Optional[int] = None,
    methods: tuple[str, ...] = METHODS,
    huge_pages: tuple[bool, ...] = (True, False),
) -> dict[str, Any]:
    """Every (method, page size) case of the native probe; ``best_gb_s`` the best of them.
    Raises :class:`KernelBuildError` when the kernel cannot be built."""
    threads = threads or torch.get_num_threads()
    rows = [
        read_once(megabytes << 20, threads=threads, repeats=repeats, method=m, huge_pages=h)
        for h in huge_pages
        for m in methods
    ]
    best = max(rows, key=lambda r: r["best_gb_s"])
    return {
        "isa": LIBRARY.load().piecewise_read_bandwidth_isa().decode(),
        "threads": threads,
        "megabytes": megabytes,
        "repeats": repeats,
        "rows": rows,
        "best_gb_s": best["best_gb_s"],
        "best_case": f"{best['method']}, {'2 MB' if best['huge_pages'] else '4 KB'} pages",
    }


def measure_read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second read by ``torch.sum`` over a ``megabytes`` float32 buffer (median)."""
    if megabytes <= 0 or repeats <= 0:
        raise ValueError(
            f"measure_read_bandwidth: megabytes and repeats must be positive, "
            f"got {megabytes} and {repeats}"
        )
    buf = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()  # warm-up: page faults, thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times)


def floor_bandwidth(megabytes: int = 1024, repeats: int = 7) -> tuple[float, dict[str, Any]]:
    """(bytes per second, how it was measured): the native probe's best, or ``torch.sum``'s
    median where the probe cannot be built (said in the second value)."""
    if probe_available():
        probe = probe_read_bandwidth(megabytes, repeats)
        return probe["best_gb_s"] * 1e9, {"probe": "native", **probe}
    bw = measure_read_bandwidth(min(megabytes, 256), repeats)
    return bw, {"probe": "torch.sum (native probe unavailable)", "best_gb_s": bw / 1e9}


def format_probe(probe: dict[str, Any]) -> str:
    lines = [
        f"read bandwidth probe ({probe.get('isa', '-')}, {probe['threads']} threads, "
        f"{probe['megabytes']} MB buffer, best of {probe['repeats']})",
        "| method | pages | best GB/s | median GB/s |",
        "|---|---|---|---|",
    ]
    for r in probe["rows"]:
        pages = "2 MB (THP)" if r["huge_pages"] else "4 KB"
        lines.append(f"| {r['method']} | {pages} | {r['best_gb_s']:.1f} | {r['median_gb_s']:.1f} |")
    lines.append(f"best: {probe['best_gb_s']:.1f} GB/s ({probe['best_case']})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, help="default: torch.get_num_threads()")
    p.add_argument("--torch-sum", action="store_true", help="also time torch.sum (256 MB)")
    args = p.parse_args(argv)
    probe = probe_read_bandwidth(args.megabytes, args.repeats, args.threads)
    print(format_probe(probe))
    if args.torch_sum:
        if args.threads:
            torch.set_num_threads(args.threads)
        probe["torch_sum_gb_s"] = measure_read_bandwidth() / 1e9
        print(f"torch.sum (256 MB, median): {probe['torch_sum_gb_s']:.1f} GB/s")
    return probe


if __name__ == "__main__":
    main()
