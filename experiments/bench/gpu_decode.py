"""Decode-step benchmark across CUDA-graph modes, for one GPU (run by scripts/gpu_check.sh).

    python -m experiments.bench.gpu_decode                      # all modes, batch 1/8/32, bf16
    python -m experiments.bench.gpu_decode --modes eager full_and_piecewise --batch-sizes 1

Modes:
  eager               the framework at O0 (no compile, no graphs)
  piecewise           the framework at O2 with cudagraph_mode=PIECEWISE
  full_and_piecewise  the framework at O2 (FULL graphs for decode, PIECEWISE for the rest)
  no_graphs           the framework at O2 with cudagraph_mode=NONE (compile gain alone)
  hf_eager            the transformers model, StaticCache, eager
  hf_reduce_overhead  the transformers model, StaticCache, torch.compile(mode="reduce-overhead")

A decode step is measured as a difference of two generations that share their prefill:
``(t(S + N new tokens) - t(S new tokens)) / N``, medians over ``--repeats``; every path reads
the sampled tokens back to the host each step, as a generation loop must.  Prints a markdown
table (ms per decode step and speed-up over ``eager``) and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch

FRAMEWORK_MODES = {
    "eager": dict(level=0, cudagraph_mode=None),
    "no_graphs": dict(level=2, cudagraph_mode="NONE"),
    "piecewise": dict(level=2, cudagraph_mode="PIECEWISE"),
    "full_and_piecewise": dict(level=2, cudagraph_mode="FULL_AND_PIECEWISE"),
}
HF_MODES = ("hf_eager", "hf_reduce_overhead")
ALL_MODES = tuple(FRAMEWORK_MODES) + HF_MODES
DEFAULT_MODES = ("eager", "piecewise", "full_and_piecewise", "hf_reduce_overhead")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", help="HF checkpoint folder (default: the tiny preset)")
    p.add_argument(
        "--preset",
        default="default",
        help="models.tiny preset generated when --model-dir is not given",
    )
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=ALL_MODES)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=64, help="N: measured decode steps")
    p.add_argument("--base-steps", type=int, default=8, help="S: steps both runs share")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--attention-backend",
        default=None,
        help="framework attention backend (default: triton on CUDA, else torch)",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu only for a plumbing smoke run (graph modes resolve to NONE)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "base_steps", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(b <= 0 for b in args.batch_sizes):
        p.error("--batch-sizes must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "CUDA is not available; this benchmark is for a GPU (use --device cpu only "
            "for a smoke run of the plumbing)"
        )
    if args.attention_backend is None:
        args.attention_backend = "triton" if args.device == "cuda" else "torch"
    return args


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(generate: Callable[[int], None], args: argparse.Namespace) -> float:
    """Median ms per decode step from ``generate(num_new_tokens)`` timings."""
    generate(args.base_steps)  # warm-up (compile, capture)
    generate(args.base_steps + args.decode_steps)
    samples = []
    for _ in range(args.repeats):
        times = []
        for n in (args.base_steps, args.base_steps + args.decode_steps):
            _sync(args.device)
            t0 = time.perf_counter()
            generate(n)
            _sync(args.device)
            times.append(time.perf_counter() - t0)
        samples.append((times[1] - times[0]) / args.decode_steps * 1e3)
    return statistics.median(samples)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


# ------------------------------------------------------------------------------ framework --


def bench_framework(mode: str, model_dir: str, args: argparse.Namespace) -> dict:
    from framework import LLM, CompilationConfig

    if args.attention_backend == "triton":
        import backends.attention.triton_paged  # noqa: F401  (registers "triton")
    spec = FRAMEWORK_MODES[mode]
    cc = {"level": spec["level"]}
    if spec["cudagraph_mode"] is not None:
        cc["cudagraph_mode"] = spec["cudagraph_mode"]
    max_batch = max(args.batch_sizes)
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        compilation_config=CompilationConfig.from_dict(cc),
        max_num_seqs=max_batch,
        max_model_len=args.prompt_len + args.base_steps + args.decode_steps + 16,
        max_num_batched_tokens=max(max_batch * args.prompt_len, 256),
        attention_backend=args.attention_backend,
        device=args.device,
    )
    startup_s = time.perf_counter() - t0
    vocab = llm.model_config.vocab_size
    result = {"startup_s": startup_s, "ms": {}}
    for batch in args.batch_sizes:
        ps = prompts(batch, args.prompt_len, vocab)

        def generate(n: int) -> None:
            outs = llm.generate(ps, max_new_tokens=n, ignore_eos=True)
            if any(len(o) != n for o in outs):
                raise RuntimeError(
                    f"{mode}: asked for {n} new tokens, got {sorted({len(o) for o in outs})}"
                )

        result["ms"][batch] = step_ms(generate, args)
    stats = llm.stats
    result["cudagraph_mode"] = stats.get("cudagraph_mode")
    result["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    return result


# ---------------------------------------------------------------------------- transformers --


def bench_hf(mode: str, model_dir: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, StaticCache

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    forward = model.forward
    if mode == "hf_reduce_overhead":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    max_len = args.prompt_len + args.base_steps + args.decode_steps + 16
    result = {"startup_s": time.perf_counter() - t0, "ms": {}, "cudagraph_mode": None}
    for batch in args.batch_sizes:
        ids = torch.tensor(
            prompts(batch, args.prompt_len, model.config.vocab_size), device=args.device
        )
        # One cache per batch size, reset per generation: a new cache object would fail
        # Dynamo's guards and recompile on every generation.
        cache = StaticCache(config=model.config, max_cache_len=max_len)

        @torch.inference_mode()
        def generate(n: int) -> None:
            cache.reset()
            pos = torch.arange(args.prompt_len, device=args.device).expand(batch, -1)
            out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            pos = pos[:, -1:] + 1
            tok.tolist()
            for _ in range(n - 1):
                if mode == "hf_reduce_overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                out = forward(input_ids=tok, position_ids=pos, cache=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                pos = pos + 1
                tok.tolist()  # the host reads each token, as a loop must

        result["ms"][batch] = step_ms(generate, args)
    return result


# ------------------------------------------------------------------------------------ main --


def format_table(results: dict[str, dict], batch_sizes: list[int]) -> str:
    head = "| mode | graphs | " + " | ".join(f"bs={b} ms/step" for b in batch_sizes)
    head += " | " + " | ".join(f"bs={b} vs eager" for b in batch_sizes) + " | startup s |"
    lines = [head, "|" + "---|" * (3 + 2 * len(batch_sizes))]
    eager = results.get("eager", {}).get("ms", {})
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | failed: {r['error'][:80]} |")
            continue
        ms = [f"{r['ms'][b]:.3f}" for b in batch_sizes]
        speed = [f"{eager[b] / r['ms'][b]:.2f}x" if b in eager else "-" for b in batch_sizes]
        lines.append(
            f"| {mode} | {r.get('cudagraph_mode') or '-'} | "
            + " | ".join(ms)
            + " | "
            + " | ".join(speed)
            + f" | {r['startup_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.model_dir is None:
        from models.tiny import ensure_tiny_model

        args.model_dir = str(ensure_tiny_model(preset=args.preset))
    print(
        f"model {args.model_dir}  dtype {args.dtype}  device {args.device}  "
        f"attention {args.attention_backend}  torch {torch.__version__}"
        + (f"  gpu {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        flush=True,
    )
    results: dict[str, dict] = {}
    for mode in args.modes:
        t0 = time.perf_counter()
        try:
            bench = bench_hf if mode in HF_MODES else bench_framework
            results[mode] = bench(mode, args.model_dir, args)
        except Exception as e:  # one failing mode must not hide the others' numbers
            results[mode] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()  # the log is all a lent machine leaves behind
        print(
            f"{mode}: done in {time.perf_counter() - t0:.1f} s "
            f"{results[mode].get('ms', results[mode].get('error'))}",
            flush=True,
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print()
    print(format_table(results, args.batch_sizes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
