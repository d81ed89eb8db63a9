"""Cold vs warm ``LLM(...)`` in fresh processes (time after ``import torch``), side by side.

    python -m experiments.bench.warm_start [--preset default | --shape 1.1b | --model-dir DIR]
        [--level 2] [--dtype bfloat16] [--quantization int8_per_token] [--rounds 3]
        [--threads 2] [--warm-only] [--evict] [--trees DIR [DIR ...]]

Each round: one cold start (fresh piecewise cache and fresh TORCHINDUCTOR_CACHE_DIR), then
one warm start on that cache.  Prints each pair, the medians, the warm/cold ratio and the
targets (warm <= 1.0 s and <= 10% of cold for the tiny model; warm <= 2.5 s at 1.1B), and
whether a warm start imported Dynamo / Inductor's compile path.  Measure on a quiet machine.

``--warm-only`` primes one cache per tree with a single cold start and then times only warm
starts.  ``--trees A B`` runs the same starts with ``PYTHONPATH=A`` and ``PYTHONPATH=B`` (two
checkouts: before and after a change), alternated round by round, and prints both medians and
their ratio.  ``--shape 1.1b`` uses the TinyLlama-shape checkpoint of
``experiments.bench.memory`` (2.2 GB, written once under the model cache).

``--evict`` drops the checkpoint, the artifact cache and Inductor's cache from the page cache
before every warm start (``framework.core.page_cache.evict``: ``posix_fadvise(DONTNEED)``, no
privileges needed): the start of a machine whose memory was reclaimed since the last run (a
host's proactive reclaim, other processes' reads), which reads its files from disk.  Without it
the files are wherever the previous start left them, usually in memory.  Each warm start
reports the share of its mapped weights the page cache held (``weights_page_cache_frac``).

Every warm start also reports where its time went (``weights_load_s``: loading, quantizing and
re-laying the weights or mapping them from the cache; ``warm_restore_s``: the compiled
program; ``compile_s``: the warm-up forward; ``import_s``: importing the project) and the first
``generate``'s time.
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

from framework.core.page_cache import evict_tree

WORKER = """
import json, sys, time
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
t0 = time.perf_counter()
from framework import LLM, CompilationConfig
t_import = time.perf_counter()
llm = LLM(a["model"], optimization_level=a["level"], cache_dir=a["cache"],
          dtype=a["dtype"], max_num_seqs=1, max_model_len=128, quantization=a["quant"],
          compilation_config=CompilationConfig(progress_bar=False))
t1 = time.perf_counter()
out = llm.generate([[5, 6, 7, 8]], 2, ignore_eos=True)
t2 = time.perf_counter()
from framework.compat.dynamo import dynamo_imported, inductor_imported
s = llm.stats
print("RESULT" + json.dumps({"construct_s": t1 - t0, "import_s": t_import - t0,
      "generate_s": t2 - t1, "out": out,
      "traces": s["dynamo_traces"], "compiles": s["compile_compiles"],
      "weights_load_s": s.get("weights_load_s"), "weights_cache": s.get("weights_cache"),
      "warm_restore_s": s.get("warm_restore_s"), "load_s": s.get("load_s"),
      "compile_s": s.get("compile_s"), "weight_check_s": s.get("weight_check_s"),
      "weights_page_cache_frac": s.get("weights_page_cache_frac"),
      "dynamo": dynamo_imported(), "compile_fx": inductor_imported("compile_fx")}))
