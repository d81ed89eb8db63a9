"""Two checkouts of this project side by side: the same decode and prefill timings from each,
fresh processes alternated, medians and ratios (is a change speed-neutral?).

    python -m experiments.bench.ab_trees --trees /path/to/main /path/to/branch
        [--rounds 5] [--threads 2] [--batches 1 8] [--model-dir DIR] [--dtype bfloat16]

Each round runs one fresh process per tree (the order alternating between rounds) with that
tree first on ``PYTHONPATH``; the process builds ``LLM(level=2)`` on the model (default: the
default tiny model) with a per-tree artifact cache (so only the first round compiles), then
times, per batch size, a greedy generation of 8 and of 72 new tokens after 64-token prompts --
per decode step = (t72 - t8) / 64 -- and one 256-token prefill.  It also returns the greedy
tokens, which must agree between the trees.  Only the public ``LLM`` API is used, so any two
versions of the project compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

_CHILD = r"""
import json, sys, time, torch
from framework import LLM, CompilationConfig
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
llm = LLM(args["model"], dtype=args["dtype"], max_num_seqs=max(args["batches"]),
          max_model_len=400, compilation_config=CompilationConfig(
              level=2, cache_dir=args["cache"], progress_bar=False))
g = torch.Generator().manual_seed(0)
out = {"decode_ms": {}, "tokens": {}}
for b in args["batches"]:
    prompts = [torch.randint(1000, 30000, (64,), generator=g).tolist() for _ in range(b)]
    llm.generate(prompts, 8, ignore_eos=True)  # warm-up
    t0 = time.perf_counter(); llm.generate(prompts, 8, ignore_eos=True)
    t8 = time.perf_counter() - t0
    t0 = time.perf_counter(); toks = llm.generate(prompts, 72, ignore_eos=True)
    t72 = time.perf_counter() - t0
    out["decode_ms"][str(b)] = (t72 - t8) / 64 * 1e3
    out["tokens"][str(b)] = toks
long = [torch.randint(1000, 30000, (256,), generator=g).tolist()]
llm.generate(long, 1, ignore_eos=True)
t0 = time.perf_counter(); llm.generate(long, 1, ignore_eos=True)
out["prefill256_ms"] = (time.perf_counter() - t0) * 1e3
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(tree: str, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    payload = {
        "model": args.model_dir,
        "dtype": args.dtype,
        "threads": args.threads,
        "batches": args.batches,
        "cache": cache,
    }
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(payload)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if args.model_dir is None:
        from models.tiny import ensure_tiny_model

        args.model_dir = str(ensure_tiny_model())
    trees = [str(Path(t).resolve()) for t in args.trees]
    samples: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    # Per-tree artifact caches, removed at the end: with a 1.1B model each holds ~2.2 GB of
    # packed weights, and runs that left them behind filled the disk, after which the tree
    # whose cache could not be written ran slower (a bias of the runs, not of the trees).
    with tempfile.TemporaryDirectory(prefix="pw_ab_") as root:
        caches = {t: str(Path(root) / f"tree{i}") for i, t in enumerate(trees)}
        for r in range(args.rounds):
            for t in trees if r % 2 == 0 else trees[::-1]:
                samples[t].append(_run(t, args, caches[t]))
                decode = json.dumps(samples[t][-1]["decode_ms"])
                print(f"# round {r + 1} {t}: {decode}", flush=True)
    a, b = trees
    same = all(x["tokens"] == samples[a][0]["tokens"] for t in trees for x in samples[t])
    rows = []
    metrics = [f"decode b{n} ms" for n in args.batches] + ["prefill 256 ms"]
    for m in metrics:
        get = (
            (lambda s: s["prefill256_ms"])
            if m.startswith("prefill")
            else (lambda s, n=m.split()[1][1:]: s["decode_ms"][n])
        )
        ma = statistics.median(get(s) for s in samples[a][1:] or samples[a])
        mb = statistics.median(get(s) for s in samples[b][1:] or samples[b])
        rows.append({"metric": m, "A": ma, "B": mb, "B/A": mb / ma})
    print(
        f"# A = {a}\n# B = {b}\n# {args.rounds} rounds (first dropped: compiles), "
        f"{args.threads} threads, {args.dtype}; greedy tokens identical: {same}"
    )
    print("| metric | A | B | B/A |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['metric']} | {r['A']:.3f} | {r['B']:.3f} | {r['B/A']:.3f} |")
    return {"rows": rows, "tokens_identical": same}


if __name__ == "__main__":
    main()
