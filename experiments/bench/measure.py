"""The latency measurements of the side-by-side benchmark (``experiments.bench.vs_hf``):
decode steps round-robin over the contenders, per generated token through ``LLM.generate``,
the weights' streaming floor and the attention micro-benchmark rows."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Optional

import torch

from experiments.bench.contenders import Contender, Piecewise

SHORT_GENERATION = 8
"""New tokens of the short generation the per-token-through-generate figure subtracts."""


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch, prompt_len), generator=g).tolist()


def timed_generation(c: Contender, prompts, steps) -> tuple[list[list[int]], list[float]]:
    gc.collect()
    gc.disable()
    try:
        return c.generate(prompts, steps)
    finally:
        gc.enable()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> float:
    pairs = [(a, b) for row, rrow in zip(tokens, ref) for a, b in zip(row, rrow)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def measure_latency(
    contenders: list[Contender],
    dtype: str,
    batch: int,
    args: argparse.Namespace,
    vocab_size: int,
    log: Callable,
    prompt_len: Optional[int] = None,
) -> list[dict]:
    prompt_len = prompt_len or args.prompt_len
    prompts = make_prompts(batch, prompt_len, vocab_size)
    samples: dict[str, list[float]] = {c.name: [] for c in contenders}
    tokens: dict[str, list[list[int]]] = {}
    for c in contenders:  # warm-up: compiles, recompiles, caches
        t0 = time.perf_counter()
        tokens[c.name], _ = timed_generation(c, prompts, args.steps)
        log(f"  warm-up {c.name} {dtype} b{batch} p{prompt_len}: {time.perf_counter() - t0:.1f}s")
    stable = {c.name: True for c in contenders}
    for r in range(args.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            toks, times = timed_generation(c, prompts, args.steps)
            stable[c.name] &= toks == tokens[c.name]
            samples[c.name].extend(times[args.warmup_steps :])
    ref_name = "hf_eager" if "hf_eager" in tokens else contenders[0].name
    rows = []
    for c in contenders:
        ms = [t * 1e3 for t in samples[c.name]]
        rows.append(
            {
                "dtype": dtype,
                "batch": batch,
                "prompt_len": prompt_len,
                "contender": c.name,
                "median_ms": statistics.median(ms),
                "p90_ms": percentile(ms, 0.9),
                "min_ms": min(ms),
                "samples": len(ms),
                "agreement_ref": ref_name,
                "token_agreement": agreement(tokens[c.name], tokens[ref_name]),
                "tokens_stable_across_rounds": stable[c.name],
                "tokens": tokens[c.name],
            }
        )
    return rows


def measure_per_token(
    contenders: list[Contender], dtype: str, args: argparse.Namespace, vocab_size: int
) -> list[dict]:
    """Per generated token through ``LLM.generate`` at batch 1, host work included:
    (best t(N new) - best t(8 new)) / (N - 8), the best over the rounds of each length (a
    round the machine slowed moves a single difference by more than the few tokens it
    measures, even below zero; the minimum of each time is what the code can do).
    ``per_token_ms_all``: each round's own difference, for the spread."""
    prompts = make_prompts(1, args.prompt_len, vocab_size)
    n_long, rows = args.generate_tokens, []
    for c in contenders:
        if not isinstance(c, Piecewise):
            continue
        longs: list[float] = []
        shorts: list[float] = []
        for _ in range(args.rounds + 1):  # the first round warms up
            longs.append(c.time_generate(prompts, n_long))
            shorts.append(c.time_generate(prompts, SHORT_GENERATION))
        extra = n_long - SHORT_GENERATION
        ms = [(tl - ts) / extra * 1e3 for tl, ts in zip(longs[1:], shorts[1:])]
        best = (min(longs[1:]) - min(shorts[1:])) / extra * 1e3
        rows.append(
            {
                "dtype": dtype,
                "batch": 1,
                "prompt_len": args.prompt_len,
                "contender": c.name,
                "new_tokens": [SHORT_GENERATION, n_long],
                "per_token_ms": best,
                "per_token_ms_all": ms,
            }
        )
    return rows


def streaming_floor(contenders: list[Contender], args: argparse.Namespace) -> Optional[dict]:
    """The weights' streaming floor of a decode step: every weight but the embedding table
    read once, at this machine's read bandwidth measured by the native probe (at the current
    thread count; :func:`experiments.bench.bandwidth.floor_bandwidth`)."""
    from experiments.bench.bandwidth import floor_bandwidth
    from experiments.bench.profile_step import step_bytes

    o2 = [c for c in contenders if c.name == "O2"]
    if not o2:
        return None
    bandwidth, probe = floor_bandwidth()
    weights = step_bytes(o2[0].llm, 1, args.prompt_len)["weights"]
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_probe": probe.get("best_case", probe["probe"]),
        "weight_bytes": weights,
        "floor_ms": weights / bandwidth * 1e3,
        "prompt_len": args.prompt_len,
    }


def measure_attention(dtype: str, args: argparse.Namespace) -> list[dict]:
    from experiments.bench import attention as bench_attention

    ns = bench_attention.parser().parse_args(["--dtype", dtype, "--rounds", str(args.rounds)])
    rows, bandwidth = bench_attention.run(ns)
    return [dict(r, dtype=dtype, bandwidth_gb_s=bandwidth / 1e9) for r in rows]
