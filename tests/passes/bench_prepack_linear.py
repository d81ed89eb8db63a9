"""Benchmark (not a test): F.linear vs piecewise::packed_linear vs the same implementation
registered with torch.library.custom_op, side by side in one process, interleaved rounds.

    .venv/bin/python tests/passes/bench_prepack_linear.py [num_threads]

Numbers from this script are in passes/README.md ("Measured").
"""

import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import passes.ops.packed_linear as P  # noqa: E402
from models.layers import Linear  # noqa: E402


@torch.library.custom_op("pwbench::lin_custom", mutates_args=())
def lin_custom(
    x: torch.Tensor, w: torch.Tensor, md: Optional[torch.Tensor], n: int, k: int
) -> torch.Tensor:
    """The same implementation as piecewise::packed_linear, registered with custom_op."""
    return P.packed_linear_cpu(x, w, md, None, n, k, 16)


@lin_custom.register_fake
def _(x, w, md, n, k):
    return x.new_empty((*x.shape[:-1], n))


def packed(w: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``w`` re-laid out as an engine holds it (the layer's packed weight and descriptor)."""
    layer = Linear(w.shape[1], w.shape[0], dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    P.PackedLinearMethod(16).process(layer)
    return layer.weight, layer.weight_md


def per_call_us(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def run(cases, n: int, rounds: int = 21) -> dict[str, tuple[float, float]]:
    """(median, min) µs per call; variants interleaved so load changes hit all alike."""
    for _, fn in cases:
        for _ in range(5):
            fn()
    res = {name: [] for name, _ in cases}
    for _ in range(rounds):
        for name, fn in cases:
            res[name].append(per_call_us(fn, n))
    return {k: (statistics.median(v), min(v)) for k, v in res.items()}


def main() -> None:
    torch.manual_seed(0)
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print("threads", torch.get_num_threads())
    for (n_out, k), n in (((1408, 512), 200), ((32000, 512), 10)):
        x = torch.randn(1, k, dtype=torch.bfloat16)
        w = torch.randn(n_out, k, dtype=torch.bfloat16) / k**0.5
        wp, md = packed(w)
        cases = [
            ("F.linear", lambda: F.linear(x, w)),
            ("packed impl (no op)", lambda: P.packed_linear_cpu(x, wp, md, None, n_out, k, 16)),
            ("packed_linear (Library op)", lambda: P.packed_linear(x, wp, md, None, n_out, k, 16)),
            (
                "packed via custom_op",
                lambda: torch.ops.pwbench.lin_custom.default(x, wp, md, n_out, k),
            ),
        ]
        for name, (med, mn) in run(cases, n).items():
            print(f"[1,{k}]x[{n_out},{k}] bf16  {name:30s} median {med:8.1f} us  min {mn:8.1f} us")
    x, w = torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    wp, md = packed(w)
    r = run(
        [
            ("impl", lambda: P.packed_linear_cpu(x, wp, md, None, 8, 8, 16)),
            ("Library op", lambda: P.packed_linear(x, wp, md, None, 8, 8, 16)),
            ("custom_op", lambda: torch.ops.pwbench.lin_custom.default(x, wp, md, 8, 8)),
        ],
        2000,
    )
    print(
        f"per-call overhead on a tiny [1,8]x[8,8] call (median over the bare impl): "
        f"Library op {r['Library op'][0] - r['impl'][0]:.1f} us, "
        f"custom_op {r['custom_op'][0] - r['impl'][0]:.1f} us"
    )


if __name__ == "__main__":
    main()
