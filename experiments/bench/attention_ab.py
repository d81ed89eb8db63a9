"""The fused CPU attention kernel against another version of its source, in one process.

    python -m experiments.bench.attention_ab --baseline REV_OR_FILE [--rounds 15] [--threads 2]

``--baseline``: a git revision (its ``backends/attention/csrc/cpu_paged_attention.cpp``) or a
path to a .cpp file.  Both sources are built for this machine and loaded side by side; each
case then runs rounds in which the two libraries alternate on the same tensors, so a change
is measured against the same machine state, which a sequence of separate runs on a noisy
machine is not.  Per round and library: the median of ``--calls`` back-to-back calls (hot:
the KV in cache) and of calls each after ``--evict-mb`` MB were read (cold: as in a decode
step, where the weights streamed through the caches since the layer before).  The table gives
medians over rounds, the current source over the baseline, and whether the two wrote the same
bits (a kernel change that alters them alters greedy tokens of the random-weight test models).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from backends.attention.cpu_paged import paged_attention
from backends.attention.cpu_paged_build import LIBRARY, declare_attention
from experiments.bench.attention import CASES, Case, build_step
from framework.core.native_build import NativeLibrary

AB_CASES = (
    Case("decode b8 ctx 128", (128,) * 8, (1,) * 8),
    Case("decode b32 ctx 128", (128,) * 32, (1,) * 32),
    Case("verify 1+4 b1 ctx 128", (133,), (5,)),
    Case("verify 1+4 b8 ctx 128", (133,) * 8, (5,) * 8),
) + CASES
"""The attention bench's cases, the short-context batched decode of the peers bench and the
verify step of speculative decoding (5 query tokens a request)."""

SOURCE = "backends/attention/csrc/cpu_paged_attention.cpp"


def baseline_source(spec: str, work: Path, repo: Path) -> Path:
    """``spec`` as a source file: the file itself, or the kernel's source at a git revision."""
    path = Path(spec)
    if path.is_file():
        return path
    try:
        text = subprocess.run(
            ["git", "show", f"{spec}:{SOURCE}"],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise SystemExit(
            f"attention_ab: --baseline {spec!r} is neither a file nor a git revision with "
            f"{SOURCE} ({getattr(e, 'stderr', e)})"
        ) from e
    out = work / "baseline" / "cpu_paged_attention.cpp"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def baseline_library(spec: str, work: Path) -> Any:
    """This machine's build of the kernel at ``spec`` (a git revision or a .cpp file; the
    source is written under ``work``), loaded beside the current build."""
    source = baseline_source(spec, work, Path(__file__).resolve().parents[2])
    return NativeLibrary(
        "cpu_paged_baseline",
        source,
        portable_env="PIECEWISE_CPU_PAGED_PORTABLE",
        declare=declare_attention,
    ).load(None)


def _timed(fn, calls: int, before=None) -> float:
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    libraries: dict[str, Any],
    cases: tuple[Case, ...],
    rounds: int,
    calls: int,
    evict_mb: int,
    dtype: torch.dtype = torch.bfloat16,
    shape: tuple[int, int, int, int] = (8, 4, 64, 16),
) -> list[dict[str, Any]]:
    """Per case: median hot and cold µs per library, the ratios to the first, equal bits."""
    hq, hkv, d, bs = shape
    evict = torch.ones(max(1, evict_mb * (1 << 20) // 4))
    names = list(libraries)
    rows = []
    for case in cases:
        q, k, v, out, kv, md = build_step(case, hq, hkv, d, bs, dtype)
        scale = 1 / d**0.5
        hot: dict[str, list[float]] = {n: [] for n in names}
        cold: dict[str, list[float]] = {n: [] for n in names}
        outs = {}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:

                def call(lib=libraries[n]):
                    paged_attention(q, k, v, out, kv, md, scale, -1, library=lib)

                call()
                hot[n].append(_timed(call, calls))
                cold[n].append(_timed(call, max(1, calls // 2), before=evict.sum))
                outs[n] = out.clone()
        row: dict[str, Any] = {"case": case.name}
        for n in names:
            row[f"{n}_hot_us"] = statistics.median(hot[n]) * 1e6
            row[f"{n}_cold_us"] = statistics.median(cold[n]) * 1e6
        base = names[0]
        for n in names[1:]:
            row[f"{n}_over_{base}_hot"] = row[f"{n}_hot_us"] / row[f"{base}_hot_us"]
            row[f"{n}_over_{base}_cold"] = row[f"{n}_cold_us"] / row[f"{base}_cold_us"]
        row["same_bits"] = all(torch.equal(outs[base], outs[n]) for n in names[1:])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], base: str, other: str) -> str:
    lines = [
        f"| case | {base} hot µs | {other} hot µs | ratio | {base} cold µs | {other} cold µs "
        f"| ratio | same bits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r[f'{base}_hot_us']:.1f} | {r[f'{other}_hot_us']:.1f} "
            f"| {r[f'{other}_over_{base}_hot']:.2f} | {r[f'{base}_cold_us']:.1f} "
            f"| {r[f'{other}_cold_us']:.1f} | {r[f'{other}_over_{base}_cold']:.2f} "
            f"| {'yes' if r['same_bits'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="a git revision or a .cpp file")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="timed calls per round (hot)")
    p.add_argument("--evict-mb", type=int, default=64, help="read before each cold call")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="attention_ab_") as tmp:
        baseline = baseline_library(args.baseline, Path(tmp))
        libraries = {"baseline": baseline, "current": LIBRARY.load(None)}
        rows = run(libraries, AB_CASES, args.rounds, args.calls, args.evict_mb)
    print(
        f"# cpu_paged attention, current source vs {args.baseline}, bfloat16, Hq=8 Hkv=4 D=64 "
        f"block 16, {args.threads} threads, {args.rounds} alternating rounds, medians; cold: "
        f"after reading {args.evict_mb} MB"
    )
    print(format_table(rows, "baseline", "current"))
    return rows


if __name__ == "__main__":
    main()
