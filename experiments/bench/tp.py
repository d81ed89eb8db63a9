"""TP=1 against TP=N through ``LLM.generate``: greedy tokens (must be identical), start-up,
prefill and decode step medians.  Also the TP check of ``make gpu-check`` (``--check``: exit 1
when tokens differ; skips with a reason when fewer devices than ``--tp`` are visible).

    python -m experiments.bench.tp                       # CPU, gloo, test-llama preset, O0
    python -m experiments.bench.tp --level 2 --preset default --dtype bfloat16
    python -m experiments.bench.tp --device cuda --check # NCCL, needs 2 GPUs

Each rank gets ``--threads`` threads (default: the cores divided by the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from framework.engine.llm import LLM
from models.tiny import ensure_tiny_model


def _prompts(batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # different lengths in one batch: prompt_len, prompt_len - 3, ...
    return [
        torch.randint(1, 200, (max(2, prompt_len - 3 * i),), generator=g).tolist()
        for i in range(batch)
    ]


def run_one(args, tp: int, model: str, enable: tuple[str, ...] = ()) -> dict:
    cc = {"level": args.level, "pass_config": {"passes": [f"+{n}" for n in enable] or None}}
    llm = LLM(
        model,
        dtype=args.dtype,
        compilation_config=cc,
        tensor_parallel_size=tp,
        device=args.device,
        cache_dir=args.cache_dir,
        max_model_len=256,
    )
    try:
        prompts = _prompts(args.batch, args.prompt_len)
        llm.generate(prompts, max_new_tokens=2)  # warm-up (first-call costs)
        for times in llm.runner.step_times.values():
            times.clear()
        tokens = llm.generate(prompts, max_new_tokens=args.new_tokens)
        st = llm.stats
        return {
            "tp": tp,
            "passes": "+".join(enable) or "-",
            "tokens": tokens,
            "startup_s": round(st["startup_s"], 2),
            "prefill_ms": round(st.get("prefill_ms_median", float("nan")), 2),
            "decode_ms": round(st.get("decode_ms_median", float("nan")), 2),
        }
    finally:
        llm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--preset", default="test-llama")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument(
        "--enable",
        nargs="*",
        default=[],
        help="extra TP=N rows with these passes on (needs --level >= 1), e.g. "
        "fuse_allreduce_rmsnorm",
    )
    p.add_argument("--check", action="store_true", help="exit 1 unless tokens are identical")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        print(
            f"TP={args.tp} check skipped: {torch.cuda.device_count()} GPU(s) visible, "
            f"TP={args.tp} needs {args.tp}"
        )
        return 0
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    torch.set_num_threads(threads)
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="bench-tp-")
    model = str(ensure_tiny_model(preset=args.preset))
    rows = [run_one(args, 1, model), run_one(args, args.tp, model)]
    rows += [run_one(args, args.tp, model, (name,)) for name in args.enable]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(
        f"\n{args.preset}, {args.dtype}, O{args.level}, {args.device}, batch {args.batch} "
        f"(prompts {args.prompt_len} down), {args.new_tokens} new tokens, {threads} thread(s) "
        f"per rank\n"
    )
    print("| TP | passes added | start-up s | prefill step ms | decode step ms | tokens == TP=1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = "yes" if r["tokens"] == rows[0]["tokens"] else "NO"
        print(
            f"| {r['tp']} | {r['passes']} | {r['startup_s']} | {r['prefill_ms']} | "
            f"{r['decode_ms']} | {ok} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.check and not same:
        print("TP check FAILED: tokens differ from TP=1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
