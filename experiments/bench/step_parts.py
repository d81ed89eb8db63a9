"""Where a decode step's time goes, timed without a profiler: wall-clock wrappers on the parts.

    python -m experiments.bench.step_parts [--batch 1 8] [--steps 64] [--reps 3] [--threads 2]
        [--model-dir DIR | --preset NAME] [--dtype bfloat16] [--level 2]

The torch profiler adds a record per op, which weighs most on the parts made of many small
calls, and ``profile_step``'s "elementwise pieces" row also holds the Python that joins the
pieces.  Here the engine runs as it always does; only these calls are timed, with one
``perf_counter`` pair each:

===================  =========================================================================
forward              ``ModelRunner.forward``: the compiled model, every piece and op
  attention          the fused CPU attention calls inside it (``cpu_paged.paged_attention``)
  compiled kernels   the Inductor kernels the lean pieces call (norms, RoPE, activations)
LM head              ``compute_logits``, or the head's fused greedy kernel
                     (``ModelRunner.greedy_logits``: logits and each row's argmax)
sampler              the sampler (after a fused head: its reading of the head's choice)
build_context        staging a step's inputs and attention metadata
rest of the step     the step minus the four above: scheduling, the scheduler update,
                     outputs, and the engine loop
===================  =========================================================================

A part's time per decode step comes from two generations of ``--steps + 8`` and 8 new tokens
after the same prompts (the difference, over ``--steps``, leaves out prefill and warm-up);
the table gives the median over ``--reps`` such pairs, the calls per step and µs per call.
The linears are what the forward has left after attention and the compiled kernels, together
with the Python that joins the pieces.  The engine runs without piece replay
(``CompilationConfig.cpu_replay_max_tokens``): a replayed piece's kernels are called from
C++, where these timers do not reach; ``engine_ab --ab cpu_replay`` measures what replay
saves.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from experiments.bench.engine_bench import add_engine_args, build_llm

PARTS = (
    "forward",
    "attention",
    "compiled kernels",
    "LM head",
    "sampler",
    "build_context",
    "rest of the step",
)


class Timers:
    """Seconds and calls per part name."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, fn, part: str):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += clock() - t0
                self.calls[part] += 1

        return timed

    def wrap_fused(self, fn, part: str):
        """As :meth:`wrap`, for a call that may decline (return None): only the calls that
        did the work are counted."""
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            got = fn(*args, **kwargs)
            if got is not None:
                self.seconds[part] += clock() - t0
                self.calls[part] += 1
            return got

        return timed

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.seconds), dict(self.calls)


@contextmanager
def _kernel_timers(timers: Timers) -> Iterator[None]:
    """Lean pieces loaded inside this block hand out timed kernels (restored on exit)."""
    from backends.piecewise import inductor_lean

    cls = inductor_lean.AsyncCompile
    original = cls.cpp_pybinding_named

    def named(self, name: str, argtypes: Any, source: str):
        return timers.wrap(original(self, name, argtypes, source), "compiled kernels")

    cls.cpp_pybinding_named = named
    try:
        yield
    finally:
        cls.cpp_pybinding_named = original


@contextmanager
def _attention_timer(timers: Timers) -> Iterator[None]:
    from backends.attention import cpu_paged

    original = cpu_paged.paged_attention
    cpu_paged.paged_attention = timers.wrap(original, "attention")
    try:
        yield
    finally:
        cpu_paged.paged_attention = original


def build(args: argparse.Namespace, timers: Timers):
    """The LLM with its runner's parts wrapped (call inside :func:`_kernel_timers`: pieces
    load their kernels when a token range is first run)."""
    llm, path = build_llm(args)
    runner = llm.runner
    # The parts are timed through their Python calls; a replayed piece makes none (its native
    # calls run from C++: backends/piecewise/replay.py), so the pieces run as they are written.
    runner.cpu_replay_max_tokens = 0
    runner.forward = timers.wrap(runner.forward, "forward")
    runner.model.compute_logits = timers.wrap(runner.model.compute_logits, "LM head")
    if runner.greedy_logits is not None:  # the head's fused greedy kernel: the LM head row
        runner.greedy_logits = timers.wrap_fused(runner.greedy_logits, "LM head")
    # The sampler stays a Sampler (the runner takes the fused head's tokens only from one):
    # its pass over the logits, or its reading of the fused head's choice, is the sampler row.
    sampler = runner.sampler
    sampler.sample = timers.wrap(sampler.sample, "sampler")
    sampler.from_argmax = timers.wrap(sampler.from_argmax, "sampler")
    runner.build_context = timers.wrap(runner.build_context, "build_context")
    return llm, path


