"""Decode-step variants of O2, side by side: the measurement behind the lean-step choice.

    python -m experiments.bench.step_variants [--batch 1] [--rounds 5] [--threads 1]

Variants (same model, same prompts, one process, round-robin, median of every kept step):
  O2            the default: pieces split at attention, each compiled by Inductor
  O2-unsplit    the CPU analogue of a FULL graph: ``splitting_ops=[]``, one Inductor program
                with attention inside as an extern kernel call (no piece boundaries)
  O2-cpp        the pieces compiled with Inductor's ``cpp_wrapper`` (a C++ host wrapper
                instead of Python around each compiled piece)
Each row also says whether its greedy tokens equal O2's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

VARIANTS = {
    "O2": {},
    "O2-unsplit": {"splitting_ops": []},
    "O2-cpp": {"inductor_config": {"cpp_wrapper": True}},
}


def run(args: argparse.Namespace) -> list[dict]:
    from framework import LLM, CompilationConfig
    from models.tiny import ensure_tiny_model

    path = args.model_dir or str(ensure_tiny_model(preset=args.preset))
    llms = {}
    for name in args.variants:
        t0 = time.perf_counter()
        cc = CompilationConfig(level=2, progress_bar=False, **VARIANTS[name])
        llms[name] = LLM(
            path,
            dtype=args.dtype,
            max_num_seqs=args.batch,
            max_model_len=args.prompt_len + args.steps + 8,
            compilation_config=cc,
            cache_dir=args.cache_dir,
        )
        print(f"# built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(llms.values())).model_config.vocab_size
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    tokens = {n: llm.generate(prompts, args.steps + 1, ignore_eos=True) for n, llm in llms.items()}
    samples: dict[str, list[float]] = {n: [] for n in llms}
    names = list(llms)
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times = llms[n].runner.step_times
            for t in times.values():
                t.clear()
            llms[n].generate(prompts, args.steps + 1, ignore_eos=True)
            samples[n] += times["decode"][2:]
    ref = tokens[names[0]]
    return [
        {
            "variant": n,
            "median_ms": statistics.median(samples[n]) * 1e3,
            "min_ms": min(samples[n]) * 1e3,
            "tokens_equal_first": tokens[n] == ref,
        }
        for n in names
    ]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int)
    p.add_argument("--cache-dir")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args(argv)
    if min(args.batch, args.prompt_len, args.steps, args.rounds) <= 0 or args.steps < 3:
        p.error("--batch, --prompt-len, --rounds must be positive and --steps >= 3")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"| variant | decode median ms | min ms | tokens = {rows[0]['variant']} |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
            f"{'yes' if r['tokens_equal_first'] else 'NO'} |"
        )
    return rows


if __name__ == "__main__":
    main()
