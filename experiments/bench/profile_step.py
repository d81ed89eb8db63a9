"""Roofline of one decode step: where the time of a step goes, against what memory allows.

    python -m experiments.bench.profile_step [--dtype bfloat16] [--batch 1] [--level 2]
        [--threads 2]

Builds an ``LLM`` (the default tiny model unless ``--model-dir``/``--preset``), runs a warm-up
generation, then profiles a generation with the torch profiler.  Each decode step (one
iteration of ``generate``'s loop, from one ``runner.execute`` start to the next) is split into:

=====================  ======================================================================
linears                the projection matmuls inside the model forward (prepacked oneDNN,
                       ``aten::linear``/``mm``/``addmm``), outside attention
attention              ``piecewise::attention`` calls (KV write + attention)
elementwise pieces     the rest of the forward: compiled pieces' norms, RoPE, activations,
                       residuals, and the piece-call / runtime-wrapper overhead
LM head + sampling     ``runner.execute`` after the forward: ``compute_logits``, argmax,
                       reading tokens back
host                   the rest of the step: scheduling, staging inputs, forward context,
                       dispatch, scheduler update
=====================  ======================================================================

Each row's floor is the bytes it must move per step divided by this machine's read bandwidth,
measured by the command with the native read probe
(:func:`experiments.bench.bandwidth.floor_bandwidth`:
pinned OpenMP threads, 4 streams each, AVX-512 loads, with and without prefetch, 2 MB and 4 KB
pages, the best case; ``torch.sum`` only where the probe cannot be built): linears read
their weights; attention reads every context token's K and V; elementwise pieces read the
norm weights and (an estimate) ~10 hidden-size + 3 intermediate-size activation vectors per
token and layer; the LM head reads its weight and writes/reads the logits; host work has no
memory floor.  The last row compares the unprofiled step (median) with the weights' streaming
floor (every weight but the embedding table read once per step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from experiments.bench.bandwidth import floor_bandwidth, format_probe
from framework.engine.request import step_kind

ROWS = ("linears", "attention", "elementwise pieces", "LM head + sampling", "host")
LINEAR_OPS = frozenset(
    {
        "piecewise::packed_linear",
        "piecewise::int8_packed_linear",
        "piecewise::int8_wo_packed_linear",
        "piecewise::int8_scaled_mm",
        "piecewise::int8_weight_only_mm",
        "mkldnn::_linear_pointwise",
        "aten::linear",
        "aten::addmm",
        "aten::mm",
    }
)
ATTENTION_OP = "piecewise::attention"
_EXEC, _FWD = "profile_step::execute", "profile_step::forward"


@dataclass
class Row:
    name: str
    ms: float
    bytes: int

    def floor_ms(self, bandwidth: float) -> Optional[float]:
        return self.bytes / bandwidth * 1e3 if self.bytes else None


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time of the union of ``a`` that lies inside the union of ``b``."""
    return _union_us(a) + _union_us(b) - _union_us(a + b)


class _Probe:
    """Wraps ``runner.execute`` and ``runner.forward`` in profiler ranges (the decode steps are
    told apart by the range name) and times unprofiled step periods; ``close`` restores."""

    def __init__(self, runner: Any):
        self.runner, self.starts = runner, []
        self._execute, self._forward = runner.execute, runner.forward

        def execute(chunks, *args, **kw):
            decode = step_kind(chunks) == "decode"
            self.starts.append((time.perf_counter(), decode))
            with record_function(f"{_EXEC}[{'decode' if decode else 'other'}]"):
                return self._execute(chunks, *args, **kw)

        def forward(*args, **kw):
            with record_function(_FWD):
                return self._forward(*args, **kw)

        runner.execute, runner.forward = execute, forward

    def decode_periods(self) -> list[float]:
        s = self.starts
        return [s[i + 1][0] - s[i][0] for i in range(len(s) - 1) if s[i][1] and s[i + 1][1]]

    def close(self) -> None:
        del self.runner.execute
        self.runner.forward = self._forward


