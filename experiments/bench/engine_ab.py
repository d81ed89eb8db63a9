"""Two forms of one engine internal, alternated inside one engine: the same model, weights and
caches, so the fresh-process noise of this machine (10-40% between processes) is not in the
ratio.

    python -m experiments.bench.engine_ab --ab kv_pages [--batch 1 8 32] [--rounds 8]
    python -m experiments.bench.engine_ab --ab split_calls [--batch 1 8 32] [--rounds 12]
    python -m experiments.bench.engine_ab --ab attention_rev --baseline REV [--batch 8]
    python -m experiments.bench.engine_ab --ab greedy_head [--batch 1 8] [--rounds 12]
    python -m experiments.bench.engine_ab --ab attention_call [--batch 1 8 32] [--rounds 12]
    python -m experiments.bench.engine_ab --ab cpu_replay [--batch 1 8] [--rounds 12]
    python -m experiments.bench.engine_ab --ab forward_replay [--batch 1 8] [--rounds 12]

===============  ==========================================================================
``kv_pages``     the KV caches in 4 KB pages (torch's allocator) against 2 MB pages (where
                 ``framework.engine.kv_cache`` puts them): the same contents, swapped in the
                 runner's cache dict between generations; timed: each attention call
``split_calls``  the split module calling each splitting op through its submodule against
                 the op's overload called from its own code (``inline_splitting_ops``):
                 two graphs over the same installed pieces; timed: each decode forward
``attention_rev`` the fused CPU attention kernel built from ``--baseline`` (a git revision
                 or a .cpp file, as ``attention_ab`` takes it) against the current source,
                 both called through ctypes (the op's Python body), the library swapped
                 between generations: the kernel change inside a decode step, where its
                 calls are cold; timed: each attention call
``attention_call`` the attention backend calling the kernel through the op's Python body
                 (checks in Python, ctypes) against the op's C++ CPU kernel
                 (``csrc/cpu_paged_op.cpp``: checks in C++, no marshalling), switched between
                 generations: the per-call cost of the glue; timed: each attention call
``greedy_head``  a greedy step's LM head then the sampler's pass over the logits against
                 the head's kernel choosing each row's token as it stores the logits
                 (``ModelRunner.fuse_greedy_head``, switched between generations); timed:
                 each LM head + token choice (``ModelRunner._sample``; a prefill's is the
                 same call: one row per request)
``cpu_replay``   each lean piece running its Python against replaying the native calls it
                 recorded (``backends/piecewise/replay.py``; ``ModelRunner``'s
                 ``cpu_replay_max_tokens`` 0 or the config's, switched between
                 generations); timed: each decode forward
``forward_replay`` each piece replaying on its own, the Python of the forward between them,
                 against the whole forward replayed as one recording
                 (``backends/piecewise/forward_replay.py``; ``ForwardReplay.enabled``
                 switched between generations); timed: each decode forward
===============  ==========================================================================

Every form but ``forward_replay`` runs its engine without the whole-forward replay
(``ForwardReplay.enabled`` off): those forms switch or time what the forward's Python calls
(an attention call, the split module's code, the pieces' replay), which a forward replayed
as one recording does not run.  Pieces still replay on their own where a form leaves them.

Each round runs both forms (order alternating by round) on the same prompts: a 2-token
warm-up, then ``--steps`` + 8 new tokens; the table gives, per form, the median over every
timed decode call of the rounds (prefill calls are not recorded), its interquartile range,
the ratio to the first form, the median decode step (``ModelRunner.step_times``: the whole
step but the scheduler) and its ratio, and whether the two forms produced the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from experiments.bench.engine_bench import add_engine_args, build_llm

FORMS = {
    "kv_pages": ("4 KB pages", "2 MB pages"),
    "split_calls": ("submodules", "inlined"),
    "attention_rev": ("baseline", "current"),
    "greedy_head": ("head, then sampler", "greedy head"),
    "attention_call": ("Python body, ctypes", "C++ op kernel"),
    "cpu_replay": ("pieces run", "pieces replayed"),
    "forward_replay": ("pieces replayed", "forward replayed"),
}


class _Calls:
    """Seconds of each call of a wrapped function that ``keep(args)`` says is a decode's."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def wrap(self, fn: Callable, keep: Callable[[tuple], bool]) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if keep(args):
                    self.seconds.append(time.perf_counter() - t0)

        return timed


@contextmanager
def _attention_timed(calls: _Calls) -> Iterator[None]:
    from backends.attention import cpu_paged

    original = cpu_paged.paged_attention
    # (q, k, v, out, kv_cache, metadata, ...): a decode's metadata has one query per request
    cpu_paged.paged_attention = calls.wrap(original, lambda a: a[5].max_query_len == 1)
    try:
        yield
    finally:
        cpu_paged.paged_attention = original


