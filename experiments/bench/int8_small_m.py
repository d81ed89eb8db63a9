"""Microbenchmark of the small-M int8 kernels against the bf16 kernel and ``torch._int_mm``, side
by side in one process, on the 1.1B (TinyLlama) shapes.

    python -m experiments.bench.int8_small_m [--threads 2] [--rows 1 4 16]
        [--shapes 2560x2048 2048x2048 11264x2048 2048x5632 256x2048] [--rounds 5]

For each weight shape ``NxK`` (default: the merged qkv, o, merged gate/up, down and one k/v
projection of the 1.1B shape) and row count M, the implementations run round-robin, each
round timing a sweep over enough weight copies to exceed 96 MB (every call streams its weight
from DRAM, as a decode step does).  All are the ops a graph calls (C++ kernels loaded):

* ``int8``: ``piecewise::int8_packed_linear`` (W8A8, activations quantised in the kernel),
* ``int8 wo``: ``piecewise::int8_wo_packed_linear`` (weight-only int8),
* ``bf16``: ``piecewise::packed_linear`` (the bf16 small-M kernel),
* ``_int_mm``: the unpacked ``int8_per_token`` path (``dynamic_per_token_quant`` +
  ``int8_scaled_mm``, i.e. ``torch._int_mm``).

Prints the median µs per call and the rate at which each reads *its own* weight bytes (GB/s:
N*K for int8, 2*N*K for bf16; median round and best round -- on a shared machine the best
round is the one least disturbed by other jobs), and int8's speed-up over bf16 and over
``_int_mm`` (medians).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DEFAULT_SHAPES = ("2560x2048", "2048x2048", "11264x2048", "2048x5632", "256x2048")
SWEEP_BYTES = 96 << 20


def _sweep_s(fn, xs, ws) -> float:
    t0 = time.perf_counter()
    for x, w in zip(xs, ws):
        fn(x, w)
    return (time.perf_counter() - t0) / len(ws)


def bench_shape(n: int, k: int, rows: list[int], rounds: int, sweep_bytes: int) -> list[dict]:
    from framework.core.quantization import QuantizationConfig
    from passes import int8_small_m as i8
    from passes import small_m_linear as small_m
    from passes.quant_schemes import quantize_weight

    ops = torch.ops.piecewise
    spec = QuantizationConfig.parse("int8_per_token").spec_for("layer")
    g = torch.Generator().manual_seed(0)
    copies = max(3, -(-sweep_bytes // (n * k)))
    ws = list(range(copies))
    plain, q = [], []
    for _ in ws:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        w_q, scale = quantize_weight(w, spec.weight)
        s = scale.reshape(-1).contiguous()
        plain.append(small_m.pack(w))
        q.append((w_q, scale, i8.pack(w_q), s, i8.compensation(w_q)))
        del w
    big = 1 << 30

    def int8(x, i):
        _, _, w8, s, comp = q[i]
        return ops.int8_packed_linear(x, w8, s, comp, None, n, k, big)

    def wo(x, i):
        _, _, w8, s, _ = q[i]
        return ops.int8_wo_packed_linear(x, w8, s, None, n, k, big)

    def bf16(x, i):
        return ops.packed_linear(x, plain[i], None, None, n, k, big)

    def int_mm(x, i):
        w_q, scale, _, _, _ = q[i]
        x_q = torch.empty(x.shape, dtype=torch.int8)
        sx = torch.empty((x.shape[0], 1), dtype=torch.float32)
        ops.dynamic_per_token_quant(x_q, x, sx)
        return ops.int8_scaled_mm(x_q, sx, w_q.t(), scale, None, x.dtype)

    impls = {"int8": (int8, 1), "int8 wo": (wo, 1), "bf16": (bf16, 2), "_int_mm": (int_mm, 1)}
    out = []
    for m in rows:
        xs = [torch.randn(m, k, generator=g).bfloat16() for _ in ws]
        for fn, _ in impls.values():  # warm-up: thread pool, page faults
            _sweep_s(fn, xs, ws)
        times: dict[str, list[float]] = {name: [] for name in impls}
        names = list(impls)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(_sweep_s(impls[name][0], xs, ws))
        row = {"shape": f"{n}x{k}", "M": m}
        for name, ts in times.items():
            t = statistics.median(ts)
            nbytes = impls[name][1] * n * k
            row[name] = (t * 1e6, nbytes / t / 1e9, nbytes / min(ts) / 1e9)
        out.append(row)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep-mb", type=int, default=SWEEP_BYTES >> 20)
    args = ap.parse_args(argv)
    from passes import native_ops

    if not native_ops.load():
        raise SystemExit("the C++ op library does not build here")
    torch.set_num_threads(args.threads)
    print(
        f"# threads {args.threads}, kernels {native_ops.isa()}, median of {args.rounds} "
        f"round-robin rounds; GB/s of each variant's own weight bytes"
    )
    print(
        "| shape NxK | M | int8 µs | GB/s (best) | int8 wo µs | GB/s (best) | bf16 µs | "
        "GB/s (best) | _int_mm µs | GB/s (best) | int8 vs bf16 | int8 vs _int_mm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for r in bench_shape(n, k, args.rows, args.rounds, args.sweep_mb << 20):
            rows.append(r)
            cells = " | ".join(
                f"{r[v][0]:.1f} | {r[v][1]:.1f} ({r[v][2]:.1f})"
                for v in ("int8", "int8 wo", "bf16", "_int_mm")
            )
            print(
                f"| {r['shape']} | {r['M']} | {cells} | {r['bf16'][0] / r['int8'][0]:.2f}x | "
                f"{r['_int_mm'][0] / r['int8'][0]:.2f}x |"
            )
    return rows


if __name__ == "__main__":
    main()
