"""Side-by-side decode benchmark: this project at O0/O1/O2 against stock transformers paths.

    python -m experiments.bench.vs_hf --out bench.json                  # the full comparison
    python -m experiments.bench.vs_hf --preset test-llama --steps 4 --rounds 2 --threads 1
    python -m experiments.bench.vs_hf --dtypes bfloat16 --batches 1 --contenders hf_static O2
    python -m experiments.bench.vs_hf --dtypes bfloat16 --rounds 3 --threads 2  # the table

Contenders (one process, same model weights, same prompts):
  hf_eager    (a) transformers eager, DynamicCache, manual greedy loop
  hf_compile  (b) ``torch.compile(hf_model, dynamic=True)``, same loop
  hf_static   (c) transformers + StaticCache, the decode step compiled with
              ``torch.compile(fullgraph=True)`` under ``torch._inductor.config.freezing = True``
  O0, O1, O2  (d) this project's ``LLM`` at that optimization level (``ignore_eos=True``)

Workload: one ``--prompt-len`` prompt per sequence, then ``--steps`` decode steps.  A decode
step is timed the same way for every contender: build the step's inputs, forward, argmax,
read the tokens back to the host (the project's runner times exactly that per step).  The
first ``--warmup-steps`` steps of every generation are dropped.  A second workload,
``--long-batch`` sequences of ``--long-prompt-len`` tokens (default 32 x 400), measures where
paged attention matters.  Per generated token through ``LLM.generate`` (host work included):
(t(``--generate-tokens`` new) - t(8 new)) / (``--generate-tokens`` - 8), batch 1, median of
the rounds.  The weights' streaming floor of a decode step: every weight but the embedding
table read once at this machine's measured read bandwidth.  The attention rows come from
``experiments.bench.attention`` (``--skip-attention`` leaves them out).  Every target
(``experiments.bench.targets``) is printed with its ratio and met / NOT met.

Measurement hygiene (shared, noisy CPUs): after one untimed warm-up generation per contender,
``--rounds`` rounds run every contender once each, round-robin with a rotating start, so all
contenders see the same background noise; medians and p90s are over all kept steps of all
rounds.  Python's GC is off during a timed generation.  ``--threads N`` sets
``torch.set_num_threads`` (use 1 when the machine is shared: OpenMP oversubscription makes
multi-threaded timings 10-100x noisy).

Cold compile (first prefill + first decode; for the project: ``LLM`` construction, which
compiles, + first prefill + first decode) and warm start are measured in fresh subprocesses:
cold with a fresh ``TORCHINDUCTOR_CACHE_DIR`` and piecewise cache dir per contender, warm in a
second process on the same dirs (the project: the process's ``LLM`` construction time,
``after_torch_s`` = importing the framework (timed right after ``import torch``, before the
benchmark's own modules) + constructing, and whether Dynamo was skipped; (b): first prefill +
first decode on the warm Inductor cache).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from experiments.bench import targets as bench_targets
from experiments.bench.contenders import Contender, HFLoop, HFStatic, Piecewise, build_llm, load_hf
from experiments.bench.measure import (  # noqa: F401  (agreement, percentile: re-exported)
    SHORT_GENERATION,
    agreement,
    make_prompts,
    measure_attention,
    measure_latency,
    measure_per_token,
    percentile,
    streaming_floor,
)
from experiments.bench.targets import LABELS
from framework.compat import dynamo as compat_dynamo

ROOT = Path(__file__).resolve().parents[2]
HF_CONTENDERS = ("hf_eager", "hf_compile", "hf_static")
LEVELS = {"O0": 0, "O1": 1, "O2": 2}
ALL_CONTENDERS = HF_CONTENDERS + tuple(LEVELS)
COLD_CONTENDERS = ("hf_compile", "hf_static", "O1", "O2")
"""Contenders whose cold start compiles (the eager ones have nothing to measure)."""
WARM_CONTENDERS = ("hf_compile", "O1", "O2")
RESULT_MARK = "BENCH_VS_HF_RESULT "


def build_contenders(
    names: list[str], path: str, dtype: str, args: argparse.Namespace, cache_dir: str
) -> list[Contender]:
    hf = load_hf(path, dtype) if any(n in HF_CONTENDERS for n in names) else None
    out: list[Contender] = []
    for n in names:
        if n == "hf_eager":
            out.append(HFLoop(n, hf, hf))
        elif n == "hf_compile":
            out.append(HFLoop(n, hf, torch.compile(hf, dynamic=True)))
        elif n == "hf_static":
            out.append(HFStatic(hf))
        else:
            out.append(
                Piecewise(
                    n,
                    build_llm(
                        LEVELS[n], path, dtype, cache_dir, max_batch(args), max_model_len(args)
                    ),
                )
            )
    return out


def max_model_len(args: argparse.Namespace) -> int:
    longest = max(args.prompt_len, args.long_prompt_len if args.long_batch else 0)
    return max(512, longest + args.steps + 1, args.prompt_len + args.generate_tokens + 1)


def max_batch(args: argparse.Namespace) -> int:
    return max(args.batches + [args.long_batch])


def workloads(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(batch, prompt length) of every latency workload."""
    out = [(b, args.prompt_len) for b in args.batches]
    if args.long_batch and (args.long_batch, args.long_prompt_len) not in out:
        out.append((args.long_batch, args.long_prompt_len))
    return out


