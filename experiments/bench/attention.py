"""Attention micro-benchmark: the plain-torch reference backend against the fused CPU kernel.

    python -m experiments.bench.attention [--dtype bfloat16] [--threads 2] [--rounds 5]

Each case is one ``piecewise::attention`` layer call (KV write + attention) in a forward
context, as the model makes it; the backends run round-robin in one process, and each round
times a batch of calls; the table prints medians over rounds.  Cases: decode at batch 1 with
short contexts (the latency target: <= 30 µs per layer call at <= 128 tokens), batch 8 and 32
decode, a 4k-context decode (the KV read rate against this machine's measured read bandwidth;
target >= 50%), and a 128-token prefill.  Shapes default to the default tiny model (8 query
heads, 4 KV heads, head_dim 64, block size 16).

Back-to-back calls find the KV in cache (a b8 step's KV is under 1 MB a layer), but in a
decode step the model's weights have just streamed through and the KV comes from memory.  So
the fused kernel is also timed cold (``cold µs``): before each timed call a buffer of
``--evict-mb`` MB (default 64: twice the 32 MB last-level cache of the machines here) is
read, as a layer's weights are read between two attention calls, and only the call is timed;
the decode cases only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import torch

import backends.attention  # noqa: F401  (registers the op and the backends)
from backends.attention.cpu_paged_build import isa
from experiments.bench.bandwidth import measure_read_bandwidth
from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import ForwardContext, set_forward_context


@dataclass(frozen=True)
class Case:
    name: str
    ctx_lens: tuple[int, ...]
    q_lens: tuple[int, ...]


CASES = (
    Case("decode b1 ctx 80", (80,), (1,)),
    Case("decode b1 ctx 128", (128,), (1,)),
    Case("decode b8 ctx 400", (400,) * 8, (1,) * 8),
    Case("decode b32 ctx 400", (400,) * 32, (1,) * 32),
    Case("decode b1 ctx 4096", (4096,), (1,)),
    Case("prefill 128", (128,), (128,)),
)


def build_step(case: Case, hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype):
    """(q, k, v, out, kv_cache, metadata) of one step, blocks shuffled."""
    g = torch.Generator().manual_seed(0)
    nblk = [-(-n // block_size) for n in case.ctx_lens]
    num_blocks = sum(nblk) + 1
    order = torch.randperm(num_blocks, generator=g).tolist()
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(nblk), max(nblk), dtype=torch.int32)
    slots, qsl = [], [0]
    for i, (L, ql) in enumerate(zip(case.ctx_lens, case.q_lens)):
        blocks = [order.pop() for _ in range(nblk[i])]
        table[i, : nblk[i]] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(L - ql, L)]
        qsl.append(qsl[-1] + ql)
    n = qsl[-1]
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    md = AttentionMetadata(
        "torch",
        n,
        len(nblk),
        max(case.q_lens),
        max(case.ctx_lens),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(case.ctx_lens, dtype=torch.int32),
        table,
        torch.tensor(slots, dtype=torch.int64),
        qsl,
        list(case.ctx_lens),
    )
    return q, k, v, torch.empty_like(q), kv, md


def time_calls(backend: str, step, calls: int) -> float:
    """Seconds per layer call (the metadata object is shared by the calls, as by the layers
    of one model step)."""
    q, k, v, out, kv, md = step
    md = dataclasses.replace(md, attention_backend=backend)  # fresh per-step caches
    scale = 1 / math.sqrt(q.shape[-1])
    with torch.no_grad(), set_forward_context(ForwardContext({"l": md}, {"l": kv})):
        torch.ops.piecewise.attention(q, k, v, out, "l", scale, -1)
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.ops.piecewise.attention(q, k, v, out, "l", scale, -1)
        return (time.perf_counter() - t0) / calls


def time_cold_calls(step, calls: int, evict: torch.Tensor) -> float:
    """Median seconds of one fused-kernel layer call after ``evict`` was read (the caches hold
    none of the call's KV, q or block table, nor the call path's code and data)."""
    q, k, v, out, kv, md = step
    md = dataclasses.replace(md, attention_backend="cpu_paged")
    scale = 1 / math.sqrt(q.shape[-1])
    times = []
    with torch.no_grad(), set_forward_context(ForwardContext({"l": md}, {"l": kv})):
        torch.ops.piecewise.attention(q, k, v, out, "l", scale, -1)
        for _ in range(calls):
            evict.sum()
            t0 = time.perf_counter()
            torch.ops.piecewise.attention(q, k, v, out, "l", scale, -1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kv_bytes(case: Case, hkv: int, d: int, dtype: torch.dtype) -> int:
    """K and V bytes one layer call must read (every context token once)."""
    return 2 * sum(case.ctx_lens) * hkv * d * torch.empty(0, dtype=dtype).element_size()


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    backends_ = ["torch", "cpu_paged"]
    bandwidth = measure_read_bandwidth()
    evict = torch.zeros(args.evict_mb * (1 << 20) // 4) if args.evict_mb else None
    rows = []
    for case in CASES:
        step = build_step(case, args.hq, args.hkv, args.head_dim, args.block_size, dtype)
        est = time_calls("torch", step, 3)
        calls = max(3, min(2000, int(args.round_seconds / max(est, 1e-6))))
        samples = {b: [] for b in backends_}
        cold = []
        for _ in range(args.rounds):
            for b in backends_:
                samples[b].append(time_calls(b, step, calls))
            if evict is not None and case.name.startswith("decode"):
                cold.append(time_cold_calls(step, args.cold_calls, evict))
        med = {b: statistics.median(s) for b, s in samples.items()}
        rows.append(
            {
                "case": case.name,
                **{f"{b}_us": med[b] * 1e6 for b in backends_},
                "speedup": med["torch"] / med["cpu_paged"],
                "cpu_paged_cold_us": statistics.median(cold) * 1e6 if cold else None,
                "kv_read_frac": kv_bytes(case, args.hkv, args.head_dim, dtype)
                / med["cpu_paged"]
                / bandwidth,
            }
        )
    return rows, bandwidth


def parser() -> argparse.ArgumentParser:
    """The command line; :func:`experiments.bench.measure.measure_attention` parses its own
    settings with it too, so a new option reaches every caller with its default."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--round-seconds",
        type=float,
        default=0.05,
        help="time budget of one backend's batch of calls per round",
    )
    p.add_argument(
        "--evict-mb",
        type=int,
        default=64,
        help="buffer read before each cold call (0: no cold timing)",
    )
    p.add_argument("--cold-calls", type=int, default=20, help="cold calls per round and case")
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    return p


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, bandwidth = run(args)
    print(
        f"# attention per layer call, {args.dtype}, {args.threads} threads, Hq={args.hq} "
        f"Hkv={args.hkv} D={args.head_dim} block {args.block_size}, kernel ISA {isa()}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, median of {args.rounds} rounds"
    )
    print(
        f"{'case':<22}{'torch µs':>10}{'cpu_paged µs':>14}{'speedup':>9}{'KV read % bw':>14}"
        f"{'cold µs':>10}"
    )
    for r in rows:
        cold = r["cpu_paged_cold_us"]
        print(
            f"{r['case']:<22}{r['torch_us']:>10.1f}{r['cpu_paged_us']:>14.1f}"
            f"{r['speedup']:>8.1f}x{100 * r['kv_read_frac']:>13.0f}%"
            f"{'—' if cold is None else f'{cold:.1f}':>10}"
        )
    short = [r for r in rows if r["case"].startswith("decode b1 ctx") and "4096" not in r["case"]]
    long_ = [r for r in rows if r["case"] == "decode b1 ctx 4096"]
    ok_short = all(r["cpu_paged_us"] <= 30 for r in short)
    ok_long = all(r["kv_read_frac"] >= 0.5 for r in long_)
    print(f"target: b1 decode <= 128 tokens <= 30 µs per call: {'met' if ok_short else 'NOT met'}")
    print(f"target: 4k-context KV read >= 50% of bandwidth: {'met' if ok_long else 'NOT met'}")
    return rows


if __name__ == "__main__":
    main()