"""

PARTS = ("import_s", "weights_load_s", "warm_restore_s", "load_s", "compile_s", "generate_s")


def run(model: str, cache: Path, inductor: Path, args: argparse.Namespace, tree: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    env["PYTHONPATH"] = os.pathsep.join([tree] + sys.path)
    spec = {
        "model": model,
        "cache": str(cache),
        "level": args.level,
        "threads": args.threads,
        "dtype": args.dtype,
        "quant": args.quantization,
    }
    cmd = [sys.executable, "-c", WORKER, json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"startup worker failed ({tree}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def _breakdown(r: dict) -> str:
    parts = [f"{k.removesuffix('_s')} {r[k]:.2f}" for k in PARTS if r.get(k) is not None]
    held = r.get("weights_page_cache_frac")
    return ", ".join(parts) + (
        f" [weights cache: {r['weights_cache']}"
        + (f", {100 * held:.0f}% in the page cache" if held is not None else "")
        + "]"
        if "weights_cache" in r
        else ""
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--shape", choices=["tiny", "1.1b"], default="tiny")
    p.add_argument("--model-dir")
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--evict", action="store_true", help="warm starts find their files on disk")
    p.add_argument("--trees", nargs="+", default=None)
    args = p.parse_args(argv)
    here = str(Path(__file__).resolve().parents[2])
    trees = [str(Path(t).resolve()) for t in (args.trees or [here])]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_dir
        if model is None and args.shape == "1.1b":
            from experiments.bench.memory import ensure_checkpoint

            model = str(ensure_checkpoint())
        elif model is None:
            from models.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "model", args.preset, seed=0))
        cold: dict[str, list] = {t: [] for t in trees}
        warm: dict[str, list] = {t: [] for t in trees}
        outs: dict[str, list] = {}
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for i, tree in enumerate(order):
                tag = f"t{trees.index(tree)}"
                if args.warm_only:
                    cache, inductor = Path(tmp) / f"cache-{tag}", Path(tmp) / f"inductor-{tag}"
                    if r == 0 and not cache.exists():
                        c = run(model, cache, inductor, args, tree)
                        cold[tree].append(c["construct_s"])
                        outs[tree] = c["out"]
                        print(f"[{tag}] primed: cold {c['construct_s']:.2f} s ({_breakdown(c)})")
                else:
                    cache, inductor = Path(tmp) / f"cache{r}-{tag}", Path(tmp) / f"ind{r}-{tag}"
                    c = run(model, cache, inductor, args, tree)
                    cold[tree].append(c["construct_s"])
                    outs[tree] = c["out"]
                if args.evict:
                    kept = evict_tree(Path(model), cache, inductor)  # bytes still held
                    if kept:
                        print(f"  (the page cache kept {kept / 1e6:.1f} MB of them)")
                w = run(model, cache, inductor, args, tree)
                assert w["out"] == outs[tree] and w["traces"] == 0 and w["compiles"] == 0, w
                warm[tree].append(w["construct_s"])
                print(
                    f"round {r} [{tag} {tree}]: warm {w['construct_s']:.2f} s ({_breakdown(w)}; "
                    f"imported dynamo={w['dynamo']}, compile_fx={w['compile_fx']})",
                    flush=True,
                )
    outs_same = len({json.dumps(o) for o in outs.values()}) <= 1
    result: dict = {"trees": {}}
    for i, tree in enumerate(trees):
        res = {
            "warm_s": statistics.median(warm[tree]),
            "warm_all": warm[tree],
            "evicted": bool(args.evict),
        }
        if cold[tree]:
            res["cold_s"] = statistics.median(cold[tree])
            res["ratio"] = res["warm_s"] / res["cold_s"]
        result["trees"][tree] = res
        spread = max(warm[tree]) / min(warm[tree])
        print(
            f"[t{i}] {tree}: median warm {res['warm_s']:.2f} s (max/min {spread:.2f})"
            + (f", cold {res['cold_s']:.2f} s, warm/cold {res['ratio']:.3f}" if cold[tree] else "")
        )
    if len(trees) > 1:
        base = result["trees"][trees[0]]["warm_s"]
        for tree in trees[1:]:
            print(f"warm {tree} / {trees[0]}: {result['trees'][tree]['warm_s'] / base:.3f}")
        print(f"greedy outputs equal across trees: {outs_same}")
    last = result["trees"][trees[-1]]
    result["warm_s"] = last["warm_s"]
    from experiments.bench import targets

    target = (
        targets.PEER_WARM_S_TARGET
        if args.shape == "1.1b" or args.model_dir
        else targets.WARM_S_TARGET
    )
    print(f"target warm <= {target} s: {'met' if last['warm_s'] <= target else 'NOT met'}")
    if "ratio" in last:
        result["cold_s"], result["ratio"] = last["cold_s"], last["ratio"]
        frac = targets.WARM_FRAC_TARGET
        print(f"warm/cold <= {frac}: {'met' if last['ratio'] <= frac else 'NOT met'}")
    return result


if __name__ == "__main__":
    main()
