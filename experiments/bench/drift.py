"""Whose is the spread: decode steps timed over minutes in long-lived processes, one per
contender, alternated window by window, beside what the machine gave at the same moments.

    python -m experiments.bench.drift [--size 1.1b | --model-dir DIR]
        [--contenders project_bf16 llamacpp_bf16] [--windows 24] [--new-tokens 8 40]
        [--threads 2] [--variant NAME=KEY=VALUE[,KEY=VALUE...]] [--tree NAME=PATH]
        [--out FILE.json]

The peers bench times every contender in fresh processes and finds the project's 1.1B b1
step spread over them (max / min of 4: 1.17-1.39 on the VMs measured) where llama.cpp's stays
near 1.06.  A spread between processes can be the process's own (where its weights lie, how
its threads run) or the machine's at the time the process ran (what the host lets the VM have
of its memory bandwidth and cores).  This bench tells them apart: it keeps one process per
contender alive (``experiments.bench.peer_worker``'s runners: the same engines and weights as
the peers bench) and alternates short windows among them for minutes; after each of its
windows the project's process also

* reads its own weights where they lie with the native probe
  (:func:`experiments.bench.bandwidth.read_tensors`, method ``plain``, best of 3): the rate the
  memory gives those very pages just then;
* times a float32 product that fits in the L2 cache (``torch.mm`` 128x128x128, 200 times):
  the cores' speed just then (clock, a host thread sharing the core), no memory involved.

Per window: one generation of ``short`` and one of ``long`` new tokens from one
``--prompt-len`` token prompt; per step = (t(long) - t(short)) / (long - short), as in the peers
bench; for the project its own step timer's median too.  The machine's load per window
(hypervisor steal, other processes' share: :mod:`experiments.bench.process_facts`).

``--variant bind=OMP_PROC_BIND=true,OMP_PLACES=cores`` adds a second project process, started
with those environment variables, to the alternation (``project_bf16@bind``): an A/B of a
process-level setting that the machine's drift cannot bias, since both processes see the
same minutes.  ``--tree block=/path/to/worktree`` does the same for a source tree (a ``git
worktree`` of another revision or of a change under test): its process runs that tree's
code, kernels included (``project_bf16@block``), against this tree's in alternate windows.

Reported: each series' median, min, max and spread (max / min) over the windows (with the
project's step over its floor at the read rate probed right after it: streamed bytes / that
rate), for every process after the first its step time over the first's window by window
(median, min, max, and in how many windows it was faster: the A/B statistic), and the
Pearson correlation over the windows of the project's streaming rate (streamed bytes / step)
with its weights' read rate, with the compute rate, and with llama.cpp's step rate.  Reading:
a spread inside one long-lived process as large as the one between fresh processes, moving
with the weights' read rate, is the machine's memory bandwidth over time, not the process; a
contender whose step does not follow the read rate is bound by something else (its compute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

CONTENDERS = ("project_bf16", "project_int8", "llamacpp_bf16", "llamacpp_q8_0")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the worker
def _compute_rate(threads: int, reps: int = 200) -> float:
    """GFLOP/s of ``torch.mm`` on 128x128 float32 operands (in cache), best of 3 batches."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g)
    out = torch.empty(128, 128)
    for _ in range(20):
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * 128**3 * reps / best / 1e9


def _probe(runner: Any, threads: int) -> dict[str, float]:
    from experiments.bench import bandwidth
    from experiments.bench.process_facts import smaps_rollup

    model = runner.llm.model
    tensors = list(model.parameters()) + list(model.buffers())
    row = bandwidth.read_tensors(tensors, threads=threads, repeats=3, method="plain")
    backing = smaps_rollup()
    return {
        "weights_read_gb_s": row["best_gb_s"],
        "weights_read_bytes": row["bytes"],
        "compute_gflop_s": _compute_rate(threads),
        # how much of the process's memory is in 2 MB pages just then (khugepaged collapses
        # mappings over minutes; a fresh process may start with few)
        "file_pmd_mapped_mb": backing.get("FilePmdMapped", 0) / 2**20,
        "anon_huge_mb": backing.get("AnonHugePages", 0) / 2**20,
    }


