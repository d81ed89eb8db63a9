"""Workload-driven capture/compile sizes: pick K sizes that minimise padding waste.

At run time the dispatcher pads a step of ``n`` tokens up to the smallest chosen size
``s >= n`` and runs ``s - n`` wasted token rows. Given a histogram ``{n: steps}`` of a recorded
trace (see ``experiments.run.trace``), :func:`choose_sizes` returns the K sizes minimising the
total (equivalently: expected per step) number of padded tokens, by exact dynamic programming.

Why sizes can be restricted to the token counts that occur: moving a chosen size down to the
largest count it covers keeps every assignment and lowers (or keeps) every padding, so some
optimal set consists of occurring counts only. Sort the U distinct counts u_1 < ... < u_U with
weights w_i; let ``cost(i, j) = sum_{i<=l<=j} w_l (u_j - u_l)`` (counts i..j padded to u_j) and
``f[k][j]`` the least waste covering u_1..u_j with k sizes, the largest being u_j:

    f[1][j] = cost(1, j)        f[k][j] = min_{k-1 <= i < j} f[k-1][i] + cost(i+1, j)

With prefix sums each cost is O(1), so the table costs O(K·U²) (vectorised over i with numpy).

Counts above the largest size (``cover_max``): with ``cover_max=True`` (default) every count
of the histogram must be covered, so the largest chosen size is the largest count (a count
above ``max_size`` is then an error). With ``cover_max=False`` counts above ``max_size`` run
unpadded (no CUDA graph / the general compiled range) and cost no padding. Leaving a count
uncovered is always free in padding terms, so the chooser still covers every count up to
``max_size``: ``max_size`` is where the user draws that line.

CLI::

    python -m experiments.tools.size_chooser TRACE -k 8 [--max-size N] [--no-cover-max]
                                                   [--target capture|compile|both] [--json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from experiments.run.trace import read_trace, token_histogram

OVERRIDE_FIELDS = {"capture": "cudagraph_capture_sizes", "compile": "compile_sizes"}
"""CLI ``--target`` name -> field of ``CompilationConfig`` (Hydra group ``compile``)."""


def _clean_histogram(hist: Mapping[int, float]) -> dict[int, float]:
    """Validate a histogram and drop zero-weight counts (they never change the waste)."""
    cleaned: dict[int, float] = {}
    for count, weight in hist.items():
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"histogram: token counts must be positive integers, got {count!r}")
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(
                f"histogram: weight of count {count} must be a finite number >= 0, got {weight!r}"
            )
        if weight > 0:
            cleaned[int(count)] = weight
    return dict(sorted(cleaned.items()))


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    out = sorted(int(s) for s in sizes)
    if not out:
        raise ValueError("sizes: need at least one size")
    if out[0] < 1:
        raise ValueError(f"sizes: must be positive, got {out[0]}")
    if len(set(out)) != len(out):
        raise ValueError(f"sizes: duplicates in {out}")
    return out


def waste(sizes: Sequence[int], hist: Mapping[int, float], cover_max: bool = True) -> float:
    """Total padded tokens when each count ``n`` is padded to the smallest size ``>= n``.

    ``cover_max=True``: a count above every size is an error (the set must cover the trace).
    ``cover_max=False``: such counts run unpadded and add nothing.
    Divide by the number of steps for the expected waste per step.
    """
    sizes = _check_sizes(sizes)
    hist = _clean_histogram(hist)
    total = 0
    for count, weight in hist.items():
        index = int(np.searchsorted(sizes, count))  # first size >= count
        if index == len(sizes):
            if cover_max:
                raise ValueError(
                    f"waste: token count {count} is above the largest size "
                    f"{sizes[-1]}; add a size >= {count} or pass cover_max=False"
                )
            continue
        total += weight * (sizes[index] - count)
    return total


def waste_fraction(
    sizes: Sequence[int], hist: Mapping[int, float], cover_max: bool = True
) -> float:
    """Padded tokens as a fraction of all computed tokens (real + padded), in [0, 1)."""
    hist = _clean_histogram(hist)
    padded = waste(sizes, hist, cover_max=cover_max)
    real = sum(count * weight for count, weight in hist.items())
    return padded / (real + padded) if real + padded else 0.0


def choose_sizes(
    hist: Mapping[int, float], k: int, max_size: Optional[int] = None, cover_max: bool = True
) -> list[int]:
    """The at most ``k`` sizes minimising :func:`waste` on ``hist`` (exact DP, see module doc).

    ``max_size`` caps the sizes (default: the largest count). Returns fewer than ``k`` sizes
    only when fewer distinct counts need covering (then the waste is zero). Ties between
    equally good sets are broken deterministically (smaller sizes first).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"choose_sizes: k must be a positive integer, got {k!r}")
    hist = _clean_histogram(hist)
    if not hist:
        raise ValueError("choose_sizes: the histogram is empty (a trace without steps?)")
    if max_size is not None:
        above = [c for c in hist if c > max_size]
        if above and cover_max:
            raise ValueError(
                f"choose_sizes: token count {max(above)} is above "
                f"max_size={max_size}; raise max_size or pass cover_max=False "
                f"to let counts above it run unpadded"
            )
        hist = {c: w for c, w in hist.items() if c <= max_size}
        if not hist:
            raise ValueError(f"choose_sizes: no token count is <= max_size={max_size}")
    counts = np.array(list(hist), dtype=np.int64)
    weights = np.array(list(hist.values()), dtype=np.float64)
    num = len(counts)
    if k >= num:
        return [int(c) for c in counts]

    u = counts.astype(np.float64)
    # W[j], S[j]: sums of w and w*u over the first j counts.
    W = np.concatenate([[0.0], np.cumsum(weights)])
    S = np.concatenate([[0.0], np.cumsum(weights * u)])
    # f[j]: best waste covering counts 0..j (0-based) with the current number of sizes, the
    # largest being counts[j]; one size covering 0..j pads everything to counts[j].
    f = u * W[1:] - S[1:]
    parents: list[np.ndarray] = []
    for used in range(2, k + 1):
        new_f = np.full(num, np.inf)
        parent = np.full(num, -1, dtype=np.int64)
        lo = used - 2  # with used-1 sizes the previous block must end at index >= used-2
        for j in range(used - 1, num):
            i = np.arange(lo, j)
            # previous sizes cover 0..i; counts[j] covers i+1..j
            candidates = f[lo:j] + u[j] * (W[j + 1] - W[i + 1]) - (S[j + 1] - S[i + 1])
            best = int(np.argmin(candidates))
            new_f[j] = candidates[best]
            parent[j] = lo + best
        f = new_f
        parents.append(parent)
    # Backtrack from the largest count (it must be a size: it covers the top of the trace).
    chosen = [num - 1]
    j = num - 1
    for parent in reversed(parents):
        j = int(parent[j])
        chosen.append(j)
    return sorted(int(counts[j]) for j in chosen)