def split_steps(events) -> list[dict[str, float]]:
    """Per decode step (that has a following decode step), µs per row, from profiler events."""

    def span(e):
        return (e.time_range.start, e.time_range.end)

    execs = sorted(
        (e for e in events if e.name.startswith(_EXEC)), key=lambda e: e.time_range.start
    )
    fwds = [span(e) for e in events if e.name == _FWD]
    attn = [span(e) for e in events if e.name == ATTENTION_OP]
    lin = [span(e) for e in events if e.name in LINEAR_OPS]
    steps = []
    for cur, nxt in zip(execs, execs[1:]):
        if not (cur.name.endswith("[decode]") and nxt.name.endswith("[decode]")):
            continue
        (s0, s1), period = span(cur), nxt.time_range.start - cur.time_range.start
        f = [iv for iv in fwds if s0 <= iv[0] and iv[1] <= s1]
        fwd = _union_us(f)
        inside = lambda ivs: [iv for iv in ivs if any(a <= iv[0] and iv[1] <= b for a, b in f)]
        a, lv = inside(attn), inside(lin)
        attention = _union_us(a)
        linears = _union_us(lv) - _overlap_us(lv, a)
        lm_head = s1 - max((e for _, e in f), default=s0)
        steps.append(
            {
                "linears": linears,
                "attention": attention,
                "elementwise pieces": fwd - attention - linears,
                "LM head + sampling": lm_head,
                "host": period - fwd - lm_head,
                "step": period,
            }
        )
    return steps


def step_bytes(llm: Any, batch: int, mean_ctx: float) -> dict[str, int]:
    """Bytes each row must move per decode step (see the module docstring)."""
    mc, model = llm.model_config, llm.model
    elem = torch.empty(0, dtype=llm.dtype).element_size()
    head = getattr(model, "lm_head", None)
    head_w = head.weight if head is not None else None
    linear = other = 0
    packed = set(getattr(llm, "packed_layers", []))  # re-laid out: any shape
    for name, p in model.named_parameters():
        if p is head_w or "embed" in name:
            continue
        if p.dim() == 2 or name.rpartition(".")[0] in packed:
            linear += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    head_bytes = head_w.numel() * head_w.element_size() if head_w is not None else 0
    kv = int(2 * mc.num_layers * batch * mean_ctx * mc.num_kv_heads * mc.head_dim * elem)
    acts = batch * mc.num_layers * (10 * mc.hidden_size + 3 * mc.intermediate_size) * elem
    logits = batch * mc.vocab_size * (elem + 2 * 4)
    return {
        "linears": linear,
        "attention": kv,
        "elementwise pieces": other + acts,
        "LM head + sampling": head_bytes + logits,
        "host": 0,
        "weights": linear + head_bytes,
    }


