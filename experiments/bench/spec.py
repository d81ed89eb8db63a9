"""Speculative decoding against plain decoding, side by side: tokens/s at batch 1 and 8.

    python -m experiments.bench.spec                       # bf16, O2, 5 rounds
    python -m experiments.bench.spec --rounds 9 --out experiments/bench/results/spec_bench_cpu.json

Three comparisons, every engine built once (O2, bf16) and timed in alternated rounds (round r
runs the engines in an order rotated by r), medians over the rounds and the paired per-round
ratios (``experiments.report.statistics.compare``: geometric mean and 95% interval):

* ``ngram_copy`` -- prompt-lookup drafts (``method=ngram``, k) on the default tiny model with
  the copy-heavy prompts of ``workload=copy`` (``experiments.run.job_inputs.copy_prompts``: a
  random seed text and the model's own greedy continuation of it, which loops), against the
  same engine without speculation; ``copy_fraction`` says how much of the continuation an
  n-gram lookup could draft.  Same tokens
  required.  Target: >= 2x tokens/s at batch 1.  ``ngram_copy_cut`` times the same n-gram
  engine with ``prompt_lookup_periodic=False`` (drafts stop where the sequence ends instead
  of continuing a loop shorter than k) against the same plain engine: the A/B of that
  option, in the same rounds.
* ``draft_addition`` -- the trained draft ``models/synthetic/addition-draft`` drafting for
  ``models/synthetic/addition`` on held-out addition prompts (the answer and its EOS).
  Acceptance (per position, mean accepted length) and the speed-up.  Target: >= 1.5x at
  batch 1 when acceptance >= 0.7.  This target (2 layers, hidden 128) costs only about 1.4x
  its 1-layer draft per step, both bound by per-call fixed cost, which caps what any
  speculation can gain with this pair.
* ``draft_addition_large`` -- the same draft drafting for ``models/synthetic/addition-large``
  (8 layers, hidden 256, trained on the same task by the same script): a target several
  times its draft's cost, the pair speculative decoding is meant for.  Same target.
* ``<scenario>_draft_steps`` -- the A/B of the draft's native greedy steps, in the same
  rounds: the drafted engine against a second one whose draft runner has
  ``fuse_greedy_head`` off, so each greedy draft comes from its logits and a separate argmax
  in the Python step loop, instead of its LM head's greedy kernel and (where its forward
  replays whole) the single-token steps replayed as one native recording
  (``framework/engine/spec/draft_loop.py``); same tokens (required).
* ``<scenario>_catch_up_joined`` -- the A/B of the draft's catch-up joining that native loop
  (a whole propose call replayed as one tape where its catch-up is one replayed forward),
  in the same rounds: the drafted engine against a third one whose step loop has
  ``joins_catch_up`` off (the catch-up in Python, then the loop); same tokens (required).
* ``verify_step`` -- the cost of one verify step of 1 + k tokens per request against one plain
  decode step (default model): ``experiments.bench.verify_step`` (the engine's runner, decode
  and verify steps alternated in every round, the median per-round ratio).  Target: <= 1.3x
  at k = 4.

Batch 1 runs the prompts one ``generate`` call at a time; batch 8 runs them in one call with
``max_num_seqs=8``.  The machine's load average is recorded next to the numbers: on a loaded
machine the ratios are noisy; rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from experiments.bench import targets as bench_targets
from experiments.bench.machine import machine
from experiments.report.statistics import compare
from experiments.run.job_inputs import copy_fraction, copy_prompts
from framework import LLM

REPO = Path(__file__).resolve().parents[2]
ADDITION = REPO / "models" / "synthetic" / "addition"
ADDITION_DRAFT = REPO / "models" / "synthetic" / "addition-draft"
ADDITION_LARGE = REPO / "models" / "synthetic" / "addition-large"
DRAFT_PAIRS = {
    "draft_addition": (ADDITION, ADDITION_DRAFT),
    "draft_addition_large": (ADDITION_LARGE, ADDITION_DRAFT),
}
"""Draft-model scenarios: (target, draft) checkpoints of the addition task."""


def copy_workload(plain: LLM, n: int, seed_len: int, echo_len: int) -> list[list[int]]:
    """The copy-heavy prompts of ``workload=copy`` (``experiments.run.job_inputs.copy_prompts``),
    echoed by the plain engine."""
    from omegaconf import OmegaConf

    workload = OmegaConf.create(
        dict(num_prompts=n, prompt_len_min=seed_len, prompt_len_max=seed_len, echo_len=echo_len)
    )

    def echo(prompts, m):
        return plain.generate(prompts, m, ignore_eos=True)

    return copy_prompts(workload, plain.model_config.vocab_size, 0, echo)


@dataclass
class Contender:
    """One engine and the workload it times."""

    name: str
    llm: LLM
    prompts: list[list[int]]
    max_new_tokens: int
    ignore_eos: bool
    batch: int
    tokens_per_s: list[float] = field(default_factory=list)
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    outputs: Optional[list[list[int]]] = None

    def run(self) -> None:
        for t in self.llm.runner.step_times.values():
            t.clear()
        t0 = time.perf_counter()
        outs: list[list[int]] = []
        for i in range(0, len(self.prompts), self.batch):
            outs += self.llm.generate(
                self.prompts[i : i + self.batch], self.max_new_tokens, ignore_eos=self.ignore_eos
            )
        elapsed = time.perf_counter() - t0
        self.tokens_per_s.append(sum(len(o) for o in outs) / elapsed)
        for kind, times in self.llm.runner.step_times.items():
            if times:
                self.step_ms.setdefault(kind, []).append(1e3 * statistics.median(times))
        if self.outputs is None:
            self.outputs = outs
        elif outs != self.outputs:
            raise RuntimeError(f"{self.name}: outputs changed between rounds")


def _spec_stats(llm: LLM) -> dict[str, Any]:
    return {k: v for k, v in llm.stats.items() if k.startswith("spec_")}


def _ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    c = compare(a, b)
    return {
        "ratio": c.ratio if c else statistics.median(a) / statistics.median(b),
        "ci95": [c.lo, c.hi] if c else None,
        "median_of_round_ratios": c.median_ratio if c else None,
        "ratio_of_medians": statistics.median(a) / statistics.median(b),
    }


def build(model: str, *, spec: Optional[dict], dtype: str, level: int, seqs: int, **kw) -> LLM:
    return LLM(
        model,
        dtype=dtype,
        optimization_level=level,
        max_num_seqs=seqs,
        speculative_config=spec,
        **kw,
    )


def run(
    *,
    rounds: int,
    k: int,
    dtype: str,
    level: int,
    batches: Sequence[int],
    cache_dir: Optional[str],
    num_prompts: int,
    new_tokens: int,
    scenarios: Sequence[str],
    log=print,
) -> dict[str, Any]:
    from experiments.synthetic.task import get_task
    from models.tiny import ensure_tiny_model

    common = dict(dtype=dtype, level=level, seqs=max(batches), cache_dir=cache_dir)
    pairs: dict[str, tuple[str, str]] = {}  # (scenario, batch) -> (baseline, spec)
    contenders: list[Contender] = []
    extra: dict[str, Any] = {}
    default_model = str(ensure_tiny_model())

    if "ngram_copy" in scenarios:
        log(f"building the default model (plain, {dtype}, O{level})")
        plain = build(default_model, spec=None, max_model_len=512, **common)
        log(f"building the default model with n-gram speculation (k={k})")
        ngram = build(
            default_model,
            spec={"method": "ngram", "num_speculative_tokens": k},
            max_model_len=512,
            **common,
        )
        log("building it again with prompt_lookup_periodic=False (the option's A/B)")
        cut = build(
            default_model,
            spec={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_periodic": False},
            max_model_len=512,
            **common,
        )
        prompts = copy_workload(plain, num_prompts, seed_len=16, echo_len=192)
        for b in batches:
            base = Contender(f"ngram_copy b{b} plain", plain, prompts, new_tokens, True, b)
            spec = Contender(f"ngram_copy b{b} ngram k={k}", ngram, prompts, new_tokens, True, b)
            stop = Contender(f"ngram_copy_cut b{b} ngram k={k}", cut, prompts, new_tokens, True, b)
            contenders += [base, spec, stop]
            pairs[f"ngram_copy b{b}"] = (base.name, spec.name)
            pairs[f"ngram_copy_cut b{b}"] = (base.name, stop.name)
        extra["ngram_copy"] = {"llm": ngram, "prompts": prompts}
        extra["ngram_copy_cut"] = {"llm": cut}
    for scenario, (target_dir, draft_dir) in DRAFT_PAIRS.items():
        if scenario not in scenarios:
            continue
        task = get_task("addition")
        keys = task.held_out_keys(num_prompts, 1234)
        prompts, _ = task.split(task.sequences(keys))
        log(f"{scenario}: building {target_dir.name} (plain) and with its draft {draft_dir.name}")
        kw = dict(common, max_model_len=64)
        target = build(str(target_dir), spec=None, **kw)
        draft_spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
        drafted = build(str(target_dir), spec=draft_spec, **kw)
        unfused = build(str(target_dir), spec=draft_spec, **kw)
        unfused.spec.proposer.runner.fuse_greedy_head = False
        apart = build(str(target_dir), spec=draft_spec, **kw)
        if apart.spec.proposer.step_loop is not None:  # None: no native loop (O0, fp32)
            apart.spec.proposer.step_loop.joins_catch_up = False
        for b in batches:
            n_new = task.answer_len + 1
            base = Contender(f"{scenario} b{b} plain", target, prompts, n_new, False, b)
            spec = Contender(f"{scenario} b{b} draft k={k}", drafted, prompts, n_new, False, b)
            name = f"{scenario} b{b} draft k={k}, Python steps, head then argmax"
            argmax = Contender(name, unfused, prompts, n_new, False, b)
            name = f"{scenario} b{b} draft k={k}, catch-up apart from the step loop"
            split = Contender(name, apart, prompts, n_new, False, b)
            contenders += [base, spec, argmax, split]
            pairs[f"{scenario} b{b}"] = (base.name, spec.name)
            pairs[f"{scenario}_draft_steps b{b}"] = (argmax.name, spec.name)
            pairs[f"{scenario}_catch_up_joined b{b}"] = (split.name, spec.name)
        extra[scenario] = {"llm": drafted, "prompts": prompts}
    log(f"untimed round, then {rounds} alternated rounds of {len(contenders)} workloads")
    for c in contenders:
        c.run()
    for c in contenders:
        c.tokens_per_s.clear()
        c.step_ms.clear()
    for r in range(rounds):
        for i in range(len(contenders)):
            contenders[(r + i) % len(contenders)].run()
        log(f"  round {r + 1}/{rounds}")

    by_name = {c.name: c for c in contenders}
    results: dict[str, Any] = {}
    for key, (base_name, spec_name) in pairs.items():
        base, spec = by_name[base_name], by_name[spec_name]
        entry: dict[str, Any] = {
            "prompts": len(base.prompts),
            "batch": base.batch,
            "same_tokens": base.outputs == spec.outputs,
        }
        entry.update(
            tokens_per_s={
                "plain": statistics.median(base.tokens_per_s),
                "spec": statistics.median(spec.tokens_per_s),
            },
            speedup=_ratio(spec.tokens_per_s, base.tokens_per_s),
            step_ms_medians={
                "plain": {k2: statistics.median(v) for k2, v in base.step_ms.items()},
                "spec": {k2: statistics.median(v) for k2, v in spec.step_ms.items()},
            },
        )
        results[key] = entry
    if "ngram_copy" in extra:
        x = extra["ngram_copy"]
        results["ngram_copy_acceptance"] = _spec_stats(x["llm"])
        outs = by_name[pairs[f"ngram_copy b{batches[0]}"][0]].outputs
        results["ngram_copy_copy_fraction"] = copy_fraction(x["prompts"], outs)
        results["ngram_copy_cut_acceptance"] = _spec_stats(extra["ngram_copy_cut"]["llm"])
    for scenario in DRAFT_PAIRS:
        if scenario in extra:
            results[f"{scenario}_acceptance"] = _spec_stats(extra[scenario]["llm"])
    if "verify_step" in scenarios:
        # The verify-step cost has one home: experiments.bench.verify_step (same engine
        # runner, decode and verify steps alternated per round, per-round ratios).
        from experiments.bench import verify_step as bench_verify_step

        log(f"verify step of 1 + {k} tokens vs a decode step (experiments.bench.verify_step)")
        argv = ["--k", str(k), "--batch", *map(str, batches), "--rounds", str(max(rounds, 3))]
        argv += ["--dtype", dtype, "--level", str(level)]
        if cache_dir:
            argv += ["--cache-dir", cache_dir]
        got = bench_verify_step.main(argv)
        results["verify_step"] = dict(got, target="verify / decode <= 1.3 at k = 4")
    return results


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.spec", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("-O", dest="level", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--new-tokens", type=int, default=64, help="n-gram workload: new tokens")
    ap.add_argument(
        "--scenarios",
        default="ngram_copy,draft_addition,draft_addition_large,verify_step",
        help="comma-separated",
    )
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--out",
        default=None,
        help="write the JSON here (e.g. experiments/bench/results/spec_bench_cpu.json)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = run(
        rounds=args.rounds,
        k=args.k,
        dtype=args.dtype,
        level=args.level,
        batches=[int(b) for b in args.batches.split(",")],
        cache_dir=args.cache_dir,
        num_prompts=args.prompts,
        new_tokens=args.new_tokens,
        scenarios=[s for s in args.scenarios.split(",") if s],
    )
    record = {
        "command": "python -m experiments.bench.spec " + " ".join(argv or sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            **machine(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "settings": {
            "dtype": args.dtype,
            "level": args.level,
            "k": args.k,
            "rounds": args.rounds,
            "batches": args.batches,
            "prompts": args.prompts,
        },
        "wall_s": time.perf_counter() - t0,
        "results": results,
        "targets": bench_targets.spec_targets(results),
    }
    text = json.dumps(record, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    print("\n".join(bench_targets.markdown(record["targets"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
