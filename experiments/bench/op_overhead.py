"""Fixed cost per call of the piecewise linear ops: the Python op body + ctypes against the
C++ op kernel (passes/native_ops.py), on a tiny linear where the arithmetic is negligible.

    python -m experiments.bench.op_overhead [--shape 64x64] [--rows 1] [--calls 2000]
        [--rounds 9] [--threads 2]

Variants, alternated round-robin in one process (the first rotating), each round timing
``--calls`` back-to-back calls; the table gives the median µs per call over the rounds and
the spread (min-max of the rounds):

* ``bf16 python``: ``piecewise::packed_linear_python`` -- the op's Python body calling the
  small-M kernel through ctypes (what ``packed_linear`` ran before the C++ kernels);
* ``bf16 C++``: ``piecewise::packed_linear`` with the C++ CPU kernel;
* ``int8 python`` / ``int8 C++``: ``int8_packed_linear_python`` / ``int8_packed_linear``;
* ``int8 _int_mm ops``: the unpacked ``int8_per_token`` path (``dynamic_per_token_quant`` +
  ``int8_scaled_mm`` ops), what an int8 linear ran before the int8 kernel;
* ``bf16 C++ direct`` / ``int8 C++ direct``: the same C++ kernels called as functions of the
  op library's Python module (``framework.core.ops.direct_call``: what a lean piece calls),
  where the library was built with one;
* ``ctypes only``: :func:`passes.small_m_linear.run_packed` called directly (no op dispatch);
* ``aten.add``: one small torch op, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def variants(n: int, k: int, m: int) -> dict:
    from passes import int8_small_m as i8
    from passes import native_ops
    from passes import small_m_linear as small_m
    from passes.quant_schemes import quantize_weight

    if not native_ops.load():
        raise SystemExit("the C++ op library does not build here")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = small_m.pack(w)
    from framework.core.ops import direct_call
    from framework.core.quantization import QuantizationConfig

    spec = QuantizationConfig.parse("int8_per_token").spec_for("layer")
    w_q, scale = quantize_weight(w, spec.weight)
    w8, s8, comp = i8.pack(w_q), scale.reshape(-1).contiguous(), i8.compensation(w_q)
    ops = torch.ops.piecewise
    rows = small_m.DEFAULT_MAX_ROWS

    def old_int8():
        x_q = torch.empty(x.shape, dtype=torch.int8)
        s = torch.empty((m, 1), dtype=torch.float32)
        ops.dynamic_per_token_quant(x_q, x, s)
        return ops.int8_scaled_mm(x_q, s, w_q.t(), scale, None, x.dtype)

    out = {
        "bf16 python": lambda: ops.packed_linear_python(x, packed, None, None, n, k, rows),
        "bf16 C++": lambda: ops.packed_linear(x, packed, None, None, n, k, rows),
        "int8 python": lambda: ops.int8_packed_linear_python(x, w8, s8, comp, None, n, k, rows),
        "int8 C++": lambda: ops.int8_packed_linear(x, w8, s8, comp, None, n, k, rows),
        "int8 _int_mm ops": old_int8,
        "ctypes only": lambda: small_m.run_packed(x, packed, None, n),
        "aten.add": lambda: torch.add(x, x),
    }
    bf16, int8 = (
        direct_call("piecewise::packed_linear"),
        direct_call("piecewise::int8_packed_linear"),
    )
    if bf16 is not None and int8 is not None:  # the library's Python module (Python headers)
        out["bf16 C++ direct"] = lambda: bf16(x, packed, None, None, n, k, rows)
        out["int8 C++ direct"] = lambda: int8(x, w8, s8, comp, None, n, k, rows)
    return out


def run(n: int, k: int, m: int, calls: int, rounds: int) -> dict[str, list[float]]:
    impls = variants(n, k, m)
    names = list(impls)
    for fn in impls.values():  # warm-up: first calls, thread pool
        for _ in range(100):
            fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = impls[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="64x64", help="NxK of the weight")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.lower().split("x"))
    times = run(n, k, args.rows, args.calls, args.rounds)
    print(
        f"# {n}x{k} bf16 weight, {args.rows} row(s), {args.threads} threads, {args.calls} calls "
        f"per round, median of {args.rounds} alternated rounds"
    )
    print("| variant | µs / call | rounds min-max |")
    print("|---|---|---|")
    med = {}
    for name, ts in times.items():
        med[name] = statistics.median(ts)
        print(f"| {name} | {med[name]:.2f} | {min(ts):.2f}-{max(ts):.2f} |")
    print(
        f"# C++ op saves {med['bf16 python'] - med['bf16 C++']:.2f} µs per bf16 call, "
        f"{med['int8 python'] - med['int8 C++']:.2f} µs per int8 call; the int8 kernel op vs "
        f"the unpacked int8 ops: {med['int8 _int_mm ops'] / med['int8 C++']:.1f}x"
    )
    if "bf16 C++ direct" in med:
        print(
            f"# a direct call saves {med['bf16 C++'] - med['bf16 C++ direct']:.2f} µs per bf16 "
            f"call, {med['int8 C++'] - med['int8 C++ direct']:.2f} µs per int8 call"
        )
    return med


if __name__ == "__main__":
    main()
