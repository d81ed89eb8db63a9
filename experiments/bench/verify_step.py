"""What a speculative verify step costs next to a plain decode step, side by side.

    python -m experiments.bench.verify_step --k 4 --batch 1 8 --rounds 7 --steps 20

One engine (default tiny model, bf16, O2), requests with a prefilled context; each round
times ``--steps`` plain decode steps (1 query token per request) and ``--steps`` verify steps
(1 + k query tokens per request: the last token and k drafts, logits at every position,
rejection sampling), alternating which goes first.  Reports per batch size the median step
times and the median over rounds of the per-round ratio verify / decode.  The forward is
the engine's runner (the same compiled pieces, dispatcher and sampler a step uses).

Each batch also gets the verify step's *compute floor*: the FLOPs of its ``batch * (1 + k)``
rows through every linear and the LM head, at the best ``torch.mm`` rate this machine
reaches in the step's dtype (:func:`experiments.bench.compute.matmul_peak`), and
``ratio_floor``, that floor over the measured decode step: no verify kernel slower than
oneDNN's best GEMM can bring the ratio below it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from experiments.bench.compute import compute_floor_ms, matmul_flops, step_matmul_peak
from experiments.bench.profile_step import step_bytes
from framework import LLM
from framework.engine.request import Request, ScheduledChunk


def _requests(llm: LLM, batch: int, context: int, k: int) -> list[Request]:
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    reqs = []
    bs = llm.scheduler.block_size
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=g).tolist()
        r = Request(10_000 + i, prompt, max_new_tokens=k + 2)
        r.block_ids = llm.block_manager.allocate(-(-(context + k + 1) // bs))
        reqs.append(r)
    for r in reqs:  # prefill, one request at a time (the step budget is max_model_len)
        llm.runner.execute([ScheduledChunk(r, 0, context)], record=False)
    return reqs


def weight_elements(llm: LLM) -> int:
    """Weights every token multiplies through: the linears and the LM head (the embedding
    table is a lookup)."""
    return step_bytes(llm, 1, 0)["weights"] // llm.dtype.itemsize


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``cpu``: the main thread's CPU time (``--threads 1`` only): on a loaded machine it leaves
out the time a step waits for a core, which wall time counts."""


def _time(
    llm: LLM, chunks: list[ScheduledChunk], steps: int, clock=time.perf_counter
) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = clock()
        llm.runner.execute(chunks, record=False)
        out.append(clock() - t0)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the default tiny model)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument(
        "--small-m-max-rows",
        type=int,
        default=None,
        help="KernelConfig.small_m_max_rows (rows up to which bf16 linears use the small-M kernel)",
    )
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: the thread's CPU time, for a loaded machine (needs --threads 1)",
    )
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread's CPU time: use it with --threads 1")
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from models.tiny import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    kernel = {}
    if args.small_m_max_rows is not None:
        kernel = {"kernel_config": {"small_m_max_rows": args.small_m_max_rows}}
    llm = LLM(
        args.model,
        dtype=args.dtype,
        optimization_level=args.level,
        max_num_seqs=max(args.batch),
        max_model_len=args.context + args.k + 8,
        cache_dir=args.cache_dir or tempfile.mkdtemp(prefix="bench-verify-"),
        compilation_config={"progress_bar": False, **kernel},
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
    )
    result: dict = {"k": args.k, "context": args.context, "dtype": args.dtype, "batches": {}}
    result["clock"] = args.clock
    peak = step_matmul_peak(llm.dtype) if llm.dtype.is_floating_point else None
    result["matmul_peak"] = peak
    weights = weight_elements(llm)
    for b in args.batch:
        reqs = _requests(llm, b, args.context, args.k)
        last = args.context - 1
        decode = [ScheduledChunk(r, last, 1) for r in reqs]
        drafts = tuple(range(5, 5 + args.k))
        verify = [ScheduledChunk(r, last, 1 + args.k, drafts) for r in reqs]
        _time(llm, decode, 3)  # warm both shapes (compiles a range on first use)
        _time(llm, verify, 3)
        d_med, v_med, ratios = [], [], []
        for rnd in range(args.rounds):
            order = (
                (("d", decode), ("v", verify)) if rnd % 2 == 0 else (("v", verify), ("d", decode))
            )
            got = {
                name: statistics.median(_time(llm, chunks, args.steps, clock))
                for name, chunks in order
            }
            d_med.append(got["d"])
            v_med.append(got["v"])
            ratios.append(got["v"] / got["d"])
            print(
                f"# b{b} round {rnd + 1}: decode {got['d'] * 1e3:.2f} ms, verify "
                f"{got['v'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}",
                flush=True,
            )
        for r in reqs:
            llm.block_manager.free(r.block_ids)
        row = result["batches"][b] = {
            "decode_ms_median": statistics.median(d_med) * 1e3,
            "verify_ms_median": statistics.median(v_med) * 1e3,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        if peak is not None:
            flops = matmul_flops(weights, b * (1 + args.k))
            row["verify_matmul_gflop"] = flops / 1e9
            row["compute_floor_ms"] = compute_floor_ms(flops, peak["best_gflops"])
            row["ratio_floor"] = row["compute_floor_ms"] / row["decode_ms_median"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
