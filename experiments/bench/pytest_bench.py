"""``make bench``: the pytest-benchmark suite in pytest_suite/, compared with a saved baseline.

    python -m experiments.bench             # run, compare with results/baseline.json
    python -m experiments.bench --save              # run and save it as the new baseline
    python -m experiments.bench --preset test-llama --threads 1 -- -k overhead

What it measures (pytest_suite/): decode step (batch 1 and 8) and prefill step (64 tokens) of
the tiny model at the chosen level; per-step framework overhead in microseconds (forward
context enter/exit, piece dispatch with range lookup, the whole per-step path with one dispatch
per piece, ``ModelRunner.build_context`` for a decode batch); load time of one compiled piece
from the artifact store.  The first run compiles the model into the artifact cache
(``--cache-dir``, default the framework's), later runs load it.

Comparison: when the baseline file exists, ``--benchmark-compare`` prints each benchmark next
to its baseline row; ``--fail-over PCT`` turns a median regression beyond PCT% into a failure.
The baseline is a ``--benchmark-json`` file with the raw per-round timings stripped (stats,
machine and commit info remain).  Absolute times depend on the machine and its load: save
the baseline and compare on the same, quiet machine.  Arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from experiments.bench import RESULTS_DIR
from framework.core.files import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
SUITE = str(Path(__file__).resolve().parent / "pytest_suite")
DEFAULT_BASELINE = RESULTS_DIR / "baseline.json"


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=DEFAULT_BASELINE,
        help="baseline file to compare with / save to (default: %(default)s)",
    )
    p.add_argument("--save", action="store_true", help="save this run as the new baseline")
    p.add_argument("--no-compare", action="store_true", help="do not compare with the baseline")
    p.add_argument(
        "--fail-over",
        type=float,
        metavar="PCT",
        help="fail when a benchmark's median is more than PCT%% above the baseline",
    )
    p.add_argument("--preset", default="default", help="models.tiny preset (default: default)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--level", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--cache-dir", help="artifact cache dir (default: the framework's)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = p.parse_args(argv)
    if args.fail_over is not None and args.fail_over <= 0:
        p.error("--fail-over must be positive")
    if args.threads is not None and args.threads <= 0:
        p.error("--threads must be positive")
    return args, extra


def pytest_command(
    args: argparse.Namespace, extra: list[str], json_out: Optional[Path]
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        SUITE,
        "-m",
        "bench",
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-columns=min,median,iqr,max,rounds",
        "--benchmark-sort=name",
    ]
    if json_out is not None:
        cmd.append(f"--benchmark-json={json_out}")
    if not args.no_compare and args.baseline.is_file():
        cmd.append(f"--benchmark-compare={args.baseline.resolve()}")
        if args.fail_over is not None:
            cmd.append(f"--benchmark-compare-fail=median:{args.fail_over}%")
    return cmd + extra


def bench_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(
        os.environ,
        PIECEWISE_BENCH_PRESET=args.preset,
        PIECEWISE_BENCH_DTYPE=args.dtype,
        PIECEWISE_BENCH_LEVEL=str(args.level),
    )
    if args.threads:
        env["PIECEWISE_BENCH_THREADS"] = str(args.threads)
    if args.cache_dir:
        env["PIECEWISE_BENCH_CACHE_DIR"] = args.cache_dir
    return env


def write_baseline(raw_json: Path, baseline: Path) -> None:
    """Copy pytest-benchmark's JSON to ``baseline`` without the raw timings (atomically)."""
    data = json.loads(raw_json.read_text())
    for bench in data.get("benchmarks", []):
        bench.get("stats", {}).pop("data", None)
    atomic_write_text(baseline, json.dumps(data, indent=1, sort_keys=True) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    args, extra = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        raw = Path(tmp) / "run.json" if args.save else None
        cmd = pytest_command(args, extra, raw)
        print("+ " + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT, env=bench_env(args))
        if args.save:
            if rc != 0:
                print(
                    f"benchmarks failed (exit code {rc}); baseline {args.baseline} not updated",
                    file=sys.stderr,
                )
                return rc
            write_baseline(raw, args.baseline)
            print(f"saved baseline: {args.baseline}")
        elif not args.no_compare and not args.baseline.is_file():
            print(
                f"no baseline at {args.baseline}; save one with `make bench-save` "
                f"(python -m experiments.bench --save)"
            )
    return rc


if __name__ == "__main__":
    sys.exit(main())
