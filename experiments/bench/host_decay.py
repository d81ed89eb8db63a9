"""How much a small host call costs after the machine did something else first.

    python -m experiments.bench.host_decay [--reps 60] [--rounds 3] [--out FILE.md]

Microbenchmarks time a call back to back, with its code, its Python objects and its data hot
in the caches. Inside a decode step, every host call comes after megabytes of weights have
streamed through, or after a wait. This bench times one small call of the project: the
native greedy argmax (:func:`framework.engine.greedy_native.greedy_argmax`) over one bf16 row
of 32000 logits, single-threaded at one row. It runs right after each of these:

* the same call (back to back: the microbenchmark's number);
* a read of N MB (``Tensor.sum`` over a buffer of that size);
* a ``time.sleep`` of N ms (nothing of this process runs or is read);
* a busy Python loop of N ms (the core stays busy, but reads nothing large).

If the cost depended only on what this process evicted, a sleep would cost nothing and the
reads would stop growing past the last-level cache. On the 2-vCPU VM measured here, both
grow with the gap (2026-12-04): back to back 9 µs; after a 64 MB read 57 µs; after a 3 ms
sleep 36 µs. Read the engine's ``step_parts`` table with that in mind: a host call costs
several times its microbenchmark inside a step.

Medians over ``--reps`` calls per case, and the median of ``--rounds`` such medians (the
cases run in the same order in each round).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable, Optional

import torch

from framework.engine import greedy_native

READ_MB = (1, 8, 16, 32, 64, 128)
SLEEP_MS = (1, 3, 10)
SPIN_MS = (3,)


def _spin(ms: float) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    return spin


def cases() -> list[tuple[str, Callable[[], None]]]:
    """(label, what runs right before the timed call), in the order they run."""
    out: list[tuple[str, Callable[[], None]]] = [("the same call, back to back", lambda: None)]
    for mb in READ_MB:
        buf = torch.zeros(mb * (1 << 20) // 4)
        out.append((f"a read of {mb} MB", buf.sum))
    for ms in SLEEP_MS:
        out.append((f"a sleep of {ms} ms", lambda ms=ms: time.sleep(ms / 1e3)))
    for ms in SPIN_MS:
        out.append((f"a busy Python loop of {ms} ms", _spin(ms)))
    return out


def time_after(before: Callable[[], None], call: Callable[[], object], reps: int) -> float:
    """Median seconds of ``call()`` run right after ``before()``."""
    times = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(reps: int, rounds: int, log=print) -> list[dict]:
    x = torch.randn(1, 32000).to(torch.bfloat16)
    if greedy_native.greedy_argmax(x) is None:
        raise RuntimeError("the native greedy argmax cannot be built here (no compiler?)")

    def call() -> object:
        return greedy_native.greedy_argmax(x)

    table = cases()
    per_round: dict[str, list[float]] = {label: [] for label, _ in table}
    for r in range(rounds):
        for label, before in table:
            per_round[label].append(time_after(before, call, reps))
        log(f"  round {r + 1}/{rounds}")
    base = statistics.median(per_round[table[0][0]])
    return [
        {
            "before": label,
            "us": 1e6 * statistics.median(times),
            "vs_back_to_back": statistics.median(times) / base,
        }
        for label, times in per_round.items()
    ]


def markdown(rows: list[dict], reps: int, rounds: int) -> str:
    head = (
        f"# host call after a gap: native greedy argmax, 1 x 32000 bf16, {reps} calls x "
        f"{rounds} rounds (medians), {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        "| right before the call | µs | vs back to back |\n|---|---|---|\n"
    )
    return head + "".join(
        f"| {r['before']} | {r['us']:.1f} | {r['vs_back_to_back']:.2f}x |\n" for r in rows
    )


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=60, help="timed calls per case and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the markdown table here")
    args = p.parse_args(argv)
    if args.reps <= 0 or args.rounds <= 0:
        p.error("--reps and --rounds must be positive")
    rows = run(args.reps, args.rounds)
    text = markdown(rows, args.reps, args.rounds)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
