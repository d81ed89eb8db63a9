"""This machine's matrix-multiply rate, measured: the compute floor a step with many rows per
linear divides by (the read bandwidth of :mod:`experiments.bench.bandwidth` is the floor of a
step with few).

:func:`matmul_peak` times ``torch.mm`` (oneDNN on CPU) over a few large products in the
given dtype and reports the best rate any of them reached, in GFLOP/s (``2 * M * N * K``
per product).  It is the best a tuned GEMM library reaches on this machine, not the chip's
data-sheet peak: a kernel could beat it only by being better tuned than oneDNN at its best
shape.  A step's compute floor is its matmul FLOPs divided by that rate
(:func:`matmul_flops`); a step that also must stream its weights is bound by the larger of
the two floors.  :func:`step_matmul_peak` is the rate a step in a 16-bit float dtype can count
on: the faster of ``torch.mm`` in that dtype and in float32 (a bf16 or fp16 product widened to
float32 is exact, and that is how the project's AVX2 kernels compute: on a CPU without
AVX512-BF16 or AMX torch's bf16 ``mm`` runs a reference loop, 1.3 GFLOP/s on the AVX2 EPYC of
2026-12-07, which made a floor of 317 ms for a 6.6 ms verify step; one small product screens
it out before the full run, which took minutes there).

    python -m experiments.bench.compute [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional, Sequence

import torch

from models.config import parse_dtype

SHAPES: tuple[tuple[int, int, int], ...] = (
    (256, 512, 32000),
    (512, 2048, 2048),
    (2048, 2048, 2048),
)
"""(M, K, N) of the timed products: an LM head at 256 rows and two square-ish GEMMs."""


def matmul_peak(
    dtype: str | torch.dtype = "bfloat16",
    shapes: Sequence[tuple[int, int, int]] = SHAPES,
    repeats: int = 5,
) -> dict[str, Any]:
    """``{"best_gflops", "dtype", "threads", "rows": [{"shape", "best_gflops"}...]}``: the best
    rate of ``torch.mm`` over ``shapes`` (best of ``repeats`` timed calls each, after one
    untimed)."""
    if repeats <= 0 or not shapes:
        raise ValueError(
            f"matmul_peak: repeats must be positive and shapes non-empty, got repeats="
            f"{repeats} and {len(shapes)} shapes"
        )
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    g = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in shapes:
        if min(m, k, n) <= 0:
            raise ValueError(f"matmul_peak: every dimension must be positive, got {(m, k, n)}")
        a = torch.randn(m, k, generator=g).to(dt)
        b = torch.randn(k, n, generator=g).to(dt)
        torch.mm(a, b)
        best = min(_seconds(a, b) for _ in range(repeats))
        rows.append({"shape": [m, k, n], "best_gflops": 2 * m * n * k / best / 1e9})
    return {
        "best_gflops": max(r["best_gflops"] for r in rows),
        "dtype": str(dt).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


SCREEN: tuple[int, int, int] = (128, 512, 512)
"""(M, K, N) of the one product that screens a 16-bit dtype before its full run."""
SCREEN_RATIO = 4.0
"""A 16-bit dtype whose screen runs under float32's best rate / SCREEN_RATIO is not timed
further: a reference loop (torch's bf16 ``mm`` without AVX512-BF16 or AMX: 1.3 GFLOP/s
against float32's 150-170 on the AVX2 EPYC) took minutes over :data:`SHAPES` and cannot win."""


def step_matmul_peak(
    dtype: str | torch.dtype = "bfloat16",
    shapes: Sequence[tuple[int, int, int]] = SHAPES,
    repeats: int = 5,
) -> dict[str, Any]:
    """:func:`matmul_peak` of the faster of ``dtype`` and float32 when ``dtype`` is a 16-bit
    float (its products are exact in float32), else of ``dtype``; ``"candidates"`` holds each
    dtype's best GFLOP/s and ``"dtype"`` the one that won.  float32 runs first; the 16-bit
    dtype then times :data:`SCREEN` once, and only a screen within :data:`SCREEN_RATIO` of
    float32's rate goes on to ``shapes`` (``"screened"``: the dtypes stopped at the screen)."""
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if dt not in (torch.bfloat16, torch.float16):
        peak = matmul_peak(dt, shapes=shapes, repeats=repeats)
        return {**peak, "candidates": {peak["dtype"]: peak["best_gflops"]}, "screened": []}
    fp32 = matmul_peak(torch.float32, shapes=shapes, repeats=repeats)
    half = matmul_peak(dt, shapes=(SCREEN,), repeats=1)
    screened = half["best_gflops"] * SCREEN_RATIO < fp32["best_gflops"]
    if not screened:
        half = matmul_peak(dt, shapes=shapes, repeats=repeats)
    best = max((half, fp32), key=lambda p: p["best_gflops"])
    return {
        **best,
        "candidates": {p["dtype"]: p["best_gflops"] for p in (half, fp32)},
        "screened": [half["dtype"]] if screened else [],
    }


def _seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


def matmul_flops(weight_elements: int, rows: int) -> int:
    """FLOPs of ``rows`` tokens through linears holding ``weight_elements`` weights in all (one
    multiply and one add per weight and row)."""
    return 2 * weight_elements * rows


def compute_floor_ms(flops: int, peak_gflops: float) -> float:
    """Milliseconds ``flops`` take at ``peak_gflops``."""
    if peak_gflops <= 0:
        raise ValueError(f"compute_floor_ms: peak_gflops must be positive, got {peak_gflops}")
    return flops / (peak_gflops * 1e9) * 1e3


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = matmul_peak(args.dtype, repeats=args.repeats)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
