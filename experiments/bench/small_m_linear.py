"""Microbenchmark of the small-M linear kernel against oneDNN, side by side in one process.

    python -m experiments.bench.small_m_linear [--threads 2] [--rows 1 2 4 8 16]
        [--shapes 1024x512 512x512 2816x512 512x1408 32000x512] [--rounds 7]

For each weight shape ``NxK`` (default: the default tiny model's projections and LM head,
bf16) and row count M, three implementations run round-robin, each round timing a sweep over
enough copies of the weight to exceed 96 MB (so every call streams its weight from DRAM, as a
decode step does, instead of re-reading a cached one):

* ``kernel``: :func:`passes.small_m_linear.run_packed` on the re-laid weight,
* ``mkldnn``: ``mkldnn._linear_pointwise`` on the oneDNN-packed weight (what
  ``piecewise::packed_linear`` runs above the small-M threshold),
* ``F.linear``: torch on the plain weight.

Prints the median µs per call and the weight-read rate in GB/s (median round, and the best
round: on a shared machine the best round is the one least disturbed by other jobs), and the
kernel's speed-up over oneDNN, with the machine's measured read bandwidth for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from experiments.bench.bandwidth import measure_read_bandwidth
from passes import small_m_linear as small_m
from passes.small_m_linear import isa

DEFAULT_SHAPES = ("1024x512", "512x512", "2816x512", "512x1408", "32000x512")
SWEEP_BYTES = 96 << 20


def _sweep_s(fn, xs, ws) -> float:
    t0 = time.perf_counter()
    for x, w in zip(xs, ws):
        fn(x, w)
    return (time.perf_counter() - t0) / len(ws)


def bench_shape(
    n: int, k: int, rows: list[int], rounds: int, sweep_bytes: int = SWEEP_BYTES
) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    copies = max(3, -(-sweep_bytes // (n * k * 2)))
    ws = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(copies)]
    packed = {id(w): small_m.pack(w) for w in ws}  # this benchmark's own copies, not an engine's
    onednn = {id(w): torch.ops.mkldnn._reorder_linear_weight(w) for w in ws}
    impls = {
        "kernel": lambda x, w: small_m.run_packed(x, packed[id(w)], None, n),
        "mkldnn": lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, onednn[id(w)], None, "none", [], ""
        ),
        "F.linear": lambda x, w: F.linear(x, w),
    }
    out = []
    for m in rows:
        xs = [torch.randn(m, k, generator=g).bfloat16() for _ in range(copies)]
        for fn in impls.values():  # warm-up: packing, thread pool, page faults
            _sweep_s(fn, xs, ws)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(rounds):
            for name, fn in impls.items():
                times[name].append(_sweep_s(fn, xs, ws))
        row = {"shape": f"{n}x{k}", "M": m}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[name] = (t * 1e6, n * k * 2 / t / 1e9, n * k * 2 / min(ts) / 1e9)
        out.append(row)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--sweep-mb", type=int, default=SWEEP_BYTES >> 20, help="weight copies per timed sweep"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bw = measure_read_bandwidth()
    print(
        f"threads {args.threads}, kernel ISA {isa()}, measured read bandwidth "
        f"{bw / 1e9:.1f} GB/s, median of {args.rounds} round-robin rounds (bf16)"
    )
    print(
        f"{'shape NxK':>11} {'M':>3} | {'kernel µs':>9} {'GB/s':>5} {'best':>5} | "
        f"{'mkldnn µs':>9} {'GB/s':>5} {'best':>5} | {'F.linear µs':>11} {'GB/s':>5} "
        f"{'best':>5} | kernel vs mkldnn (median, best)"
    )
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for r in bench_shape(n, k, args.rows, args.rounds, args.sweep_mb << 20):
            rows.append(r)
            (kt, kb, kx), (mt, mb, mx), (ft, fb, fx) = r["kernel"], r["mkldnn"], r["F.linear"]
            print(
                f"{r['shape']:>11} {r['M']:>3} | {kt:9.1f} {kb:5.1f} {kx:5.1f} | "
                f"{mt:9.1f} {mb:5.1f} {mx:5.1f} | {ft:11.1f} {fb:5.1f} {fx:5.1f} | "
                f"{mt / kt:.2f}x, {kx / mx:.2f}x"
            )
    return rows


if __name__ == "__main__":
    main()
