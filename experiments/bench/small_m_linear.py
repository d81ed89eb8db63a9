"""Microbenchmark of the small-M linear kernels (bf16, int8 W8A8, int8 weight-only) against
the paths a layer falls back to above its ``max_rows``, side by side in one process, and the
crossover that sets ``KernelConfig.small_m_max_rows`` / ``int8_small_m_max_rows``.

    python -m experiments.bench.small_m_linear [--kernels bf16 int8] [--models tiny 1.1b]
        [--rows 1 4 8 16 24 32 40 48 64] [--rounds 5] [--threads 2] [--json out.json]
    python -m experiments.bench.small_m_linear --kernels bf16 --shapes 2816x512 --rows 1 8
    python -m experiments.bench.small_m_linear --baseline REV [--kernels bf16 int8 int8_wo]

Shapes (``NxK``, one weight per projection): ``tiny`` is the default tiny model (qkv 1024x512,
o 512x512, gate_up 2816x512, down 512x1408, LM head 32000x512), ``1.1b`` the TinyLlama 1.1B
shape (hidden 2048, intermediate 5632, 32/4 heads: qkv 2560x2048, o 2048x2048, gate_up
11264x2048, down 2048x5632, LM head 32000x2048); ``--shapes`` replaces both lists.

Per family, the variants (every one through the op a graph calls where there is one, C++
kernels loaded when they build):

* ``bf16``: ``kernel`` (``piecewise::packed_linear`` on the panel weight, max_rows unbounded),
  ``oneDNN`` (``mkldnn._linear_pointwise`` on oneDNN's packed weight: what ``packed_linear``
  runs above max_rows) and ``F.linear`` (torch on the plain weight).  Baseline: ``oneDNN``.
* ``int8`` (W8A8 dynamic per token): ``kernel`` (``piecewise::int8_packed_linear``, the
  activations quantised in its prologue), ``_int_mm`` (``dynamic_per_token_quant`` +
  ``int8_scaled_mm`` on the plain int8 weight: torch's best) and ``fallback`` (the op with
  ``max_rows = 0``: what a packed layer runs above max_rows, unpacking its weight per call).
  Baseline: ``_int_mm``.
* ``int8_wo`` (weight-only): ``kernel`` (``piecewise::int8_wo_packed_linear``), ``torch``
  (``int8_weight_only_mm`` on the plain weight) and ``fallback`` (the op, ``max_rows = 0``).
  Baseline: ``torch``.

For each shape and row count M the variants run round-robin (the first rotating per round),
each round timing a sweep over enough weight copies to exceed ``--sweep-mb`` (every call
streams its weight from DRAM, as a decode step does).  Tables: median µs per call and the
rate at which each variant reads its own weight bytes (GB/s, median round and best round: on
a shared machine the best round is the one least disturbed), and the kernel's speed-up over
the baseline (medians).  Then, per family, the geometric mean over shapes of that speed-up
per M, and the crossover: the largest measured M up to which the geometric mean stays >= 1
(the default ``max_rows`` these measurements support).

``--baseline REV``: a kernel change A/B instead.  The kernels' sources at git revision ``REV``
(``passes/csrc``, ``framework/core/csrc``) are built for this machine beside the current ones,
and each family has two variants, both called through ctypes with the same arguments:
``kernel`` (the current source) and ``revision`` (REV's); the ratio is revision / kernel, and
the table says whether the two wrote the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import math
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

MODELS = {
    "tiny": ("1024x512", "512x512", "2816x512", "512x1408", "32000x512"),
    "1.1b": ("2560x2048", "2048x2048", "11264x2048", "2048x5632", "32000x2048"),
}
DEFAULT_ROWS = (1, 4, 8, 16, 24, 32, 40, 48, 64)
SWEEP_BYTES = 96 << 20
BIG = 1 << 30  # max_rows for "always the kernel"

FAMILIES = {
    "bf16": (("kernel", "oneDNN", "F.linear"), "oneDNN"),
    "int8": (("kernel", "_int_mm", "fallback"), "_int_mm"),
    "int8_wo": (("kernel", "torch", "fallback"), "torch"),
}
"""Family -> (variants, the baseline the kernel is compared with), where oneDNN lays out bf16
weights; see :func:`family_spec`."""


BASELINE_SOURCES = ("passes/csrc", "framework/core/csrc")
"""What ``--baseline REV`` takes from the revision: the kernels' sources and their headers."""


