"""The O2 decode step with the small-M linear kernel vs with oneDNN for every linear, side by
side in one process: what the kernel buys end to end.

    python -m experiments.bench_small_m_step [--batches 1 8] [--rounds 5] [--threads 2]

One ``LLM`` (default tiny model, bf16, O2) serves both variants: ``oneDNN`` sets
``passes.small_m_linear.MAX_ROWS = 0`` so ``piecewise::prepacked_linear`` (graph linears and
the LM head) takes the oneDNN path; ``small-M`` restores the default threshold.  Rounds
alternate the variants (round-robin, the first variant rotating); each row is the median
decode step over every round's steps, and says whether the greedy tokens equal oneDNN's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from experiments.bench_measure import make_prompts, timed_generation
from experiments.contenders import Piecewise, build_llm
from passes import small_m_linear as small_m

VARIANTS = {"oneDNN": 0, "small-M": small_m.MAX_ROWS}


class _Variant(Piecewise):
    def __init__(self, name: str, llm, max_rows: int):
        super().__init__(name, llm)
        self.max_rows = max_rows

    def generate(self, prompts, steps):
        small_m.MAX_ROWS = self.max_rows
        return super().generate(prompts, steps)


def run(args: argparse.Namespace) -> list[dict]:
    import tempfile

    from models.tiny import ensure_tiny_model

    path = args.model_dir or str(ensure_tiny_model(preset=args.preset))
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pw_small_m_")
    rows = []
    for batch in args.batches:
        t0 = time.perf_counter()
        llm = build_llm(2, path, args.dtype, cache_dir, batch, args.prompt_len + args.steps + 8)
        print(f"# built O2 b{batch} in {time.perf_counter() - t0:.1f}s", flush=True)
        prompts = make_prompts(batch, args.prompt_len, llm.model_config.vocab_size)
        variants = [_Variant(n, llm, r) for n, r in VARIANTS.items()]
        tokens, samples = {}, {v.name: [] for v in variants}
        for v in variants:  # warm-up: packing, thread pool
            tokens[v.name], _ = timed_generation(v, prompts, args.steps)
        for r in range(args.rounds):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                _, times = timed_generation(v, prompts, args.steps)
                samples[v.name].extend(t * 1e3 for t in times[args.warmup_steps :])
        small_m.MAX_ROWS = VARIANTS["small-M"]
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
