"""This machine's memory read bandwidth, measured: the floor every roofline row divides by.

A reduction (``sum``) over a buffer well past the last-level cache streams it from DRAM once;
the median over a few repetitions (after a warm-up) at the current ``torch.get_num_threads()``
is the achievable read rate for torch's own kernels on this machine.
"""

from __future__ import annotations

import statistics
import time

import torch


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