def measure(llm, timers: Timers, batch: int, prompt_len: int, steps: int, reps: int) -> dict:
    """Per decode step: ms per part (median over reps), calls per step, µs per call."""
    g = torch.Generator().manual_seed(batch)
    vocab = llm.model_config.vocab_size
    prompts = [torch.randint(vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    llm.generate(prompts, 4, ignore_eos=True)  # warm-up
    s_start = timers.snapshot()[0]
    per_step: dict[str, list[float]] = {p: [] for p in PARTS}
    per_step["step"] = []
    calls: dict[str, float] = {}
    for _ in range(reps):
        s0, c0 = timers.snapshot()
        t0 = time.perf_counter()
        llm.generate(prompts, 8, ignore_eos=True)
        t_short = time.perf_counter() - t0
        s1, c1 = timers.snapshot()
        t0 = time.perf_counter()
        llm.generate(prompts, 8 + steps, ignore_eos=True)
        t_long = time.perf_counter() - t0
        s2, c2 = timers.snapshot()
        step = (t_long - t_short) / steps
        per_step["step"].append(step)
        for p in PARTS[:-1]:
            short = s1.get(p, 0.0) - s0.get(p, 0.0)
            long_ = s2.get(p, 0.0) - s1.get(p, 0.0)
            per_step[p].append((long_ - short) / steps)
            calls[p] = ((c2.get(p, 0) - c1.get(p, 0)) - (c1.get(p, 0) - c0.get(p, 0))) / steps
        outer = ("forward", "LM head", "sampler", "build_context")
        per_step["rest of the step"].append(step - sum(per_step[p][-1] for p in outer))
    out: dict[str, Any] = {"batch": batch, "step_ms": statistics.median(per_step["step"]) * 1e3}
    # seconds per part over every generation of this batch (prefill included): the parts
    # nested in the forward always sum to less than it, whatever the noise of the differences
    s_end = timers.snapshot()[0]
    out["total_s"] = {p: s_end.get(p, 0.0) - s_start.get(p, 0.0) for p in PARTS[:-1]}
    for p in PARTS:
        ms = statistics.median(per_step[p]) * 1e3
        n = calls.get(p)
        out[p] = {
            "ms": ms,
            "calls_per_step": n,
            "us_per_call": ms * 1e3 / n if n else None,
        }
    return out


def format_table(rows: list[dict]) -> str:
    batches = [r["batch"] for r in rows]
    head = "| part | " + " | ".join(f"b{b} ms/step (calls, µs/call)" for b in batches) + " |"
    lines = [head, "|---" * (len(batches) + 1) + "|"]
    lines.append("| decode step | " + " | ".join(f"**{r['step_ms']:.3f}**" for r in rows) + " |")
    for p in PARTS:
        cells = []
        for r in rows:
            e = r[p]
            extra = ""
            if e["calls_per_step"]:
                extra = f" ({e['calls_per_step']:.0f}, {e['us_per_call']:.1f})"
            cells.append(f"{e['ms']:.3f}{extra}")
        name = f"&nbsp;&nbsp;{p}" if p in ("attention", "compiled kernels") else p
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p, batch=[1, 8])
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    timers = Timers()
    with _attention_timer(timers), _kernel_timers(timers):
        llm, path = build(args, timers)
        rows = [measure(llm, timers, b, args.prompt_len, args.steps, args.reps) for b in args.batch]
    print(
        f"# decode step parts: {path}, {args.dtype}, O{args.level}, prompt {args.prompt_len}, "
        f"{args.steps} steps x {args.reps} reps (medians), {torch.get_num_threads()} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
