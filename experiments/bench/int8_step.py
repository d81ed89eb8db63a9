"""int8 against bf16 end to end: the O2 batch-1 decode of one model in three builds, side by
side in one process.

    python -m experiments.bench.int8_step [--model-dir DIR | --layers 22] [--rounds 3]
        [--steps 32] [--prompt-len 64] [--threads 2] [--variants bf16 int8 int8_int_mm]

Variants (each an ``LLM`` at O2, greedy, batch 1; ``--model-dir`` default: the 1.1B
TinyLlama-shape checkpoint of ``experiments.bench.memory``, written on first use):

* ``bf16``: no quantization (the bf16 small-M kernel);
* ``int8``: ``int8_per_token`` with the small-M int8 kernel (the default);
* ``int8_int_mm``: ``int8_per_token`` with ``kernel_config.int8_small_m_max_rows = 0`` (plain
  int8 weights, ``dynamic_per_token_quant`` + ``torch._int_mm``: the path before the kernel);
* ``int8_wo``: ``int8_per_channel_weight_only`` with the kernel.

Rounds alternate the variants (the first rotating).  Per round and variant: the median decode
step (the runner's own step times) of one generation, and the per-token wall time through
``LLM.generate``, ``(t(prompt + steps + 8 new) - t(prompt + 8 new)) / steps`` (host work
included, as the peers benchmark measures).  The table gives medians over the rounds, the
speed-up against bf16, and each int8 variant's greedy tokens against bf16's: how many agree and
the first step where they differ.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Optional

import torch

from experiments.bench.contenders import Piecewise
from experiments.bench.measure import make_prompts, timed_generation

VARIANTS = {
    "bf16": (None, {}),
    "int8": ("int8_per_token", {}),
    "int8_int_mm": ("int8_per_token", {"int8_small_m_max_rows": 0}),
    "int8_wo": ("int8_per_channel_weight_only", {}),
}


def build(name: str, path: str, cache_dir: str, max_len: int):
    from framework import LLM, CompilationConfig

    quantization, kernel = VARIANTS[name]
    return LLM(
        path,
        dtype="bfloat16",
        quantization=quantization,
        cache_dir=cache_dir,
        max_num_seqs=1,
        max_model_len=max_len,
        compilation_config=CompilationConfig(level=2, progress_bar=False, kernel_config=kernel),
    )


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def run(args: argparse.Namespace) -> list[dict]:
    if args.model_dir:
        path = args.model_dir
    else:
        from experiments.bench.memory import ensure_checkpoint

        path = str(ensure_checkpoint(args.layers))
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pw_int8_step_")
    max_len = args.prompt_len + args.steps + 16
    llms = {}
    for name in args.variants:
        t0 = time.perf_counter()
        llms[name] = Piecewise(name, build(name, path, cache_dir, max_len))
        print(f"# built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = next(iter(llms.values())).llm.model_config.vocab_size
    prompts = make_prompts(1, args.prompt_len, vocab)
    tokens, step_ms, token_ms = {}, {n: [] for n in llms}, {n: [] for n in llms}
    for c in llms.values():  # warm-up: thread pool, first calls
        tokens[c.name], _ = timed_generation(c, prompts, args.steps)
    names = list(llms)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            c = llms[name]
            _, times = timed_generation(c, prompts, args.steps)
            step_ms[name].append(statistics.median(times) * 1e3)
            short = c.time_generate(prompts, 8)
            long = c.time_generate(prompts, 8 + args.steps)
            token_ms[name].append((long - short) / args.steps * 1e3)
            print(
                f"# round {r} {name}: decode step {step_ms[name][-1]:.2f} ms, "
                f"{token_ms[name][-1]:.2f} ms/token",
                flush=True,
            )
    base = statistics.median(token_ms["bf16"]) if "bf16" in llms else None
    ref = tokens.get("bf16")
    rows = []
    for name in names:
        tok = statistics.median(token_ms[name])
        row = {
            "variant": name,
            "step_ms": statistics.median(step_ms[name]),
            "token_ms": tok,
            "token_ms_rounds": token_ms[name],
            "vs_bf16": base / tok if base else None,
        }
        if ref is not None and name != "bf16":
            a, b = tokens[name][0], ref[0]
            row["agree"] = sum(x == y for x, y in zip(a, b))
            row["of"] = len(b)
            row["first_diff"] = first_difference(a, b)
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--variants", nargs="+", default=["bf16", "int8", "int8_int_mm"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="artifact cache root (default: a fresh temp dir)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"# O2 b1, {args.threads} threads, medians of {args.rounds} alternated rounds")
    print(
        "| variant | decode step ms | ms / token | rounds | vs bf16 | tokens = bf16 | first diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rounds = ", ".join(f"{t:.1f}" for t in r["token_ms_rounds"])
        vs = f"{r['vs_bf16']:.2f}x" if r["vs_bf16"] else "-"
        agree = f"{r['agree']}/{r['of']}" if "agree" in r else "-"
        diff = r.get("first_diff", "-")
        print(
            f"| {r['variant']} | {r['step_ms']:.2f} | {r['token_ms']:.2f} | {rounds} | {vs} | "
            f"{agree} | {'none' if diff is None else diff} |"
        )
    return rows


if __name__ == "__main__":
    main()