def profile_decode(
    llm: Any, batch: int, prompt_len: int, steps: int, seed: int = 0
) -> dict[str, Any]:
    """Warm up, time an unprofiled generation, profile one; returns per-row ms per step."""
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    prompts = [torch.randint(vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    probe = _Probe(llm.runner)
    try:
        llm.generate(prompts, 3, ignore_eos=True)
        probe.starts.clear()
        llm.generate(prompts, steps + 1, ignore_eos=True)
        periods = probe.decode_periods()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, steps + 1, ignore_eos=True)
    finally:
        probe.close()
    per_step = split_steps(prof.events())
    if not per_step:
        raise RuntimeError(
            "profile_step: the profiled generation had no consecutive decode steps; raise --steps"
        )
    mean = {k: statistics.fmean(s[k] for s in per_step) / 1e3 for k in per_step[0]}
    return {
        "ms": mean,
        "steps": len(per_step),
        "unprofiled_step_ms": statistics.median(periods) * 1e3,
        "mean_ctx": prompt_len + 1 + (steps - 1) / 2,
    }


def roofline(
    llm: Any, batch: int, prompt_len: int, steps: int, bandwidth: Optional[float] = None
) -> dict[str, Any]:
    probe: dict[str, Any] = {"probe": "given"}
    if not bandwidth:
        bandwidth, probe = floor_bandwidth()
    prof = profile_decode(llm, batch, prompt_len, steps)
    nbytes = step_bytes(llm, batch, prof["mean_ctx"])
    rows = [Row(name, prof["ms"][name], nbytes[name]) for name in ROWS]
    return {
        "rows": rows,
        "step_ms": prof["ms"]["step"],
        "bandwidth": bandwidth,
        "bandwidth_probe": probe,
        "unprofiled_step_ms": prof["unprofiled_step_ms"],
        "weights_bytes": nbytes["weights"],
        "steps": prof["steps"],
    }


def format_table(result: dict[str, Any]) -> str:
    bw, step = result["bandwidth"], result["step_ms"]
    lines = [
        "| component | ms / step | share | MB moved | floor ms | × floor |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        floor = r.floor_ms(bw)
        ratio = f"{r.ms / floor:.1f}×" if floor else "—"
        lines.append(
            f"| {r.name} | {r.ms:.3f} | {100 * r.ms / step:.0f}% | "
            f"{r.bytes / 1e6:.2f} | {floor:.3f} | {ratio} |"
            if floor
            else f"| {r.name} | {r.ms:.3f} | {100 * r.ms / step:.0f}% | — | — | — |"
        )
    lines.append(f"| sum (profiled step) | {step:.3f} | 100% | | | |")
    wfloor = result["weights_bytes"] / bw * 1e3
    un = result["unprofiled_step_ms"]
    lines.append(
        f"| whole step, unprofiled (median) vs weights' streaming floor | {un:.3f} | | "
        f"{result['weights_bytes'] / 1e6:.2f} | {wfloor:.3f} | {un / wfloor:.2f}× |"
    )
    return "\n".join(lines)


def format_rates(result: dict[str, Any]) -> str:
    """The rate at which the unprofiled step streams its weights, against the floor's."""
    bw, un = result["bandwidth"], result["unprofiled_step_ms"]
    probe = result.get("bandwidth_probe", {})
    achieved = result["weights_bytes"] / (un / 1e3)
    how = probe.get("probe", "-") + (f", {probe['best_case']}" if "best_case" in probe else "")
    return (
        f"the step streams its weights at {achieved / 1e9:.1f} GB/s; the floor's read "
        f"bandwidth is {bw / 1e9:.1f} GB/s ({how})"
        + ("" if achieved <= bw else ": the step beats the probe, so the probe under-measures")
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="default", help="models.tiny preset")
    p.add_argument("--model-dir", help="an HF checkpoint folder instead of a preset")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--level", type=int, default=2, help="optimization level (0-3)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="profiled decode steps")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--attention-backend", help="default: the device's default backend")
    p.add_argument("--cache-dir", help="artifact cache root (default: the user cache)")
    p.add_argument("--quantization", help="e.g. int8_per_token (default: none)")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.steps < 2:
        p.error("--steps must be at least 2 (a step is timed to the next one's start)")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from framework import LLM
    from models.tiny import ensure_tiny_model

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model_dir or str(ensure_tiny_model(preset=args.preset))
    llm = LLM(
        path,
        dtype=args.dtype,
        optimization_level=args.level,
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + args.steps + 8,
        cache_dir=args.cache_dir,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
    )
    result = roofline(llm, args.batch, args.prompt_len, args.steps)
    print(
        f"# decode step roofline: {path}, {args.dtype}"
        f"{', ' + args.quantization if args.quantization else ''}, O{args.level}, "
        f"batch {args.batch}, "
        f"prompt {args.prompt_len}, attention {llm.runner.attention_backend}, "
        f"{torch.get_num_threads()} threads, read bandwidth {result['bandwidth'] / 1e9:.1f} "
        f"GB/s, {result['steps']} profiled steps, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(format_table(result))
    print(format_rates(result))
    if "rows" in result["bandwidth_probe"]:
        print(format_probe(result["bandwidth_probe"]))
    return result


if __name__ == "__main__":
    main()