def to_override(sizes: Sequence[int], field: str = "cudagraph_capture_sizes") -> str:
    """A Hydra override such as ``compile.cudagraph_capture_sizes=[1,8,24]``.

    ``field`` is ``cudagraph_capture_sizes`` or ``compile_sizes``. Quote the result in a shell
    (``[...]`` is a glob pattern): the CLI prints it quoted.
    """
    if field not in OVERRIDE_FIELDS.values():
        raise ValueError(
            f"to_override: field must be one of {sorted(OVERRIDE_FIELDS.values())}, got {field!r}"
        )
    sizes = _check_sizes(sizes)
    return f"compile.{field}=[{','.join(str(s) for s in sizes)}]"


def default_sizes_truncated(
    max_num_tokens: int, k: int, max_count: int, max_size: Optional[int] = None
) -> list[int]:
    """The default capture list cut to ``k`` sizes, as fairly as possible to the default.

    Keeps the default list's ``k-1`` smallest sizes plus the smallest default size that covers
    ``max_count`` (the largest count to cover): like the chosen set, it then covers the trace
    with ``k`` sizes, and its top size is as tight as the default list allows. Sizes above
    ``max_size`` are dropped first; when no remaining size reaches ``max_count`` the largest
    remaining one is the top instead.
    """
    from framework.core.config import default_capture_sizes

    default = [
        s for s in default_capture_sizes(max_num_tokens) if max_size is None or s <= max_size
    ]
    if not default:
        raise ValueError(
            f"the default capture list for max_num_tokens={max_num_tokens} has no "
            f"size <= max_size={max_size}"
        )
    covering = [s for s in default if s >= max_count]
    top = covering[0] if covering else default[-1]
    below = [s for s in default if s < top]
    return below[: max(k - 1, 0)] + [top]


@dataclass
class SizeComparison:
    """The chosen sizes against the truncated default list on one histogram."""

    k: int
    cover_max: bool
    max_size: Optional[int]
    chosen: list[int]
    chosen_waste: float
    chosen_fraction: float
    default: list[int]
    default_waste: float
    default_fraction: float
    num_steps: float

    @property
    def reduction(self) -> float:
        """Fraction of the default's padded tokens the chosen set saves (0 when both are 0)."""
        return 1.0 - self.chosen_waste / self.default_waste if self.default_waste else 0.0


