"""Side-by-side MoE decode benchmark: this project at O2 against transformers eager and
``torch.compile(transformers)``, bf16, on a Qwen3-MoE shape (preset ``bench-qwen3_moe``: 16
experts top-2), and the batch-1 step against its active-weight floor.

    python -m experiments.bench.moe                                   # b1 and b8, 5 rounds
    python -m experiments.bench.moe --batches 1 --rounds 2 --steps 8 --threads 1   # quick

Same weights, same prompts for every contender; a decode step is timed the same way for all
(inputs, forward, argmax, tokens back to the host: ``experiments.bench.contenders``); after one
untimed warm-up generation each, ``--rounds`` rounds run the contenders round-robin with a
rotating start; medians and p90s over every kept step (``experiments.bench.measure``).

Active-weight floor of a b1 decode step: the bytes a step must read -- attention (qkv, o),
norms, the router, only the top-k experts' gate-up and down of each MoE layer, the dense MLP
layers, and the LM head (every weight but the embedding table and the experts not chosen) --
divided by the best read bandwidth measured in the same run: the better of ``torch.sum`` over
a 256 MB buffer (``experiments.bench.bandwidth``, which under-measures on some machines, see
PERF_NOTES.md) and the small-M kernel streaming a 256 MB bf16 weight at batch 1.  The floor
ignores caches: on a model this small part of the weights can stay in the last-level cache.
The result also gives the floor of attention + router + top-k experts alone (without the LM
head, which on this shape is two thirds of the active bytes).

Kernel rows: one MoE layer's experts alone at 1, 8 and 2048 tokens -- the layer's own op
(at O2 in bf16 ``piecewise::fused_moe_packed`` on the re-laid-out experts), the plain
``piecewise::fused_moe`` on the same weights unpacked, transformers' expert loop.

The result (``--out``) records the command and the load average at start and end: on a shared
machine rerun it quietly before trusting absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

from experiments.bench.bandwidth import measure_read_bandwidth
from experiments.bench.contenders import HFLoop, Piecewise, build_llm, load_hf
from experiments.bench.measure import measure_latency
from models.tiny import ensure_tiny_model
from passes.ops.packed_moe import PackedExpertsMethod

PRESET = "bench-qwen3_moe"
CONTENDERS = ("hf_eager", "hf_compile", "O2")


def active_weight_bytes(llm) -> dict[str, int]:
    """Bytes of the weights a batch-1 decode step reads (see the module docstring), by part:
    ``attention`` (qkv, o, q/k norms), ``router`` (MoE gates, shared-expert gates),
    ``top_k_experts`` (k of the E stacked experts per MoE layer), ``dense`` (other linears:
    dense MLP layers, shared experts), ``lm_head``, ``norms`` and ``total``."""
    mc, model = llm.model_config, llm.model
    k, E = mc.num_experts_per_tok, mc.num_experts
    parts = dict.fromkeys(("attention", "router", "top_k_experts", "dense", "lm_head", "norms"), 0)
    for name, p in model.named_parameters():
        if "embed" in name and not mc.tie_word_embeddings:  # a row gather, not a read
            continue
        size = p.numel() * p.element_size()
        if name.endswith((".experts.w13", ".experts.w2")):
            parts["top_k_experts"] += size * k // E
        elif ".self_attn." in name:
            parts["attention"] += size
        elif name.endswith((".gate.weight", ".shared_expert_gate.weight")):
            parts["router"] += size
        elif name.startswith("lm_head") or "embed" in name:
            parts["lm_head"] += size
        elif p.dim() >= 2:
            parts["dense"] += size
        else:
            parts["norms"] += size
    total = sum(parts.values())
    return {**parts, "other": total - parts["top_k_experts"], "total": total}


def kernel_read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second the small-M kernel streams at batch 1 over a ``megabytes`` bf16
    weight (median): the read rate the project's own decode reaches, which ``torch.sum``
    under-measures on some machines (PERF_NOTES.md).  0.0 where the kernel is not built."""
    from passes import small_m_linear as small_m

    if not small_m.kernel_available():
        return 0.0
    k = 4096
    n = megabytes * (1 << 20) // (2 * k) // small_m.LANES * small_m.LANES
    w = small_m.pack(torch.full((n, k), 0.5, dtype=torch.bfloat16))
    x = torch.ones(1, k, dtype=torch.bfloat16)
    small_m.run_packed(x, w, None, n)  # warm-up: page faults, thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        small_m.run_packed(x, w, None, n)
        times.append(time.perf_counter() - t0)
    return n * k * 2 / statistics.median(times)


def _hf_expert_loop(x, weights, ids, w13, w2):
    """transformers 5's eager ``*MoeExperts.forward``: one-hot mask, per-expert where()."""
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        pos, tok = torch.where(mask[e])
        gate, up = torch.nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, tok, (h * weights[tok, pos, None]).to(out.dtype))
    return out