# ----------------------------------------------------------------------------- startup
def startup_worker(args: argparse.Namespace, framework_import_s: Optional[float] = None) -> dict:
    """Runs in a fresh process: model load, then compile / first prefill / first decode.
    ``framework_import_s``: seconds the launcher spent importing the framework right after
    ``import torch``, when it measured them."""
    name, dtype, path = args.worker, args.dtypes[0], model_path(args)
    prompt = make_prompts(1, args.prompt_len, _vocab_size(path))
    res: dict[str, Any] = {"contender": name, "dtype": dtype}
    t0 = time.perf_counter()
    if name in LEVELS:
        llm = build_llm(LEVELS[name], path, dtype, args.cache_dir, 1, max_model_len(args))
        t1 = time.perf_counter()
        llm.generate(prompt, max_new_tokens=2, ignore_eos=True)
        t2 = time.perf_counter()
        st = llm.stats
        res.update(
            construct_s=t1 - t0,
            after_torch_s=(
                (t1 - t0) + framework_import_s if framework_import_s is not None else None
            ),
            first_steps_s=t2 - t1,
            total_s=t2 - t0,
            # load_s: LLM setup before the warm-up forward (weights, and on a warm
            # start the artifact restore, warm_restore_s, which is part of it)
            load_s=st.get("load_s"),
            warm_restore_s=st.get("warm_restore_s"),
            warmup_compile_s=st.get("compile_s"),
            dynamo_skipped=bool(st.get("dynamo_skipped")),
            dynamo_time_s=st.get("dynamo_time_s"),
            compiles=st.get("compile_compiles"),
            loads=st.get("compile_loads"),
            cache_hits=st.get("cache_hits"),
            cache_misses=st.get("cache_misses"),
        )
        return res
    hf = load_hf(path, dtype)
    t1 = time.perf_counter()
    if name == "hf_static":
        c: Contender = HFStatic(hf)
    else:
        c = HFLoop(name, hf, torch.compile(hf, dynamic=True) if name == "hf_compile" else hf)
    c.generate(prompt, 1)
    t2 = time.perf_counter()
    res.update(load_s=t1 - t0, first_steps_s=t2 - t1, total_s=t2 - t0)
    return res