def compare_with_default(
    hist: Mapping[int, float],
    k: int,
    max_num_tokens: int,
    max_size: Optional[int] = None,
    cover_max: bool = True,
) -> SizeComparison:
    """Choose ``k`` sizes and compare with :func:`default_sizes_truncated` on ``hist``.

    Both sets cover the same counts: every count with ``cover_max``, else the counts up to
    ``max_size`` (the default list is cut at ``max_size`` too). When the default list cannot
    reach the largest count to cover (its largest size is smaller), both sets are scored with
    ``cover_max=False`` and the chosen set is capped at the default's largest size.
    """
    hist = _clean_histogram(hist)
    if not hist:
        raise ValueError("compare_with_default: the histogram is empty")
    if cover_max and max_size is not None and max(hist) > max_size:
        raise ValueError(
            f"compare_with_default: token count {max(hist)} is above "
            f"max_size={max_size}; raise max_size or pass cover_max=False "
            f"(--no-cover-max) to let counts above it run unpadded"
        )
    to_cover = [c for c in hist if max_size is None or c <= max_size]
    if not to_cover:
        raise ValueError(f"compare_with_default: no token count is <= max_size={max_size}")
    target = max(to_cover)
    default = default_sizes_truncated(max_num_tokens, k, target, max_size=max_size)
    if default[-1] < target:
        # The default list cannot cover the trace: cap the chosen set at the same size, so
        # both sets leave the same counts unpadded.
        cover_max = False
        max_size = default[-1]
    chosen = choose_sizes(hist, k, max_size=max_size, cover_max=cover_max)
    return SizeComparison(
        k=k,
        cover_max=cover_max,
        max_size=max_size,
        chosen=chosen,
        chosen_waste=waste(chosen, hist, cover_max=cover_max),
        chosen_fraction=waste_fraction(chosen, hist, cover_max=cover_max),
        default=default,
        default_waste=waste(default, hist, cover_max=cover_max),
        default_fraction=waste_fraction(default, hist, cover_max=cover_max),
        num_steps=sum(hist.values()),
    )


def _format_waste(total: float, fraction: float, steps: float) -> str:
    per_step = total / steps if steps else 0.0
    return (
        f"{total:,.0f} padded tokens ({100 * fraction:.2f}% of computed tokens, "
        f"{per_step:.2f} per step)"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.tools.size_chooser",
        description="Choose K capture/compile sizes minimising padding waste on a trace.",
    )
    parser.add_argument("trace", help="trace file (JSON Lines, see experiments/README.md)")
    parser.add_argument("-k", type=int, required=True, help="number of sizes to choose")
    parser.add_argument(
        "--max-size",
        type=int,
        default=None,
        help="largest allowed size (default: the trace's largest count)",
    )
    parser.add_argument(
        "--no-cover-max",
        dest="cover_max",
        action="store_false",
        help="let counts above --max-size run unpadded instead of failing",
    )
    parser.add_argument(
        "--target",
        choices=["capture", "compile", "both"],
        default="capture",
        help="which CompilationConfig field(s) the override sets",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)

    try:
        trace = read_trace(args.trace)
        hist = token_histogram(trace)
        comparison = compare_with_default(
            hist, args.k, trace.max_num_tokens, max_size=args.max_size, cover_max=args.cover_max
        )
    except (ValueError, FileNotFoundError) as e:  # TraceFormatError is a ValueError
        parser.error(str(e))
    fields = (
        list(OVERRIDE_FIELDS.values()) if args.target == "both" else [OVERRIDE_FIELDS[args.target]]
    )
    overrides = [to_override(comparison.chosen, f) for f in fields]
    if args.json:
        payload = asdict(comparison)
        payload.update(
            reduction=comparison.reduction,
            overrides=overrides,
            trace=args.trace,
            max_num_tokens=trace.max_num_tokens,
            distinct_counts=len(hist),
        )
        print(json.dumps(payload))
        return 0
    steps = comparison.num_steps
    print(
        f"trace: {args.trace} ({len(trace)} steps, {len(hist)} distinct token counts, "
        f"max_num_tokens={trace.max_num_tokens})"
    )
    if not comparison.cover_max:
        print(f"counts above {comparison.max_size} run unpadded (not covered by either set)")
    print(f"chosen sizes (K={args.k}): {comparison.chosen}")
    print(f"  waste: {_format_waste(comparison.chosen_waste, comparison.chosen_fraction, steps)}")
    print(
        f"default list truncated to K={args.k} (K-1 smallest + smallest covering size): "
        f"{comparison.default}"
    )
    print(f"  waste: {_format_waste(comparison.default_waste, comparison.default_fraction, steps)}")
    print(f"padding saved vs default: {100 * comparison.reduction:.1f}%")
    print("override: " + " ".join(shlex.quote(o) for o in overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
