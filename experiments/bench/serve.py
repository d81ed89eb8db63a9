"""Serving overhead: a bounded load generator against ``python -m framework.serve`` on
loopback, and the same requests through the offline ``LLM.generate``, side by side.

    python -m experiments.bench.serve                               # default model, O2
    python -m experiments.bench.serve --concurrency 1,16 --requests 32 --rounds 3
    python -m experiments.bench.serve --model /path/to/hf_folder compile=O1 dtype=bfloat16

The server runs in a subprocess (its own engine thread, uvicorn, HTTP, SSE); this process
holds the offline ``LLM`` of the same configuration (the same key=value overrides, the same
artifact cache) and the load generator: ``--concurrency`` closed-loop clients share a fixed
list of ``--requests`` streaming requests (random token-id prompts, greedy,
``ignore_eos``, ``--max-tokens`` each) under a ``--deadline``. Offline, concurrency c is
one ``generate`` per c requests in turn: every request has the same prompt length and
output length, so c clients move in lockstep and the waves are the same batches (use a
request count that is a multiple of c). It runs on a fresh thread as the server's engine
thread does (``--offline-main-thread`` to change that: under CPU contention OpenMP behaves
differently on the main thread). Rounds alternate which side runs first; the report gives
medians over rounds of output tokens/s (server / offline ratio), request throughput, time
to first token (p50/p99) and inter-token latency (p50/p99) as the clients see them, and
checks that both sides produced the same tokens. CPU time per output token (the server
process, the load generator's, and the offline run's) is reported too: on a busy machine it
says more about the serving layer's own cost than wall-clock rates do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class RequestTiming:
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    status: int = 0
    error: Optional[str] = None


@dataclass
class LoadResult:
    wall_s: float
    timings: list[RequestTiming]
    completed: int
    deadline_hit: bool

    @property
    def output_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.timings)

    def summary(self) -> dict[str, Any]:
        ttft = sorted(t.ttft_s for t in self.timings if t.ttft_s is not None)
        itl = sorted(x for t in self.timings for x in t.itl_s)
        return {
            "completed": self.completed,
            "errors": sum(t.error is not None for t in self.timings),
            "deadline_hit": self.deadline_hit,
            "wall_s": self.wall_s,
            "output_tok_s": self.output_tokens / self.wall_s if self.wall_s else 0.0,
            "req_s": self.completed / self.wall_s if self.wall_s else 0.0,
            "ttft_ms_p50": _pct(ttft, 50) * 1e3,
            "ttft_ms_p99": _pct(ttft, 99) * 1e3,
            "itl_ms_p50": _pct(itl, 50) * 1e3,
            "itl_ms_p99": _pct(itl, 99) * 1e3,
        }


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _one(client, url: str, body: dict, t: RequestTiming) -> None:
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        t.status = r.status_code
        if r.status_code != 200:
            t.error = (await r.aread()).decode(errors="replace")[:300]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                t.error = str(chunk["error"])
                return
            ids = chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else []
            if not ids:
                continue
            now = time.perf_counter()
            if last is None:
                t.ttft_s = now - t0
            else:
                t.itl_s.extend([(now - last) / len(ids)] * len(ids))
            last = now
            t.tokens.extend(ids)


async def run_load(
    url: str,
    model: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
    deadline_s: float,
    api_key: Optional[str] = None,
) -> LoadResult:
    """Send every prompt once as a greedy streaming completion, ``concurrency`` at a time
    (closed loop), stopping at ``deadline_s``. Loopback servers only."""
    import httpx

    host = httpx.URL(url).host
    if host not in LOOPBACK:
        raise ValueError(f"run_load: {url} is not a loopback address; this generator stays local")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timings = [RequestTiming() for _ in prompts]
    todo = list(range(len(prompts)))
    done = 0

    async def worker(client) -> None:
        nonlocal done
        while todo:
            i = todo.pop(0)
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            try:
                await _one(client, url, body, timings[i])
            except Exception as e:  # noqa: BLE001 - counted as an error of that request
                timings[i].error = f"{type(e).__name__}: {e}"
            if timings[i].error is None:
                done += 1

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=deadline_s, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for p in pending:
            p.cancel()
        wall = time.perf_counter() - t0
    return LoadResult(wall, timings, done, bool(pending))


def offline_run(
    llm, prompts, max_tokens: int, concurrency: int, in_thread: bool = True
) -> tuple[float, list[list[int]]]:
    """The requests through ``generate``; ``in_thread``: on a fresh thread, as the server's
    engine thread runs its steps (so the comparison isolates the serving layer)."""
    from framework import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    result: list = []

    def run() -> None:
        t0 = time.perf_counter()
        out = []
        for i in range(0, len(prompts), concurrency):
            out += llm.generate(list(prompts[i : i + concurrency]), sampling_params=sp)
        result.append((time.perf_counter() - t0, out))

    if in_thread:
        t = threading.Thread(target=run, name="offline-generate")
        t.start()
        t.join()
    else:
        run()
    return result[0]


def step_medians(url: str, llm) -> tuple[Optional[float], Optional[float]]:
    """Median decode step (ms) of the server's engine and of the offline LLM, over their
    lives so far: equal medians say a gap in tokens/s is the serving layer's, not the
    forward's."""
    import httpx

    server = None
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('piecewise_engine_step_ms{kind="decode",quantile="median"}'):
            server = float(line.rsplit(" ", 1)[1])
    return server, llm.stats.get("decode_ms_median")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, overrides: list[str], port: int, timeout_s: float):
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "framework.serve", model_dir, "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--log-level", "warning", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            raise RuntimeError(f"the server did not answer /health within {timeout_s} s")
        time.sleep(0.5)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value overrides (server and offline)")
    ap.add_argument("--model", default="default", help="a tiny-model preset or an HF folder")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds per load run")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--offline-main-thread",
        action="store_true",
        help="run the offline generate on the main thread (default: a fresh thread, like "
        "the server's engine thread)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_intermixed_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in conc) or args.requests < 1 or args.rounds < 1:
        ap.error("--concurrency, --requests and --rounds must be positive")
    if Path(args.model).is_dir():
        model_dir = str(Path(args.model).resolve())
    else:
        from models.tiny import ensure_tiny_model

        model_dir = str(ensure_tiny_model(preset=args.model))
    max_len = args.prompt_len + args.max_tokens + 8
    base = ["compile=O2", f"max_num_seqs={max(conc)}", f"max_model_len={max(512, max_len)}"]
    overrides = base + list(args.overrides)  # later overrides win

    from framework.serve.server import build_llm

    g = random.Random(args.seed)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = [[g.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    print(f"model {model_dir}\noverrides {overrides}\nload before: {os.getloadavg()}")
    t0 = time.perf_counter()
    llm = build_llm(model_dir, overrides)  # compiles (or restores) the shared artifacts first
    print(f"offline LLM built in {time.perf_counter() - t0:.1f} s")
    port = _free_port()
    proc = start_server(model_dir, overrides, port, args.startup_timeout)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"model": model_dir, "overrides": overrides, "by_concurrency": {}}
    try:
        for c in conc:
            # warm-up of both sides (first requests pay one-off costs)
            asyncio.run(run_load(url, "bench", prompts[:c], 4, c, args.deadline))
            offline_run(llm, prompts[:c], 4, c, not args.offline_main_thread)
            rounds = []
            for r in range(args.rounds):
                order = ("server", "offline") if r % 2 == 0 else ("offline", "server")
                row: dict[str, Any] = {}
                for side in order:
                    cpu0 = cpu_seconds(proc.pid), cpu_seconds(os.getpid())
                    if side == "server":
                        load = asyncio.run(
                            run_load(url, "bench", prompts, args.max_tokens, c, args.deadline)
                        )
                        row["server"] = load.summary()
                        row["server_tokens"] = [t.tokens for t in load.timings]
                        n = load.output_tokens
                        # the server process, and this one (the load generator's clients)
                        cpu = cpu_seconds(proc.pid) - cpu0[0], cpu_seconds(os.getpid()) - cpu0[1]
                        row["server"]["cpu_ms_per_token"] = 1e3 * cpu[0] / max(n, 1)
                        row["server"]["client_cpu_ms_per_token"] = 1e3 * cpu[1] / max(n, 1)
                    else:
                        wall, out = offline_run(
                            llm, prompts, args.max_tokens, c, not args.offline_main_thread
                        )
                        n = sum(len(o) for o in out)
                        cpu = cpu_seconds(os.getpid()) - cpu0[1]
                        row["offline"] = {
                            "wall_s": wall,
                            "output_tok_s": n / wall,
                            "cpu_ms_per_token": 1e3 * cpu / max(n, 1),
                        }
                        row["offline_tokens"] = out
                row["same_tokens"] = row.pop("server_tokens") == row.pop("offline_tokens")
                row["ratio"] = row["server"]["output_tok_s"] / row["offline"]["output_tok_s"]
                rounds.append(row)
                print(
                    f"c={c} round {r}: server {row['server']['output_tok_s']:.1f} tok/s, "
                    f"offline {row['offline']['output_tok_s']:.1f} tok/s, "
                    f"ratio {row['ratio']:.3f}, same tokens {row['same_tokens']}"
                )
            med = lambda xs: statistics.median(xs)  # noqa: E731
            summary = {
                "server_tok_s": med([r["server"]["output_tok_s"] for r in rounds]),
                "offline_tok_s": med([r["offline"]["output_tok_s"] for r in rounds]),
                "ratio_median": med([r["ratio"] for r in rounds]),
                "ratios": [r["ratio"] for r in rounds],
                "req_s": med([r["server"]["req_s"] for r in rounds]),
                "ttft_ms_p50": med([r["server"]["ttft_ms_p50"] for r in rounds]),
                "ttft_ms_p99": med([r["server"]["ttft_ms_p99"] for r in rounds]),
                "itl_ms_p50": med([r["server"]["itl_ms_p50"] for r in rounds]),
                "itl_ms_p99": med([r["server"]["itl_ms_p99"] for r in rounds]),
                "server_cpu_ms_per_token": med([r["server"]["cpu_ms_per_token"] for r in rounds]),
                "client_cpu_ms_per_token": med(
                    [r["server"]["client_cpu_ms_per_token"] for r in rounds]
                ),
                "offline_cpu_ms_per_token": med([r["offline"]["cpu_ms_per_token"] for r in rounds]),
                "errors": sum(r["server"]["errors"] for r in rounds),
                "same_tokens": all(r["same_tokens"] for r in rounds),
            }
            summary["step_ms"] = step_medians(url, llm)
            results["by_concurrency"][str(c)] = {"summary": summary, "rounds": rounds}
            print(f"c={c} decode step ms median (server, offline): {summary['step_ms']}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    results["load_after"] = os.getloadavg()
    print(f"\nload after: {results['load_after']}")
    print(
        "| concurrency | server tok/s | offline tok/s | ratio (median; rounds) | req/s "
        "| TTFT p50 / p99 ms | ITL p50 / p99 ms | CPU ms/token server + client / offline "
        "| same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c, rec in results["by_concurrency"].items():
        s = rec["summary"]
        ratios = ", ".join(f"{x:.2f}" for x in s["ratios"])
        print(
            f"| {c} | {s['server_tok_s']:.1f} | {s['offline_tok_s']:.1f} | "
            f"{s['ratio_median']:.3f} ({ratios}) | {s['req_s']:.2f} | "
            f"{s['ttft_ms_p50']:.1f} / {s['ttft_ms_p99']:.1f} | "
            f"{s['itl_ms_p50']:.2f} / {s['itl_ms_p99']:.2f} | "
            f"{s['server_cpu_ms_per_token']:.2f} + {s['client_cpu_ms_per_token']:.2f} / "
            f"{s['offline_cpu_ms_per_token']:.2f} | {s['same_tokens']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
