"""Cold vs warm ``LLM(...)`` in fresh processes (time after ``import torch``), side by side.

    python -m experiments.bench_warm_start [--preset default] [--level 2] [--dtype bfloat16]
        [--rounds 3] [--threads 2]

Each round: one cold start (fresh piecewise cache and fresh TORCHINDUCTOR_CACHE_DIR), then
one warm start on that cache.  Prints each pair, the medians, the warm/cold ratio and the
issue-9 targets (warm <= 1.0 s and <= 10% of cold), and whether a warm start imported
Dynamo / Inductor's compile path.  Measure on a quiet machine.
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

WORKER = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[4]))
t0 = time.perf_counter()
from framework import LLM, CompilationConfig
llm = LLM(sys.argv[1], optimization_level=int(sys.argv[3]), cache_dir=sys.argv[2],
          dtype=sys.argv[5], max_num_seqs=1, max_model_len=128,
          compilation_config=CompilationConfig(progress_bar=False))
t1 = time.perf_counter()
out = llm.generate([[5, 6, 7, 8]], 2, ignore_eos=True)
from framework.compat.dynamo import dynamo_imported, inductor_imported
print("RESULT" + json.dumps({"construct_s": t1 - t0, "out": out,
      "traces": llm.stats["dynamo_traces"], "compiles": llm.stats["compile_compiles"],
      "dynamo": dynamo_imported(), "compile_fx": inductor_imported("compile_fx")}))
"""


def run(model: str, cache: Path, inductor: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] + sys.path)
    cmd = [sys.executable, "-c", WORKER, model, str(cache), str(args.level), str(args.threads)]
    proc = subprocess.run(cmd + [args.dtype], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"startup worker failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model-dir")
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_dir
        if model is None:
            from models.tiny import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "model", args.preset, seed=0))
        cold, warm = [], []
        for r in range(args.rounds):
            cache, inductor = Path(tmp) / f"cache{r}", Path(tmp) / f"inductor{r}"
            c = run(model, cache, inductor, args)
            w = run(model, cache, inductor, args)
            assert w["out"] == c["out"] and w["traces"] == 0 and w["compiles"] == 0, (c, w)
            cold.append(c["construct_s"])
            warm.append(w["construct_s"])
            print(
                f"round {r}: cold {c['construct_s']:.2f} s, warm {w['construct_s']:.2f} s "
                f"(warm imported dynamo={w['dynamo']}, compile_fx={w['compile_fx']})"
            )
    result = {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}
    result["ratio"] = result["warm_s"] / result["cold_s"]
    print(
        f"median cold {result['cold_s']:.2f} s, warm {result['warm_s']:.2f} s, "
        f"warm/cold {result['ratio']:.3f}\n"
        f"target warm <= 1.0 s: {'met' if result['warm_s'] <= 1.0 else 'NOT met'}; "
        f"warm/cold <= 0.10: {'met' if result['ratio'] <= 0.10 else 'NOT met'}"
    )
    return result


if __name__ == "__main__":
    main()