def serve(job: dict[str, Any]) -> None:
    """One contender, kept alive: answers ``window`` / ``probe`` / ``quit`` lines on stdin
    with one JSON line each on the original stdout (everything else the libraries print goes
    to stderr)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from experiments.bench.peer_worker import build_runner

    t = time.perf_counter()
    runner = build_runner(job)
    prompt = job["prompt"]
    short, long_ = job["new_tokens"]
    reference = runner.generate([prompt], long_)[0]  # warm-up and the window's tokens
    proto.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t}) + "\n")
    for line in sys.stdin:
        op = line.strip()
        if op == "quit":
            break
        if op == "window":
            times = {}
            same = True
            for n in (short, long_):
                t0 = time.perf_counter()
                out = runner.generate([prompt], n)[0]
                times[n] = time.perf_counter() - t0
                same = same and out == reference[:n]
            res: dict[str, Any] = {
                "step_ms": (times[long_] - times[short]) / (long_ - short) * 1e3,
                "tokens_same": same,
            }
            decode = getattr(runner, "decode_times", None)
            if decode:
                res["timer_median_ms"] = statistics.median(decode) * 1e3
            proto.write(json.dumps(res) + "\n")
        elif op == "probe":
            proto.write(json.dumps(_probe(runner, job["threads"])) + "\n")
        else:
            proto.write(json.dumps({"error": f"unknown op {op!r}"}) + "\n")
    runner.close()


# ----------------------------------------------------------------------------- the driver
class Worker:
    def __init__(
        self,
        job: dict[str, Any],
        threads: int,
        env_extra: dict[str, str],
        tree: Optional[str] = None,
    ):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **env_extra)
        if tree:  # the tree's packages first (python -m puts the working directory first)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
        self.name = job.get("name", job["contender"])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench.drift", "--serve", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"drift: the {self.name} worker exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, op: str) -> dict[str, Any]:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        self.proc.wait(timeout=120)


def spread(values: list[float]) -> dict[str, Optional[float]]:
    """Median, min, max and max / min (None where a value is not positive: a window whose
    t(long) - t(short) the machine's noise outweighed, possible with few new tokens)."""
    lo = min(values)
    return {
        "median": statistics.median(values),
        "min": lo,
        "max": max(values),
        "spread": max(values) / lo if lo > 0 else None,
    }


def correlation(xs: list[float], ys: list[float]) -> Optional[float]:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def summarize(windows: list[dict[str, Any]], streamed: dict[str, int]) -> dict[str, Any]:
    """Series, spreads and correlations over the windows (see the module docstring)."""
    out: dict[str, Any] = {"series": {}, "correlations": {}}
    names = [k for k in windows[0] if k.partition("@")[0] in CONTENDERS]
    for name in names:
        steps = [w[name]["step_ms"] for w in windows]
        out["series"][f"{name} step ms"] = spread(steps)
    first = names[0] if names else None
    for other in names[1:]:  # paired by window: the A/B statistic (both saw the same minutes)
        ratios = [w[other]["step_ms"] / w[first]["step_ms"] for w in windows]
        out.setdefault("paired", {})[f"{other} / {first}"] = {
            **spread(ratios),
            "faster_windows": sum(r < 1 for r in ratios),
            "windows": len(ratios),
        }
    probes = [w["probe"] for w in windows if "probe" in w]
    if probes:
        out["series"]["weights read GB/s"] = spread([p["weights_read_gb_s"] for p in probes])
        out["series"]["compute GFLOP/s"] = spread([p["compute_gflop_s"] for p in probes])
    project = next((n for n in names if n.startswith("project")), None)
    if project and probes and len(probes) == len(windows):
        # int8: q8_0's 34 bytes per 32 weights, within 6% of the project's int8 + scales
        key = "q8_0" if project.endswith("int8") else "bf16"
        rate = [streamed[key] / (w[project]["step_ms"] / 1e3) / 1e9 for w in windows]
        read = [p["weights_read_gb_s"] for p in probes]
        comp = [p["compute_gflop_s"] for p in probes]
        out["series"][f"{project} step / floor at the window's read rate"] = spread(
            [r / q for r, q in zip(read, rate)]
        )
        out["correlations"][f"{project} step rate ~ weights read rate"] = correlation(rate, read)
        out["correlations"][f"{project} step rate ~ compute rate"] = correlation(rate, comp)
        for other in names:
            if other != project:
                o = [1 / w[other]["step_ms"] for w in windows]
                if other.startswith("project"):
                    out["correlations"][f"{project} step rate ~ {other} step rate"] = correlation(
                        rate, o
                    )
                    continue
                out["correlations"][f"{other} step rate ~ weights read rate"] = correlation(o, read)
                out["correlations"][f"{other} step rate ~ compute rate"] = correlation(o, comp)
                out["correlations"][f"{project} step rate ~ {other} step rate"] = correlation(
                    rate, o
                )
    return out


def markdown(data: dict[str, Any]) -> str:
    s = data["summary"]
    lines = [
        f"# drift: {data['settings']['size']}, {len(data['windows'])} windows, "
        f"{data['settings']['threads']} threads, new tokens {data['settings']['new_tokens']}",
        "| series | median | min | max | spread (max / min) |",
        "|---|---|---|---|---|",
    ]
    for name, r in s["series"].items():
        ratio = "-" if r["spread"] is None else f"{r['spread']:.3f}"
        lines.append(f"| {name} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} | {ratio} |")
    if s.get("paired"):
        lines += [
            "",
            "| paired per window: step time ratio | median | min | max | numerator faster in |",
            "|---|---|---|---|---|",
        ]
        for name, r in s["paired"].items():
            lines.append(
                f"| {name} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} | "
                f"{r['faster_windows']} of {r['windows']} |"
            )
    if s["correlations"]:
        lines += ["", "| correlation over the windows | Pearson r |", "|---|---|"]
        for name, r in s["correlations"].items():
            lines.append(f"| {name} | {'-' if r is None else f'{r:.2f}'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--size", default="1.1b", choices=("tiny", "1.1b"))
    p.add_argument("--model-dir", help="a checkpoint folder instead of --size's")
    p.add_argument(
        "--contenders", nargs="+", default=["project_bf16", "llamacpp_bf16"], choices=CONTENDERS
    )
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--new-tokens", type=int, nargs=2, default=[8, 40], metavar=("SHORT", "LONG"))
    p.add_argument("--prompt-len", type=int, default=16, help="prefill is not timed; short")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-probe", action="store_true", help="no weights / compute probe")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="one more project_bf16 process with these environment variables (repeatable)",
    )
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one more project_bf16 process running the source tree at PATH (repeatable)",
    )
    p.add_argument("--cache-dir", help="the project's artifact cache (default: WORK_DIR/artifacts)")
    p.add_argument(
        "--work-dir", help="the peers bench's models, GGUF files, artifacts (default: its own)"
    )
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    if args.serve:
        serve(json.loads(args.serve))
        return {}
    from experiments.bench import peers, process_facts
    from experiments.bench.measure import make_prompts

    short, long_ = args.new_tokens
    if not 0 < short < long_:
        p.error(f"--new-tokens: need 0 < SHORT < LONG, got {short} {long_}")
    folder = Path(args.model_dir) if args.model_dir else peers.model_dir(args.size)
    config = json.loads((folder / "config.json").read_text())
    if args.work_dir:
        work = Path(args.work_dir)
    else:  # the peers bench's work folder, so both share the GGUF files and the artifacts
        from models.tiny import default_cache_root

        work = default_cache_root().parent / "peers"
    base = {
        "size": args.size,
        "model_dir": str(folder),
        "batches": [1],
        "prompt": make_prompts(1, args.prompt_len, config["vocab_size"])[0],
        "prompt_len": args.prompt_len,
        "new_tokens": [short, long_],
        "check_tokens": long_,
        "threads": args.threads,
        "level": 2,
        "cache_dir": args.cache_dir or str(work / "artifacts"),
    }
    plan: list[tuple[str, dict[str, Any], dict[str, str], Optional[str]]] = []
    for c in args.contenders:
        plan.append((c, dict(base, contender=c), {}, None))
    for spec in args.variant:
        name, _, assignments = spec.partition("=")
        env = dict(kv.split("=", 1) for kv in assignments.split(",") if "=" in kv)
        if not name or not env:
            p.error(f"--variant: expected NAME=KEY=VALUE[,KEY=VALUE], got {spec!r}")
        c = f"project_bf16@{name}"
        plan.append((c, dict(base, contender="project_bf16", name=c), env, None))
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not name or not (Path(path) / "experiments" / "bench" / "drift.py").is_file():
            p.error(f"--tree: expected NAME=PATH to a source tree with this bench, got {spec!r}")
        c = f"project_bf16@{name}"
        job = dict(base, contender="project_bf16", name=c)
        plan.append((c, job, {}, str(Path(path).resolve())))
    workers: dict[str, Worker] = {}
    data: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "serve"},
        "env": {c: env for c, _, env, _ in plan},
        "trees": {c: tree for c, _, _, tree in plan if tree},
        "streamed_bytes": peers.streamed_bytes(folder),
        "windows": [],
    }
    try:
        for c, job, env, tree in plan:
            if c.startswith("llamacpp"):
                job["gguf"] = str(peers.ensure_gguf(folder, c.split("_", 1)[1], work))
            log(f"drift: starting {c}")
            workers[c] = Worker(job, args.threads, env, tree)
            data.setdefault("load_s", {})[c] = workers[c].ready.get("load_s")
        for i in range(args.windows):
            row: dict[str, Any] = {"t": time.time()}
            before = process_facts.snapshot()
            for c, w in workers.items():
                row[c] = w.ask("window")
                if c.startswith("project") and not args.no_probe and "probe" not in row:
                    row["probe"] = w.ask("probe")
            row["load"] = process_facts.load_report(before, process_facts.snapshot())
            data["windows"].append(row)
            log(
                f"window {i}: "
                + ", ".join(f"{c} {row[c]['step_ms']:.2f} ms" for c in workers)
                + (
                    f", weights read {row['probe']['weights_read_gb_s']:.1f} GB/s, "
                    f"compute {row['probe']['compute_gflop_s']:.0f} GFLOP/s"
                    if "probe" in row
                    else ""
                )
            )
    finally:
        for w in workers.values():
            w.close()
    data["summary"] = summarize(data["windows"], data["streamed_bytes"])
    data["markdown"] = markdown(data)
    print(data["markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main()
