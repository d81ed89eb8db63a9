"""The O2 decode step with the small-M linear kernel vs with oneDNN for every linear, side by
side in one process: what the kernel buys end to end.

    python -m experiments.bench.small_m_step [--batches 1 8] [--rounds 5] [--threads 2]

Two ``LLM`` s (default tiny model, bf16, O2) per batch size, one per variant: ``oneDNN``
builds with ``kernel_config.small_m_max_rows = 0`` so ``piecewise::packed_linear`` (graph
linears and the LM head) takes the oneDNN path at every size; ``small-M`` keeps the default
threshold.  The setting is each engine's own (part of its cache key), so both live in one
process.  Rounds alternate the variants (round-robin, the first variant rotating); each row is
the median decode step over every round's steps, and says whether the greedy tokens equal
oneDNN's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from experiments.bench.contenders import Piecewise
from experiments.bench.measure import make_prompts, timed_generation
from framework import LLM, CompilationConfig
from passes import small_m_linear as small_m

VARIANTS = {"oneDNN": 0, "small-M": small_m.DEFAULT_MAX_ROWS}
"""Variant name -> ``KernelConfig.small_m_max_rows``."""


def build_variant(
    max_rows: int, path: str, dtype: str, cache_dir: str, max_num_seqs: int, max_model_len: int
) -> LLM:
    return LLM(
        path,
        dtype=dtype,
        cache_dir=cache_dir,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        compilation_config=CompilationConfig(
            level=2, progress_bar=False, kernel_config={"small_m_max_rows": max_rows}
        ),
    )


def run(args: argparse.Namespace) -> list[dict]:
    import tempfile

    from models.tiny import ensure_tiny_model

    path = args.model_dir or str(ensure_tiny_model(preset=args.preset))
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pw_small_m_")
    rows = []
    for batch in args.batches:
        variants = []
        for name, max_rows in VARIANTS.items():
            t0 = time.perf_counter()
            max_len = args.prompt_len + args.steps + 8
            llm = build_variant(max_rows, path, args.dtype, cache_dir, batch, max_len)
            print(f"# built O2 b{batch} {name} in {time.perf_counter() - t0:.1f}s", flush=True)
            variants.append(Piecewise(name, llm))
        prompts = make_prompts(batch, args.prompt_len, variants[0].llm.model_config.vocab_size)
        tokens, samples = {}, {v.name: [] for v in variants}
        for v in variants:  # warm-up: thread pool, first calls
            tokens[v.name], _ = timed_generation(v, prompts, args.steps)
        for r in range(args.rounds):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                _, times = timed_generation(v, prompts, args.steps)
                samples[v.name].extend(t * 1e3 for t in times[args.warmup_steps :])
        base = statistics.median(samples["oneDNN"])
        for v in variants:
            med = statistics.median(samples[v.name])
            rows.append(
                {
                    "batch": batch,
                    "variant": v.name,
                    "median_ms": med,
                    "speedup": base / med,
                    "tokens_equal_oneDNN": tokens[v.name] == tokens["oneDNN"],
                }
            )
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=2, help="decode steps dropped per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="artifact cache root (default: a fresh temp dir)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"# {args.dtype} O2, {args.threads} threads, median decode step of {args.rounds} rounds")
    print("| batch | variant | ms / step | vs oneDNN | tokens = oneDNN's |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['variant']} | {r['median_ms']:.3f} | {r['speedup']:.2f}x | "
            f"{r['tokens_equal_oneDNN']} |"
        )
    return rows


if __name__ == "__main__":
    main()