def kv_pages_forms(llm) -> dict[str, Callable[[], None]]:
    """Installers of the two page sizes' copies of the engine's KV caches."""
    from framework.core.huge_pages import HugePageAllocator

    caches = llm.runner.kv_caches
    plain = {n: t.clone() for n, t in caches.items()}  # torch's allocator: 4 KB pages
    alloc = HugePageAllocator(min_bytes=0)  # each cache in 2 MB pages, whatever its size
    huge = {n: alloc.copy(t) for n, t in caches.items()}
    if alloc.huge_bytes == 0:
        raise SystemExit(
            f"engine_ab kv_pages: no huge pages here (transparent_hugepage: {alloc.mode})"
        )
    return {
        "4 KB pages": lambda: caches.update(plain),
        "2 MB pages": lambda: caches.update(huge),
    }


@contextmanager
def _built_without_inlining() -> Iterator[None]:
    """An engine built inside the block keeps each splitting op behind its submodule."""
    from backends.piecewise import backend

    original = backend.inline_splitting_ops
    backend.inline_splitting_ops = lambda split: 0
    try:
        yield
    finally:
        backend.inline_splitting_ops = original


def split_calls_forms(llm) -> dict[str, Callable[[], None]]:
    """Installers of the engine's split module (built by :func:`_built_without_inlining`:
    splitting ops behind their submodules) and of a copy with them inlined, over the same
    installed pieces."""
    import torch.fx as fx

    from backends.piecewise.split import inline_splitting_ops

    forward = llm.runner.forward
    through, binding = forward.compiled_fn, forward.binding
    graph = fx.Graph()
    graph.output(graph.graph_copy(through.graph, {}))
    inlined = fx.GraphModule(through, graph)  # the pieces' runtimes copied over by name
    if inline_splitting_ops(inlined) == 0:
        raise SystemExit("engine_ab split_calls: the model has no splitting-op submodule")

    def install(gm) -> Callable[[], None]:
        def run() -> None:
            forward.install(gm, binding)

        return run

    return {"submodules": install(through), "inlined": install(inlined)}


def _attention_through(library: Optional[Any]) -> Callable[[], None]:
    """An installer: the attention backend calls the kernel through ctypes with ``library``
    (the op's Python body's path), or (None) as it does by default: the op's C++ kernel,
    without the dispatcher where its library has a Python module."""
    from backends.attention import cpu_paged

    def forward(q, k, v, out, kv_cache, md, scale, sliding_window) -> None:
        # cpu_paged.paged_attention looked up per call: the timing wrapper stands there.
        cpu_paged.paged_attention(
            q, k, v, out, kv_cache, md, scale, sliding_window, library=library
        )

    def run() -> None:
        cpu_paged.CpuPagedAttention.forward = staticmethod(forward)

    return run


def attention_rev_forms(baseline: str, work: Path) -> dict[str, Callable[[], None]]:
    """Installers of two builds of the fused attention kernel: ``baseline`` (a git revision
    or a .cpp file) and the current source, both called through ctypes."""
    from backends.attention.cpu_paged_build import LIBRARY
    from experiments.bench.attention_ab import baseline_library

    return {
        f"baseline {baseline}": _attention_through(baseline_library(baseline, work)),
        "current": _attention_through(LIBRARY.load(None)),
    }


def attention_call_forms() -> dict[str, Callable[[], None]]:
    """Installers of the two ways the backend reaches the current kernel: the op's Python
    body (ctypes) and the op's C++ CPU kernel."""
    from backends.attention.cpu_paged_build import LIBRARY, load_op

    if not load_op():
        raise SystemExit("engine_ab attention_call: the op library cannot be built here")
    return dict(
        zip(
            FORMS["attention_call"],
            (_attention_through(LIBRARY.load(None)), _attention_through(None)),
        )
    )


def greedy_head_forms(llm) -> dict[str, Callable[[], None]]:
    """Switches of the runner between the LM head followed by the sampler's argmax pass and
    the head's fused greedy kernel."""
    runner = llm.runner
    if runner.greedy_logits is None:
        raise SystemExit("engine_ab greedy_head: the model has no fused greedy LM head")

    def use(fused: bool) -> Callable[[], None]:
        def run() -> None:
            runner.fuse_greedy_head = fused

        return run

    return dict(zip(FORMS["greedy_head"], (use(False), use(True))))


def cpu_replay_forms(llm) -> dict[str, Callable[[], None]]:
    """Switches of the runner between running every piece and replaying the pieces' recorded
    native calls."""
    runner = llm.runner
    from framework.core.config import CompilationConfig

    limit = llm.worker.config.cpu_replay_max_tokens or CompilationConfig().cpu_replay_max_tokens

    def use(tokens: int) -> Callable[[], None]:
        def run() -> None:
            runner.cpu_replay_max_tokens = tokens

        return run

    return dict(zip(FORMS["cpu_replay"], (use(0), use(limit))))


