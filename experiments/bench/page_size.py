"""Does the page size of the packed weights change a decode step's streaming rate?

    python -m experiments.bench.page_size [--layers 22] [--steps 20] [--threads 2]

The project's bf16 decode at batch 1 is the small-M kernel (``passes.small_m_linear``)
streaming each linear's packed weight once.  The weights are torch tensors, so they land in
whatever pages the allocator got: on Linux with transparent huge pages in ``madvise`` mode
(the default of many distributions, and of this project's machines) that is 4 KB pages, and
which physical pages a fresh process gets differs from process to process.

This benchmark builds the 1.1B TinyLlama shape's linears (per layer: qkv 2560x2048, o
2048x2048, gate_up 11264x2048, down 2048x5632; plus the LM head 32000x2048; seeded random
bf16) twice, in the kernel's packed layout: once in memory advised ``MADV_HUGEPAGE`` (2 MB
pages) and once ``MADV_NOHUGEPAGE`` (4 KB pages), checks from ``/proc/self/smaps`` how much
of each really is in huge pages, then times "steps" -- every linear once at one row, as a
decode step runs them -- alternating the two copies step by step in one process, so both see
the same machine.  It prints the median step of each, the ratio, and the streaming rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

import torch

from framework.core import huge_pages as hp

SHAPES_1P1B = (
    ("qkv", 2560, 2048),
    ("o", 2048, 2048),
    ("gate_up", 11264, 2048),
    ("down", 2048, 5632),
)


def arena(nbytes: int, huge: bool) -> torch.Tensor:
    """``nbytes`` of untouched memory in a mapping of its own, 2 MB aligned, advised huge or
    not before first touch (:func:`framework.core.huge_pages.fresh_mapping`)."""
    return hp.fresh_mapping(nbytes, huge)


def huge_bytes_in(t: torch.Tensor) -> int:
    """Bytes of the mapping holding ``t`` that /proc/self/smaps reports as AnonHugePages."""
    return hp.page_backing(t).anon_huge


def build(layers: int, huge: bool, seed: int = 0) -> tuple[list[tuple[torch.Tensor, int]], dict]:
    from passes import small_m_linear as sm

    shapes = [s for _ in range(layers) for s in SHAPES_1P1B] + [("lm_head", 32000, 2048)]
    sizes = [int(torch.Size(sm.panel_shape(n, k)).numel()) * 2 for _, n, k in shapes]
    mem = arena(sum(s + 64 for s in sizes), huge)
    gen = torch.Generator().manual_seed(seed)
    out, off = [], 0
    for (_, n, k), size in zip(shapes, sizes):
        packed = sm.pack(0.02 * torch.randn(n, k, generator=gen).to(torch.bfloat16))
        dst = mem[off : off + size].view(torch.bfloat16).view(packed.shape)
        dst.copy_(packed)
        out.append((dst, n))
        off += size + 64
    info = {"bytes": sum(sizes), "huge_bytes": huge_bytes_in(mem), "advised_huge": huge}
    return out, info


def step(weights: list[tuple[torch.Tensor, int]], xs: dict[int, torch.Tensor]) -> float:
    from passes import small_m_linear as sm

    t0 = time.perf_counter()
    for w, n in weights:
        k = w.shape[1] * 2
        sm.run_packed(xs[k], w, None, n)
    return time.perf_counter() - t0


def run(layers: int, steps: int, threads: Optional[int]) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    copies = {}
    for huge in (True, False):
        copies["2mb" if huge else "4kb"] = build(layers, huge)
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in (2048, 5632)}
    times: dict[str, list[float]] = {name: [] for name in copies}
    for name in copies:  # warm-up
        step(copies[name][0], xs)
    for i in range(steps):
        order = list(copies) if i % 2 == 0 else list(copies)[::-1]
        for name in order:
            times[name].append(step(copies[name][0], xs))
    res: dict[str, Any] = {"layers": layers, "steps": steps, "threads": torch.get_num_threads()}
    for name, (_, info) in copies.items():
        med = statistics.median(times[name])
        res[name] = dict(
            info,
            median_ms=med * 1e3,
            min_ms=min(times[name]) * 1e3,
            gb_s=info["bytes"] / med / 1e9,
            all_ms=[t * 1e3 for t in times[name]],
        )
    res["ratio_4kb_over_2mb"] = res["4kb"]["median_ms"] / res["2mb"]["median_ms"]
    return res


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.layers <= 0 or args.steps <= 0:
        p.error("--layers and --steps must be positive")
    res = run(args.layers, args.steps, args.threads)
    for name in ("2mb", "4kb"):
        r = res[name]
        print(
            f"{name}: {r['bytes'] / 1e9:.2f} GB, {r['huge_bytes'] / 1e9:.2f} GB in huge pages; "
            f"step median {r['median_ms']:.2f} ms (min {r['min_ms']:.2f}), {r['gb_s']:.1f} GB/s"
        )
    print(f"4 KB / 2 MB step time: {res['ratio_4kb_over_2mb']:.3f} ({res['threads']} threads)")
    return res


if __name__ == "__main__":
    main()
