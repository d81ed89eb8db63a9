"""Prefill time on a shared-prefix workload, with and without prefix caching.

    python -m experiments.bench.prefix_cache                 # default tiny model, O0
    python -m experiments.bench.prefix_cache --prefix 256 --prompts 16 --suffix 32 --json

16 prompts share a 256-token prefix and end in 32 unique tokens; each is prefilled (one
new token).  Three engines per repeat: without caching; with caching, cold (the first
prompts compute the prefix, later admissions hit it); with caching, warm (one earlier
request with the same prefix).  Reported: the summed step time of the prompts' prefill
steps (medians over repeats), hit tokens, and that every engine chose the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from framework import LLM
from models.config import ModelConfig
from models.tiny import ensure_tiny_model


def _prefill_s(llm: LLM) -> float:
    times = llm.runner.step_times
    return sum(times["prefill"]) + sum(times["mixed"]) + sum(times["decode"])


def _clear(llm: LLM) -> None:
    for t in llm.runner.step_times.values():
        t.clear()


def run(
    model: str,
    *,
    prompts: int,
    prefix: int,
    suffix: int,
    repeats: int,
    optimization_level: int = 0,
    max_num_batched_tokens: int = 512,
) -> dict:
    g = random.Random(0)
    vocab = ModelConfig.from_hf_dir(model).vocab_size
    common = [g.randrange(1, vocab) for _ in range(prefix)]
    batch = [common + [g.randrange(1, vocab) for _ in range(suffix)] for _ in range(prompts)]
    kw = dict(
        optimization_level=optimization_level,
        max_num_seqs=prompts,
        max_model_len=prefix + suffix + 16,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    results: dict[str, list[float]] = {"no_caching": [], "caching_cold": [], "caching_warm": []}
    hits: dict[str, int] = {}
    outputs = {}
    for _ in range(repeats):
        for name in results:
            llm = LLM(model, enable_prefix_caching=name != "no_caching", **kw)
            if name == "caching_warm":
                llm.generate([common + [7]], 1, ignore_eos=True)
            _clear(llm)
            hit0 = llm.stats.get("prefix_cache_hit_tokens", 0)
            outputs[name] = llm.generate(batch, 1, ignore_eos=True)
            results[name].append(_prefill_s(llm))
            hits[name] = llm.stats.get("prefix_cache_hit_tokens", 0) - hit0
    base = statistics.median(results["no_caching"])
    return {
        "model": model,
        "prompts": prompts,
        "prefix": prefix,
        "suffix": suffix,
        "repeats": repeats,
        "prefill_ms": {k: statistics.median(v) * 1e3 for k, v in results.items()},
        "speedup": {k: base / statistics.median(v) for k, v in results.items()},
        "hit_tokens": hits,
        "same_tokens": outputs["caching_cold"] == outputs["no_caching"] == outputs["caching_warm"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the tiny model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-O", type=int, default=0, dest="level")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_tiny_model())
    r = run(
        model,
        prompts=args.prompts,
        prefix=args.prefix,
        suffix=args.suffix,
        repeats=args.repeats,
        optimization_level=args.level,
    )
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['prompts']} prompts, common prefix {r['prefix']} + {r['suffix']} unique tokens")
    for k, ms in r["prefill_ms"].items():
        print(
            f"  {k:13s} prefill {ms:9.1f} ms  ({r['speedup'][k]:.2f}x)  "
            f"hit tokens {r['hit_tokens'][k]}"
        )
    print(f"  same tokens: {'yes' if r['same_tokens'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