def forward_replay_forms(llm) -> dict[str, Callable[[], None]]:
    """Switches of the worker's whole-forward replay (pieces still replay in both forms)."""
    replay = llm.worker.forward_replay
    if replay is None:
        raise SystemExit(
            "--ab forward_replay: this engine has no forward replay (a CPU "
            "engine at O1+ with cpu_replay_max_tokens > 0)"
        )

    def use(on: bool) -> Callable[[], None]:
        def run() -> None:
            replay.enabled = on

        return run

    return dict(zip(FORMS["forward_replay"], (use(False), use(True))))


def measure(llm, forms: dict[str, Callable[[], None]], calls: _Calls, batch: int, args) -> dict:
    g = torch.Generator().manual_seed(batch)
    vocab = llm.model_config.vocab_size
    prompts = [torch.randint(vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
    names = list(forms)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, Any] = {}
    decode_times = llm.runner.step_times["decode"]
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            forms[name]()
            llm.generate(prompts, 2, ignore_eos=True)
            calls.seconds.clear()
            decode_times.clear()
            tokens[name] = llm.generate(prompts, args.steps + 8, ignore_eos=True)
            seconds[name].extend(calls.seconds)
            steps[name].extend(decode_times)
    base = statistics.median(seconds[names[0]])
    base_step = statistics.median(steps[names[0]])
    rows = []
    for name in names:
        xs = seconds[name]
        q1, _, q3 = statistics.quantiles(xs, n=4)
        med = statistics.median(xs)
        rows.append(
            {
                "batch": batch,
                "form": name,
                "median_us": med * 1e6,
                "iqr_us": (q1 * 1e6, q3 * 1e6),
                "calls": len(xs),
                "ratio": med / base,
                "step_ms": statistics.median(steps[name]) * 1e3,
                "step_ratio": statistics.median(steps[name]) / base_step,
                "same_tokens": tokens[name] == tokens[names[0]],
            }
        )
    return rows


def format_table(rows: list[dict], what: str) -> str:
    lines = [
        f"| batch | form | {what} median µs | IQR µs | calls | ratio | decode step ms | "
        "ratio | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| b{r['batch']} | {r['form']} | {r['median_us']:.1f} | {r['iqr_us'][0]:.1f}-"
            f"{r['iqr_us'][1]:.1f} | {r['calls']} | {r['ratio']:.3f} | {r['step_ms']:.3f} | "
            f"{r['step_ratio']:.3f} | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ab", required=True, choices=sorted(FORMS))
    add_engine_args(p, batch=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--baseline", help="attention_rev: a git revision or a .cpp file")
    args = p.parse_args(argv)
    if args.ab == "attention_rev" and not args.baseline:
        p.error("--ab attention_rev needs --baseline (a git revision or a .cpp file)")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    build = _built_without_inlining() if args.ab == "split_calls" else contextlib.nullcontext()
    with build:
        llm, path = build_llm(args)
    replay = llm.worker.forward_replay
    if replay is not None and args.ab != "forward_replay":
        replay.enabled = False  # the forms below hook the forward's Python (module docstring)
    calls = _Calls()
    if args.ab == "kv_pages":
        forms, what = kv_pages_forms(llm), "attention call"
        timing = _attention_timed(calls)
    elif args.ab == "attention_rev":
        work = Path(tempfile.mkdtemp(prefix="engine-ab-"))
        forms, what = attention_rev_forms(args.baseline, work), "attention call"
        timing = _attention_timed(calls)
    elif args.ab == "attention_call":
        forms, what = attention_call_forms(), "attention call"
        timing = _attention_timed(calls)
    elif args.ab == "greedy_head":
        forms, what = greedy_head_forms(llm), "LM head + token choice"
        sample = llm.runner._sample
        llm.runner._sample = calls.wrap(sample, lambda a: True)
        timing = _restore(llm.runner, "_sample", sample)
    else:
        if args.ab == "cpu_replay":
            forms = cpu_replay_forms(llm)
        elif args.ab == "forward_replay":
            forms = forward_replay_forms(llm)
        else:
            forms = split_calls_forms(llm)
        what = "decode forward"
        forward = llm.runner.forward
        llm.runner.forward = calls.wrap(forward, _decode_step)
        timing = _restore(llm.runner, "forward", forward)
    from backends.attention import cpu_paged

    backend = cpu_paged.CpuPagedAttention
    with timing, _restore(backend, "forward", backend.__dict__["forward"]):
        rows = [r for b in args.batch for r in measure(llm, forms, calls, b, args)]
    print(
        f"# engine A/B {args.ab}: {path}, {args.dtype}, O{args.level}, prompt {args.prompt_len}, "
        f"{args.steps} steps x {args.rounds} rounds (forms alternated), {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(format_table(rows, what))
    return rows


def _decode_step(args: tuple) -> bool:
    """Whether the forward in progress is a decode step (one query token per request)."""
    from framework.core.forward_context import get_forward_context

    return all(md.max_query_len == 1 for md in get_forward_context().attn_metadata.values())


@contextmanager
def _restore(obj: Any, attr: str, value: Any) -> Iterator[None]:
    try:
        yield
    finally:
        setattr(obj, attr, value)


if __name__ == "__main__":
    main()
