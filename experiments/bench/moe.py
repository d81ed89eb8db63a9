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
divided by the best read bandwidth seen in the same run: the best of the native read probe
(``experiments.bench.bandwidth.floor_bandwidth``, as ``profile_step`` and ``bench.peers`` use),
the small-M kernel streaming a 256 MB bf16 weight at batch 1, and every contender's own rate (its
active bytes over its best b1 step).  ``torch.sum``'s rate is recorded, not used (it
under-measures, PERF_NOTES.md).  The floor
ignores caches: on a model this small part of the weights can stay in the last-level cache.
The result also gives the floor of attention + router + top-k experts alone (without the LM
head, which on this shape is two thirds of the active bytes).

Kernel rows: one MoE layer's experts alone at 1, 8 and 2048 tokens -- the layer's own op
(at O2 in bf16 ``piecewise::fused_moe_packed`` on the re-laid-out experts: its C++ kernel
where the op library is built), the same op's Python body on the same packed weights
(``piecewise::fused_moe_packed_python``: the C++ kernel's "before"), the plain
``piecewise::fused_moe`` on the same weights unpacked, transformers' expert loop.

Contender ``O2_python_moe``: the same compiled model with the MoE op's CPU kernel switched to
its Python body for its steps (:func:`python_moe_body`): the step's "before", alternated with
``O2`` in the same rounds.  ``--profile-steps N`` adds a torch.profiler table of ``O2``'s b1
decode ops (per step and per layer, C++ and Python MoE kernel).

Contender ``llamacpp_bf16`` (where llama-cpp-python and gguf are installed, the ``peers``
extra): llama.cpp on a bf16 GGUF of the same checkpoint (``qwen3moe``,
``experiments.bench.gguf_writer``), one ``llama_decode`` per step for the batch; its greedy tokens
are checked against transformers eager like every contender's (the agreement column).

The result (``--out``) records the command and the load average at start and end: on a shared
machine rerun it quietly before trusting absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Optional

import torch

from experiments.bench.bandwidth import floor_bandwidth, measure_read_bandwidth
from experiments.bench.contenders import Contender, HFLoop, Piecewise, build_llm, load_hf
from experiments.bench.machine import machine
from experiments.bench.measure import measure_latency
from experiments.bench.targets import MOE_FLOOR_TARGET
from models.tiny import ensure_tiny_model
from passes.ops.packed_moe import PackedExpertsMethod, fused_moe_packed_cpu

PRESET = "bench-qwen3_moe"
CONTENDERS = ("hf_eager", "hf_compile", "O2", "O2_python_moe", "llamacpp_bf16")


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


@contextlib.contextmanager
def python_moe_body():
    """Within the block, ``piecewise::fused_moe_packed``'s CPU kernel is its Python body (the
    op's implementation before the C++ kernel); on exit the registration is dropped and the
    kernel registered before it (the C++ one, where built) runs again."""
    lib = torch.library.Library("piecewise", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators")
        lib.impl("fused_moe_packed", fused_moe_packed_cpu, "CPU")
    try:
        yield
    finally:
        del lib  # its finalizer deregisters the kernel


class PiecewisePythonMoE(Piecewise):
    """``O2`` with the MoE op's Python body (:func:`python_moe_body`) for its steps."""

    def generate(self, prompts, steps):
        with python_moe_body():
            return super().generate(prompts, steps)


class LlamaCpp(Contender):
    """llama.cpp (llama-cpp-python's low-level API,
    :class:`experiments.bench.peer_worker.LlamaCppRunner`) on a bf16 GGUF of the same checkpoint
    (:func:`experiments.bench.gguf_writer.write_gguf`): one context of ``max(batches)``
    sequences, one ``llama_decode`` per step for all of them, greedy argmax of the logits in
    numpy; a step is timed from the decode call to the tokens."""

    def __init__(self, name: str, gguf: str, args: argparse.Namespace):
        from experiments.bench.peer_worker import LlamaCppRunner

        self.name = name
        longest = args.steps + 2
        self.runner = LlamaCppRunner(
            {
                "gguf": gguf,
                "batches": sorted(args.batches),
                "prompt_len": args.prompt_len,
                "new_tokens": [longest],
                "check_tokens": longest,
                "threads": args.threads,
            }
        )

    def generate(self, prompts, steps):
        r = self.runner
        r.prepare(len(prompts))
        r.L.llama_memory_clear(r.L.llama_get_memory(r.ctx), True)
        r._decode(
            [
                (t, pos, s, pos == len(p) - 1)
                for s, p in enumerate(prompts)
                for pos, t in enumerate(p)
            ]
        )
        toks = r._argmax(len(prompts))
        out, times = [[t] for t in toks], []
        for step in range(steps):
            t0 = time.perf_counter()
            r._decode([(t, len(prompts[s]) + step, s, True) for s, t in enumerate(toks)])
            toks = r._argmax(len(prompts))
            times.append(time.perf_counter() - t0)
            for row, t in zip(out, toks):
                row.append(t)
        return out, times

    def close(self) -> None:
        self.runner.close()


def profile_ops(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """torch.profiler over ``steps`` decode steps of ``llm``: per op, calls and µs per step
    (self time: the op's own host and kernel time, children excluded; and total: with
    children), each with the per-layer share (``/ num_layers``)."""
    from torch.profiler import ProfilerActivity, profile

    from experiments.bench.measure import make_prompts

    prompts = make_prompts(batch, prompt_len, vocab)
    llm.generate(prompts, max_new_tokens=3, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)
    decode = list(llm.runner.step_times["decode"])[-steps:]
    layers = llm.model_config.num_layers
    rows = []
    for e in prof.key_averages():
        rows.append(
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_us_per_step": e.self_cpu_time_total / steps,
                "total_us_per_step": e.cpu_time_total / steps,
                "self_us_per_layer": e.self_cpu_time_total / steps / layers,
            }
        )
    rows.sort(key=lambda r: -r["self_us_per_step"])
    return {
        "steps": steps,
        "layers": layers,
        "profiled_step_ms_median": statistics.median(decode) * 1e3 if decode else None,
        "rows": rows,
    }


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
    experts where the engine packed them), that op's Python body on the same packed weights
    (``fused_moe_python``; whether the two agree bit for bit is recorded),
    ``piecewise::fused_moe`` on plain stacked weights (``F.linear`` per expert) and
    transformers' expert loop; a sample is the mean of 20 calls (one at the largest count, a
    b32 x 64-token prefill)."""
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
            **(
                {
                    "fused_moe_python": lambda: torch.ops.piecewise.fused_moe_packed_python(
                        x,
                        weights,
                        ids,
                        experts.w13,
                        experts.w2,
                        experts.w13_md,
                        experts.w2_md,
                        method.intermediate_size,
                        method.max_rows,
                    )
                }
                if isinstance(method, PackedExpertsMethod)
                else {}
            ),
            "fused_moe_plain": lambda: torch.ops.piecewise.fused_moe(x, weights, ids, w13, w2),
            "hf_expert_loop": lambda: _hf_expert_loop(x, weights, ids, w13, w2),
        }
        times: dict[str, list[float]] = {n: [] for n in fns}
        for f in fns.values():
            f()
        names = list(fns)
        reps = 20 if t <= 64 else 1  # per sample: a mean over this many calls
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn = fns[name]
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / reps)
        med = {n: statistics.median(v) for n, v in times.items()}
        row = {"tokens": t, "method": repr(method), "calls_per_sample": reps}
        row.update({f"{n}_ms": v for n, v in med.items()})
        if "fused_moe_python" in fns:  # the C++ kernel against its Python body, bit for bit
            row["op_equals_python_body"] = bool(
                torch.equal(fns["fused_moe"](), fns["fused_moe_python"]())
            )
        rows.append(row)
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
        "O2_python_moe": lambda: PiecewisePythonMoE("O2_python_moe", llm),
    }
    if "llamacpp_bf16" in args.contenders:
        make["llamacpp_bf16"] = lambda: LlamaCpp("llamacpp_bf16", llamacpp_gguf(path, cache), args)
    contenders = [make[name]() for name in args.contenders if llamacpp_ready(name)]
    kernel_rows = measure_kernel(llm, [1, 8, 32 * 64], max(5, args.rounds))
    rows = []
    for batch in args.batches:
        rows += measure_latency(contenders, "bfloat16", batch, args, vocab, print)
    for c in contenders:
        close = getattr(c, "close", None)
        if close is not None:
            close()
    profiles = {}
    if args.profile_steps:
        profiles["O2"] = profile_ops(llm, 1, args.prompt_len, args.profile_steps, vocab)
        with python_moe_body():
            profiles["O2_python_moe"] = profile_ops(
                llm, 1, args.prompt_len, args.profile_steps, vocab
            )
    weights = active_weight_bytes(llm)
    native, probe = floor_bandwidth()
    probes = {
        "native_read_probe": native,
        "small_m_kernel": max(kernel_read_bandwidth() for _ in range(3)),
    }
    for r in rows:  # every contender's own rate over the same active bytes, at its best b1 step
        if r["batch"] == 1 and r["min_ms"] > 0:
            probes[f"contender {r['contender']}"] = weights["total"] / (r["min_ms"] / 1e3)
    bandwidth = max(probes.values())
    o2_b1 = [r for r in rows if r["contender"] == "O2" and r["batch"] == 1]
    floor_ms = weights["total"] / bandwidth * 1e3
    core = weights["attention"] + weights["router"] + weights["top_k_experts"]
    result = {
        "preset": args.preset,
        "threads": args.threads,
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "kernel_rows": kernel_rows,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_source": max(probes, key=probes.get),
        "bandwidth_probes_gb_s": {k: v / 1e9 for k, v in probes.items()},
        "native_probe": {k: v for k, v in probe.items() if k != "rows"},
        "torch_sum_gb_s_not_used": measure_read_bandwidth() / 1e9,
        "packed_expert_layers": sum(
            isinstance(getattr(m, "moe_method", None), PackedExpertsMethod)
            for m in llm.model.modules()
        ),
        "moe_kernel": torch_ops_kernel(),
        "profiles": profiles,
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
        "machine": machine(),
        "command": "python -m experiments.bench.moe " + " ".join(args.argv),
        "active_weight_bytes": weights,
        "floor_ms": floor_ms,
        "floor_ms_attention_router_experts": core / bandwidth * 1e3,
        "o2_b1_over_floor": (o2_b1[0]["median_ms"] / floor_ms) if o2_b1 else None,
        "o2_b1_min_over_floor": (o2_b1[0]["min_ms"] / floor_ms) if o2_b1 else None,
    }
    return result


def llamacpp_ready(name: str) -> bool:
    """False (with a note) for the llama.cpp contender where llama-cpp-python or gguf is
    missing; True for every other contender."""
    if name != "llamacpp_bf16":
        return True
    import importlib.util

    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"llamacpp_bf16 skipped: {missing} not installed (pip install -e .[peers])")
    return not missing


def llamacpp_gguf(model_dir: str, work: str) -> str:
    """A bf16 GGUF of ``model_dir`` for llama.cpp, written under ``work``."""
    from experiments.bench.gguf_writer import write_gguf

    return str(write_gguf(model_dir, os.path.join(work, "model-bf16.gguf"), "bf16"))


def torch_ops_kernel() -> str:
    """Which CPU kernel ``piecewise::fused_moe_packed`` runs here."""
    from passes import native_ops

    return f"C++ ({native_ops.isa()})" if native_ops.loaded() else "Python body"


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
        "| tokens | fused_moe (the layer's op) ms | its Python body ms | "
        "fused_moe on plain weights ms | transformers expert loop ms | op == Python body |",
        "|---|---|---|---|---|---|",
    ]
    for r in result.get("kernel_rows", []):
        py = r.get("fused_moe_python_ms")
        lines.append(
            f"| {r['tokens']} | {r['fused_moe_ms']:.3f} | "
            + (f"{py:.3f}" if py is not None else "-")
            + f" | {r['fused_moe_plain_ms']:.3f} | {r['hf_expert_loop_ms']:.3f} | "
            f"{r.get('op_equals_python_body', '-')} |"
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
            f"{ratio:.2f}x median, {best:.2f}x best step (target <= {MOE_FLOOR_TARGET}x)"
            if ratio is not None
            else "n/a"
        ),
        "floor of attention + router + top-k experts alone (no LM head, norms or dense "
        f"layers): {result.get('floor_ms_attention_router_experts', float('nan')):.2f} ms",
        f"experts packed for the small-M kernel in {result['packed_expert_layers']} layer(s); "
        f"load average {result['load_average']}",
    ]
    for name, prof in result.get("profiles", {}).items():
        lines += [
            "",
            f"torch.profiler, {name}, b1 decode, {prof['steps']} steps, {prof['layers']} layers "
            f"(profiled step median {prof['profiled_step_ms_median']:.3f} ms); the 20 ops of "
            "most self time",
            "| op | calls / step | self us / step | total us / step | self us / layer |",
            "|---|---|---|---|---|",
        ]
        for r in prof["rows"][:20]:
            lines.append(
                f"| {r['op']} | {r['calls_per_step']:.1f} | {r['self_us_per_step']:.1f} | "
                f"{r['total_us_per_step']:.1f} | {r['self_us_per_layer']:.1f} |"
            )
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
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile this many O2 b1 decode steps (C++ and Python MoE kernel)",
    )
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