def measure_kernel(llm, token_counts: list[int], rounds: int) -> list[dict]:
    """The expert computation of one MoE layer alone, bf16, alternated, median of ``rounds``:
    the layer's own op (``fused_moe``: ``piecewise::fused_moe_packed`` on the re-laid-out
    experts where the engine packed them), ``piecewise::fused_moe`` on plain stacked
    weights (``F.linear`` per expert) and transformers' expert loop; the largest count is a
    b32 x 64-token prefill."""
    block = next(m for m in llm.model.modules() if hasattr(m, "experts"))
    experts = block.experts
    method = experts.moe_method
    if isinstance(method, PackedExpertsMethod):
        w13, w2 = method.plain_weights(experts)
    else:
        w13, w2 = experts.w13, experts.w2
    E, k = w13.shape[0], block.top_k
    rows = []
    for t in token_counts:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, w13.shape[2], generator=g).to(w13.dtype)
        logits = torch.randn(t, E, generator=g)
        probs = torch.softmax(logits, -1)
        weights, ids = torch.topk(probs, k, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(w13.dtype)
        fns = {
            "fused_moe": lambda: experts(x, weights, ids),
            "fused_moe_plain": lambda: torch.ops.piecewise.fused_moe(x, weights, ids, w13, w2),
            "hf_expert_loop": lambda: _hf_expert_loop(x, weights, ids, w13, w2),
        }
        times: dict[str, list[float]] = {n: [] for n in fns}
        for f in fns.values():
            f()
        names = list(fns)
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {n: statistics.median(v) for n, v in times.items()}
        rows.append({"tokens": t, "method": repr(method), **{f"{n}_ms": v for n, v in med.items()}})
    return rows


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    load_start = list(os.getloadavg())
    path = str(ensure_tiny_model(preset=args.preset))
    hf = load_hf(path, "bfloat16")
    vocab = hf.config.vocab_size
    cache = tempfile.mkdtemp(prefix="bench-moe-")
    llm = build_llm(2, path, "bfloat16", cache, max(args.batches), args.prompt_len + args.steps + 8)
    make = {
        "hf_eager": lambda: HFLoop("hf_eager", hf, hf),
        "hf_compile": lambda: HFLoop("hf_compile", hf, torch.compile(hf, dynamic=True)),
        "O2": lambda: Piecewise("O2", llm),
    }
    contenders = [make[name]() for name in args.contenders]
    kernel_rows = measure_kernel(llm, [1, 8, 32 * 64], max(5, args.rounds))
    rows = []
    for batch in args.batches:
        rows += measure_latency(contenders, "bfloat16", batch, args, vocab, print)
    probes = {
        "torch_sum": max(measure_read_bandwidth() for _ in range(3)),
        "small_m_kernel": max(kernel_read_bandwidth() for _ in range(3)),
    }
    bandwidth = max(probes.values())
    weights = active_weight_bytes(llm)
    o2_b1 = [r for r in rows if r["contender"] == "O2" and r["batch"] == 1]
    floor_ms = weights["total"] / bandwidth * 1e3
    core = weights["attention"] + weights["router"] + weights["top_k_experts"]
    result = {
        "preset": args.preset,
        "threads": args.threads,
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "kernel_rows": kernel_rows,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_probes_gb_s": {k: v / 1e9 for k, v in probes.items()},
        "packed_expert_layers": sum(
            isinstance(getattr(m, "moe_method", None), PackedExpertsMethod)
            for m in llm.model.modules()
        ),
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
        "command": "python -m experiments.bench.moe " + " ".join(args.argv),
        "active_weight_bytes": weights,
        "floor_ms": floor_ms,
        "floor_ms_attention_router_experts": core / bandwidth * 1e3,
        "o2_b1_over_floor": (o2_b1[0]["median_ms"] / floor_ms) if o2_b1 else None,
        "o2_b1_min_over_floor": (o2_b1[0]["min_ms"] / floor_ms) if o2_b1 else None,
    }
    return result


def markdown(result: dict) -> str:
    lines = [
        f"MoE decode, bf16, {result['preset']}, {result['threads']} thread(s)",
        "",
        "| batch | contender | median ms | p90 ms | vs O2 | token agreement vs hf_eager |",
        "|---|---|---|---|---|---|",
    ]
    for batch in sorted({r["batch"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["batch"] == batch]
        o2s = [r["median_ms"] for r in rows if r["contender"] == "O2"]
        o2 = statistics.median(o2s) if o2s else float("nan")
        for r in rows:
            lines.append(
                f"| {batch} | {r['contender']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
                f"{r['median_ms'] / o2:.2f}x | {r['token_agreement']:.3f} |"
            )
    lines += [
        "",
        "| tokens | fused_moe (the layer's op) ms | fused_moe on plain weights ms | "
        "transformers expert loop ms |",
        "|---|---|---|---|",
    ]
    for r in result.get("kernel_rows", []):
        lines.append(
            f"| {r['tokens']} | {r['fused_moe_ms']:.3f} | {r['fused_moe_plain_ms']:.3f} | "
            f"{r['hf_expert_loop_ms']:.3f} |"
        )
    w = result["active_weight_bytes"]
    ratio, best = result["o2_b1_over_floor"], result.get("o2_b1_min_over_floor")
    parts = ", ".join(
        f"{k} {w[k] / 1e6:.1f}"
        for k in ("attention", "router", "top_k_experts", "dense", "lm_head", "norms")
    )
    probes = ", ".join(f"{k} {v:.1f}" for k, v in result["bandwidth_probes_gb_s"].items())
    lines += [
        "",
        f"active weights per b1 step: {w['total'] / 1e6:.1f} MB ({parts} MB); read bandwidth "
        f"{result['bandwidth_gb_s']:.1f} GB/s (best of: {probes}) -> floor "
        f"{result['floor_ms']:.2f} ms; O2 b1 / floor = "
        + (
            f"{ratio:.2f}x median, {best:.2f}x best step (target <= 1.5x)"
            if ratio is not None
            else "n/a"
        ),
        "floor of attention + router + top-k experts alone (no LM head, norms or dense "
        f"layers): {result.get('floor_ms_attention_router_experts', float('nan')):.2f} ms",
        f"experts packed for the small-M kernel in {result['packed_expert_layers']} layer(s); "
        f"load average {result['load_average']}",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=PRESET, help="models.tiny preset (a Qwen3-MoE shape)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