def run_worker(
    name: str, dtype: str, args: argparse.Namespace, inductor_dir: Path, cache_dir: Path
) -> dict:
    # The launcher notes the time right after `import torch`, imports the framework's entry
    # point and notes the time again: the warm-start target counts that import plus the
    # construction, not the import of this benchmark (which brings transformers and the
    # HF contenders: ~1.8 s that a user of the framework does not pay).
    launcher = (
        "import sys, time, torch; t = time.perf_counter(); "
        "import framework.engine.llm; t = time.perf_counter() - t; "
        "from experiments.bench import vs_hf as bench_vs_hf; "
        "bench_vs_hf.main(sys.argv[1:], framework_import_s=t)"
    )
    cmd = [
        sys.executable,
        "-c",
        launcher,
        "--worker",
        name,
        "--dtypes",
        dtype,
        "--prompt-len",
        str(args.prompt_len),
        "--cache-dir",
        str(cache_dir),
    ]
    cmd += ["--model-dir", args.model_dir] if args.model_dir else ["--preset", args.preset]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(inductor_dir),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.worker_timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"startup worker {name} ({dtype}) failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    res = json.loads(lines[-1][len(RESULT_MARK) :])
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def measure_startup(
    names: list[str], dtype: str, args: argparse.Namespace, work: Path, log: Callable
) -> list[dict]:
    rows = []
    for name in [n for n in names if n in COLD_CONTENDERS]:
        ind, pw = work / f"inductor-{name}-{dtype}", work / f"piecewise-{name}-{dtype}"
        for d in (ind, pw):
            shutil.rmtree(d, ignore_errors=True)  # cold means cold, whatever ran before
            d.mkdir(parents=True)
        cold = run_worker(name, dtype, args, ind, pw)
        row = {"dtype": dtype, "contender": name, "cold": cold}
        # What the targets compare: (b)/(c): first prefill + first decode; the project: LLM
        # construction (includes compile and weight load) + first prefill + first decode.
        row["cold_s"] = cold["total_s"] if name in LEVELS else cold["first_steps_s"]
        log(f"  cold {name} {dtype}: {row['cold_s']:.1f}s")
        if name in WARM_CONTENDERS:
            warm = run_worker(name, dtype, args, ind, pw)
            row["warm"] = warm
            row["warm_s"] = warm["construct_s"] if name in LEVELS else warm["first_steps_s"]
            log(f"  warm {name} {dtype}: {row['warm_s']:.2f}s")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    lines = [
        "| dtype | batch | prompt | contender | decode median ms | p90 ms | O2 speed-up vs it |"
        " tokens = ref | stable |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lat = result["latency"]
    key = lambda r: (r["dtype"], r["batch"], r.get("prompt_len"))  # noqa: E731
    o2 = {key(r): r["median_ms"] for r in lat if r["contender"] == "O2"}
    for r in lat:
        base = o2.get(key(r))
        sp = f"{r['median_ms'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r.get('prompt_len', '-')} | "
            f"{LABELS[r['contender']]} | "
            f"{r['median_ms']:.3f} | {r['p90_ms']:.3f} | {sp} | "
            f"{100 * r['token_agreement']:.1f}% vs {r['agreement_ref']} | "
            f"{'yes' if r['tokens_stable_across_rounds'] else 'NO'} |"
        )
    if result["startup"]:
        lines += [
            "",
            "| dtype | contender | cold s | warm s | warm dynamo skipped | cold: load s |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["startup"]:
            warm_s = f"{r['warm_s']:.2f}" if "warm_s" in r else "-"
            skipped = r.get("warm", {}).get("dynamo_skipped", "-")
            lines.append(
                f"| {r['dtype']} | {LABELS[r['contender']]} | {r['cold_s']:.2f} | "
                f"{warm_s} | {skipped} | {r['cold']['load_s']:.2f} |"
            )
    for r in result.get("per_token", []):
        lines += [
            "",
            f"per generated token through LLM.generate, {r['dtype']} b{r['batch']} "
            f"{LABELS[r['contender']]}: {r['per_token_ms']:.3f} ms "
            f"((best t({r['new_tokens'][1]}) - best t({r['new_tokens'][0]})) / "
            f"{r['new_tokens'][1] - r['new_tokens'][0]})",
        ]
    if result.get("floor"):
        f = result["floor"]
        lines += [
            "",
            f"weights' streaming floor: {f['weight_bytes'] / 1e6:.1f} MB at "
            f"{f['bandwidth_gb_s']:.1f} GB/s = {f['floor_ms']:.3f} ms",
        ]
    if result["targets"]:
        lines += ["", *bench_targets.markdown(result["targets"])]
    fp32 = [r for r in lat if r["dtype"] == "float32"]
    if fp32:
        bad = [f"{r['contender']} b{r['batch']}" for r in fp32 if r["token_agreement"] < 1]
        lines += [
            "",
            "fp32 greedy-token agreement: "
            + ("all contenders agree" if not bad else f"DISAGREE: {', '.join(bad)}"),
        ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def model_path(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    from models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(preset=args.preset))


def _vocab_size(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="default", help="models.tiny preset (default: default)")
    p.add_argument("--model-dir", help="an HF checkpoint folder instead of a preset")
    p.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--contenders", nargs="+", default=list(ALL_CONTENDERS), choices=ALL_CONTENDERS)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument(
        "--long-batch",
        type=int,
        default=32,
        help="batch of the long-prompt workload (0: skip it)",
    )
    p.add_argument("--long-prompt-len", type=int, default=400)
    p.add_argument(
        "--generate-tokens",
        type=int,
        default=72,
        help="new tokens of the long generation of the per-token-through-generate figure",
    )
    p.add_argument(
        "--skip-attention", action="store_true", help="skip the attention micro-benchmark"
    )
    p.add_argument("--steps", type=int, default=32, help="decode steps per generation")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="decode steps dropped at the start of every generation",
    )
    p.add_argument("--rounds", type=int, default=10, help="round-robin measurement rounds")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--skip-startup", action="store_true", help="skip the cold/warm start subprocesses"
    )
    p.add_argument("--work-dir", help="keep the cache dirs here (default: a temp dir, removed)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker-timeout", type=float, default=3600)
    p.add_argument("--worker", choices=ALL_CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("prompt_len", "steps", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be in [0, --steps)")
    if any(b <= 0 for b in args.batches):
        p.error("--batches must be positive")
    if args.long_batch < 0 or args.long_prompt_len <= 0:
        p.error("--long-batch must be >= 0 and --long-prompt-len positive")
    if args.generate_tokens <= SHORT_GENERATION:
        p.error(f"--generate-tokens must be > {SHORT_GENERATION}")
    if args.threads is not None and args.threads <= 0:
        p.error("--threads must be positive")
    return args


def versions() -> dict[str, str]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }


def main(argv: Optional[list[str]] = None, framework_import_s: Optional[float] = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "hf_compile" in args.contenders:
        compat_dynamo.set_recompile_limit(64)  # (b) recompiles per dtype and batch size
    if args.worker:
        print(RESULT_MARK + json.dumps(startup_worker(args, framework_import_s)), flush=True)
        return {}

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_vs_hf-"))
    work.mkdir(parents=True, exist_ok=True)
    # This process's compiles go to their own fresh Inductor cache (read lazily by Inductor).
    saved_inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-main")
    path = model_path(args)
    vocab = _vocab_size(path)
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "cache_dir")},
        "model_dir": path,
        "versions": versions(),
        "latency": [],
        "per_token": [],
        "attention": [],
        "floor": None,
        "startup": [],
    }
    order = [c for c in ALL_CONTENDERS if c in args.contenders]
    try:
        for dtype in args.dtypes:
            log(f"[{dtype}] building {order}")
            contenders = build_contenders(order, path, dtype, args, str(work / "piecewise-main"))
            for batch, plen in workloads(args):
                result["latency"] += measure_latency(
                    contenders, dtype, batch, args, vocab, log, prompt_len=plen
                )
            result["per_token"] += measure_per_token(contenders, dtype, args, vocab)
            if dtype == "bfloat16":
                result["floor"] = streaming_floor(contenders, args)
            del contenders
            gc.collect()
        if not args.skip_attention:
            for dtype in args.dtypes:
                log(f"[{dtype}] attention micro-benchmark")
                result["attention"] += measure_attention(dtype, args)
        if not args.skip_startup:
            for dtype in args.dtypes:
                result["startup"] += measure_startup(order, dtype, args, work, log)
    finally:
        if saved_inductor_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_inductor_dir
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result["targets"] = bench_targets.targets(
        result["latency"],
        result["startup"],
        per_token=result["per_token"],
        attention=[r for r in result["attention"] if r["dtype"] == "bfloat16"],
        floor=result["floor"],
        long_prompt_len=args.long_prompt_len if args.long_batch else None,
    )
    result["markdown"] = markdown(result)
    print(result["markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