def baseline_libraries(rev: str, work: Path) -> dict[str, ctypes.CDLL]:
    """This machine's builds of the small-M kernels at git revision ``rev`` (``"bf16"``: the
    small-M library, ``"int8"``: the int8 one, W8A8 and weight-only), from its sources
    extracted under ``work``, with the current libraries' flags and declarations."""
    from passes import int8_small_m
    from passes import small_m_linear as small_m

    repo = Path(__file__).resolve().parents[2]
    try:
        archive = subprocess.run(
            ["git", "archive", rev, *BASELINE_SOURCES], cwd=repo, check=True, capture_output=True
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = (
            e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else e
        )
        raise SystemExit(
            f"small_m_linear: --baseline {rev!r} is not a git revision holding "
            f"{' and '.join(BASELINE_SOURCES)} ({detail})"
        ) from e
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(work, filter="data")
    return {
        "bf16": small_m.LIBRARY.relocated("small_m_linear_baseline", repo, work).load(None),
        "int8": int8_small_m.LIBRARY.relocated("int8_linear_baseline", repo, work).load(None),
    }


def family_spec(family: str, ab: bool = False) -> tuple[tuple[str, ...], str]:
    """(variants, baseline) of ``family`` on this machine: where oneDNN cannot lay out bf16
    weights (AVX2-only CPUs, :func:`framework.compat.onednn.packs`) the bf16 family has no
    ``oneDNN`` variant and its baseline is ``F.linear``, what a layer runs above max_rows.
    ``ab``: the ``--baseline`` A/B, ``kernel`` against ``revision``."""
    from framework.compat import onednn

    if ab:
        return ("kernel", "revision"), "revision"
    variants, baseline = FAMILIES[family]
    if family == "bf16" and not onednn.packs(torch.bfloat16):
        return tuple(v for v in variants if v != "oneDNN"), "F.linear"
    return variants, baseline


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``cpu``: this thread's CPU time (``--threads 1`` only): on a shared, loaded machine it leaves
out the time the benchmark waits for a core, which wall time counts."""


def _sweep_s(fn, xs, n_copies: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for i in range(n_copies):
        fn(xs[i], i)
    return (clock() - t0) / n_copies


def _copies(bytes_per_copy: int, sweep_bytes: int) -> int:
    return max(2, -(-sweep_bytes // bytes_per_copy))


def _random_weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """One seeded bf16 ``[n, k]`` weight of a benchmark's own (not an engine's)."""
    return (torch.randn(n, k, generator=g) * 0.05).bfloat16()


def _int8_weights(n: int, k: int, copies: int, g: torch.Generator) -> list[tuple]:
    """``copies`` random weights quantized per channel as ``int8_per_token`` does, each as
    ``(w_q, scale, packed, fp32 scale [n], compensation)``: what torch's int8 paths and the
    kernels (any revision's) take."""
    from framework.core.quantization import QuantizationConfig
    from passes import int8_small_m as i8
    from passes.quant_schemes import quantize_weight

    spec = QuantizationConfig.parse("int8_per_token").spec_for("layer")
    out = []
    for _ in range(copies):
        w_q, scale = quantize_weight(_random_weight(n, k, g), spec.weight)
        s = scale.reshape(-1).float().contiguous()
        out.append((w_q, scale, i8.pack(w_q), s, i8.compensation(w_q)))
    return out


def _bf16_impls(n: int, k: int, copies: int, g: torch.Generator) -> dict[str, tuple]:
    from framework.compat import onednn as compat_onednn
    from passes import small_m_linear as small_m

    ops = torch.ops.piecewise
    with_onednn = "oneDNN" in family_spec("bf16")[0]
    plain, panels, onednn = [], [], []
    for _ in range(copies):
        w = _random_weight(n, k, g)
        plain.append(w)
        panels.append(small_m.pack(w))
        if with_onednn:
            onednn.append(compat_onednn.prepack(w))
    nbytes = 2 * n * k
    impls = {
        "kernel": (lambda x, i: ops.packed_linear(x, panels[i], None, None, n, k, BIG), nbytes),
        "oneDNN": (
            lambda x, i: compat_onednn.linear_prepacked(x, onednn[i]),
            nbytes,
        ),
        "F.linear": (lambda x, i: F.linear(x, plain[i]), nbytes),
    }
    if not with_onednn:
        del impls["oneDNN"]
    return impls


def _int8_impls(n: int, k: int, copies: int, g: torch.Generator, weight_only: bool) -> dict:
    from passes.ops.scaled_mm import int8_weight_only_mm_torch

    ops = torch.ops.piecewise
    q = _int8_weights(n, k, copies, g)
    nbytes = n * k
    if weight_only:
        s_bf16 = [s.bfloat16() for _, _, _, s, _ in q]
        return {
            "kernel": (
                lambda x, i: ops.int8_wo_packed_linear(x, q[i][2], q[i][3], None, n, k, BIG),
                nbytes,
            ),
            "torch": (
                lambda x, i: int8_weight_only_mm_torch(x, q[i][0], s_bf16[i], None),
                nbytes,
            ),
            "fallback": (
                lambda x, i: ops.int8_wo_packed_linear(x, q[i][2], q[i][3], None, n, k, 0),
                nbytes,
            ),
        }

    def int_mm(x, i):
        w_q, scale = q[i][0], q[i][1]
        x_q = torch.empty(x.shape, dtype=torch.int8)
        sx = torch.empty((x.shape[0], 1), dtype=torch.float32)
        ops.dynamic_per_token_quant(x_q, x, sx)
        return ops.int8_scaled_mm(x_q, sx, w_q.t(), scale, None, x.dtype)

    return {
        "kernel": (
            lambda x, i: ops.int8_packed_linear(x, q[i][2], q[i][3], q[i][4], None, n, k, BIG),
            nbytes,
        ),
        "_int_mm": (int_mm, nbytes),
        "fallback": (
            lambda x, i: ops.int8_packed_linear(x, q[i][2], q[i][3], q[i][4], None, n, k, 0),
            nbytes,
        ),
    }


def _ab_impls(
    family: str, n: int, k: int, copies: int, g: torch.Generator, libs: dict[str, ctypes.CDLL]
) -> dict[str, tuple]:
    """``kernel`` (the current build) and ``revision`` (``libs``, another revision's), both
    through ctypes on the same packed weights, each writing one output tensor per row count
    (of this shape) that it returns."""
    from passes import int8_small_m as i8
    from passes import small_m_linear as small_m

    current = {"bf16": small_m.load_library(), "int8": i8.load_library()}
    lib_key = "bf16" if family == "bf16" else "int8"
    if family == "bf16":
        ws = [small_m.pack(_random_weight(n, k, g)) for _ in range(copies)]
    else:
        ws = [(p, s, c) for _, _, p, s, c in _int8_weights(n, k, copies, g)]

    def make(lib: ctypes.CDLL, outs: dict) -> Callable:
        def call(x, i):
            m = x.shape[0]
            out = outs.setdefault(m, torch.empty(m, n, dtype=torch.bfloat16))
            if family == "bf16":
                rc = lib.piecewise_small_m_linear(
                    x.data_ptr(), k, m, ws[i].data_ptr(), None, out.data_ptr(), n, n, k, 1
                )
            elif family == "int8":
                packed, w_scale, comp = ws[i]
                rc = lib.piecewise_int8_linear(
                    x.data_ptr(),
                    k,
                    m,
                    packed.data_ptr(),
                    comp.data_ptr(),
                    w_scale.data_ptr(),
                    None,
                    out.data_ptr(),
                    n,
                    n,
                    k,
                    1,
                )
            else:
                packed, w_scale, _ = ws[i]
                rc = lib.piecewise_int8_wo_linear(
                    x.data_ptr(),
                    k,
                    m,
                    packed.data_ptr(),
                    w_scale.data_ptr(),
                    None,
                    out.data_ptr(),
                    n,
                    n,
                    k,
                    1,
                )
            if rc:
                raise RuntimeError(
                    f"small_m_linear --baseline: kernel error {rc} ({family}, {n}x{k})"
                )
            return out

        return call

    nbytes = (2 if family == "bf16" else 1) * n * k
    return {
        name: (make(lib, {}), nbytes)
        for name, lib in (("kernel", current[lib_key]), ("revision", libs[lib_key]))
    }


def bench_shape(
    family: str,
    n: int,
    k: int,
    rows: list[int],
    rounds: int,
    sweep_bytes: int = SWEEP_BYTES,
    clock: str = "wall",
    baseline_libs: Optional[dict[str, ctypes.CDLL]] = None,
) -> list[dict]:
    """One weight shape, every row count: ``{"family", "shape", "M", <variant>: (µs, GB/s
    median round, GB/s best round)}`` per M (with ``baseline_libs``, the ``--baseline`` A/B,
    also ``"same_bits"``)."""
    g = torch.Generator().manual_seed(0)
    per_copy = (2 if family == "bf16" else 1) * n * k
    copies = _copies(per_copy, sweep_bytes)
    impls: dict[str, tuple[Callable, int]]
    if baseline_libs is not None:
        impls = _ab_impls(family, n, k, copies, g, baseline_libs)
    elif family == "bf16":
        impls = _bf16_impls(n, k, copies, g)
    else:
        impls = _int8_impls(n, k, copies, g, weight_only=family == "int8_wo")
    names = list(impls)
    out = []
    for m in rows:
        xs = [torch.randn(m, k, generator=g).bfloat16() for _ in range(copies)]
        for fn, _ in impls.values():  # warm-up: thread pool, page faults, oneDNN primitives
            _sweep_s(fn, xs, copies)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(_sweep_s(impls[name][0], xs, copies, CLOCKS[clock]))
        row: dict = {"family": family, "shape": f"{n}x{k}", "M": m}
        row["baseline"] = family_spec(family, baseline_libs is not None)[1]
        if baseline_libs is not None:
            a, b = (impls[v][0](xs[0], 0) for v in ("kernel", "revision"))
            row["same_bits"] = bool(torch.equal(a, b))
        for name, ts in times.items():
            t, nbytes = statistics.median(ts), impls[name][1]
            row[name] = (t * 1e6, nbytes / t / 1e9, nbytes / min(ts) / 1e9)
        out.append(row)
    return out


def crossover(rows: list[dict], family: str) -> tuple[dict[int, float], int]:
    """Per M, the geometric mean over shapes of baseline / kernel (median µs); and the largest
    M up to which (every smaller measured M included) that mean stays >= 1 (0: none)."""
    by_m: dict[int, list[float]] = {}
    for r in rows:
        if r["family"] == family:
            baseline = r.get("baseline") or FAMILIES[family][1]
            by_m.setdefault(r["M"], []).append(r[baseline][0] / r["kernel"][0])
    gmean = {m: math.exp(sum(math.log(v) for v in vs) / len(vs)) for m, vs in sorted(by_m.items())}
    best = 0
    for m, v in gmean.items():
        if v < 1.0:
            break
        best = m
    return gmean, best


def _print_family(family: str, rows: list[dict], ab: bool = False) -> None:
    variants, baseline = family_spec(family, ab)
    head = " | ".join(f"{v} µs | GB/s (best)" for v in variants)
    bits = " same bits |" if ab else ""
    print(f"\n## {family}: kernel vs {baseline}")
    print(f"| shape NxK | M | {head} | kernel vs {baseline} |{bits}")
    print("|---|---|" + "---|---|" * len(variants) + "---|" + ("---|" if ab else ""))
    for r in rows:
        cells = " | ".join(f"{r[v][0]:.1f} | {r[v][1]:.1f} ({r[v][2]:.1f})" for v in variants)
        same = f" {'yes' if r['same_bits'] else 'NO'} |" if ab else ""
        print(
            f"| {r['shape']} | {r['M']} | {cells} | {r[baseline][0] / r['kernel'][0]:.2f}x |{same}"
        )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="+", choices=list(FAMILIES), default=["bf16", "int8"])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--shapes", nargs="+", default=None, help="NxK weights (replaces --models)")
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--sweep-mb", type=int, default=SWEEP_BYTES >> 20, help="weight copies per timed sweep"
    )
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: the thread's CPU time, for a loaded machine (needs --threads 1)",
    )
    ap.add_argument("--bandwidth", action="store_true", help="also probe the read bandwidth")
    ap.add_argument("--json", default=None, help="also write the rows and crossovers here")
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="REV",
        help="A/B the current kernels against their sources at this git revision",
    )
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread's CPU time: use it with --threads 1")
    from passes import native_ops

    cpp = native_ops.load()
    torch.set_num_threads(args.threads)
    shapes = args.shapes or [s for m in args.models for s in MODELS[m]]
    load = _loadavg()
    print(
        f"# threads {args.threads}, kernels {native_ops.isa() if cpp else 'Python op bodies'}, "
        f"median of {args.rounds} round-robin rounds, {args.clock} clock, load average {load}; "
        f"GB/s of each "
        f"variant's own weight bytes"
    )
    if args.bandwidth:
        from experiments.bench.bandwidth import probe_read_bandwidth

        print(f"# read bandwidth (native probe): {probe_read_bandwidth()['best_gb_s']:.1f} GB/s")
    rows: list[dict] = []
    summary = {}
    ab = args.baseline is not None
    with tempfile.TemporaryDirectory(prefix="small_m_baseline_") as work:
        libs = baseline_libraries(args.baseline, Path(work)) if ab else None
        if ab:
            print(f"# A/B: the kernels at {args.baseline} (revision) against the current source")
        for family in args.kernels:
            got = []
            for shape in shapes:
                n, k = (int(v) for v in shape.lower().split("x"))
                got += bench_shape(
                    family, n, k, args.rows, args.rounds, args.sweep_mb << 20, args.clock, libs
                )
            _print_family(family, got, ab)
            gmean, best = crossover(got, family)
            baseline = family_spec(family, ab)[1]
            print(
                f"\n{family}: geometric mean over shapes of kernel vs {baseline}: "
                + ", ".join(f"M={m} {v:.2f}x" for m, v in gmean.items())
            )
            if not ab:
                print(f"{family}: crossover (gmean >= 1 for every M up to it): M = {best}")
            summary[family] = {"gmean_speedup": gmean} | ({} if ab else {"crossover": best})
            rows += got
    if ab:
        summary["baseline"] = args.baseline
    after = _loadavg()
    print(f"# load average at the end: {after}")
    if args.json:
        with open(args.json, "w") as f:
            result = {"threads": args.threads, "clock": args.clock, "load": [load, after]}
            result["rows"] = rows
            json.dump({**result, "summary": summary}, f, indent=1)
    return rows


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
