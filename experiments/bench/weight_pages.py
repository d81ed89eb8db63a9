"""Where a model's streamed weights live, and what it does to the decode step: one engine, its
packed weights swapped between placements in one process, rounds alternated.

    python -m experiments.bench.weight_pages [--model-dir DIR | --layers 22] [--rounds 6]
        [--steps 24] [--threads 2] [--variants as_loaded anon_4k anon_2m mapped mapped_huge]
        [--cache-dir DIR]

One ``LLM`` (bf16, O2, batch 1; default: the 1.1B TinyLlama-shape checkpoint of
``experiments.bench.memory``) is built once (a warm start when the cache holds it).  Then the
re-laid-out weights of its packed layers (every linear, the LM head) are given, in turn:

* ``as_loaded``: the tensors the engine built (a warm start: its processed-weights file, as it
  maps it; a cold one: where packing put them);
* ``anon_4k``: a copy in anonymous memory advised ``MADV_NOHUGEPAGE`` (4 KB pages: what
  torch's allocator gives a large tensor with transparent huge pages in ``madvise`` mode);
* ``anon_2m``: a copy from :class:`framework.core.huge_pages.HugePageAllocator` (a 2 MB-aligned
  mapping per tensor of 2 MB or more, its tail under 2 MB in small pages; smaller tensors in
  torch's memory: how a cold start placed the weights before slabs);
* ``anon_slabs``: a copy from ``HugePageAllocator.for_weights()`` (every tensor of 4 KB or
  more carved from shared slabs wholly in 2 MB pages: how a cold start places them now);
* ``mapped``: a second map of the processed-weights file, as the warm start maps it
  (``map_safetensors``: private, advised ``MADV_HUGEPAGE``; huge pages where the page cache
  holds the file in 2 MB folios -- a file written before its large tensors were 2 MB aligned
  maps mostly in 4 KB pages);
* ``mapped_huge``: the same, then ``MADV_COLLAPSE`` (file pages collapsed into huge pages:
  ``EINVAL`` on kernels without ``CONFIG_READ_ONLY_THP_FOR_FS``).

Swapping is ``param.data = other`` on the engine's own parameters (the compiled program reads
them through the same objects).  Each variant's backing is read from ``/proc/self/smaps``
(resident bytes, anonymous huge pages, file pages mapped huge), mapping by mapping: where a
variant leaves tensors in torch's heap (``as_loaded`` cold, ``anon_2m`` below 2 MB) the figures
are the heap mappings', whatever else they hold; ``placed_huge_gb`` is what the allocator
itself put in huge-page memory.  Per round every variant runs
one generation of ``--steps`` decode steps; the table gives each variant's median decode step
(the runner's step times), the ratio to ``anon_2m``, and the streaming rate.  Tokens must be
the same for every variant (checked).  Holds one extra copy of the weights per variant.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from framework.core import huge_pages as hp

VARIANTS = ("as_loaded", "anon_4k", "anon_2m", "anon_slabs", "mapped", "mapped_huge")


def streamed(llm) -> dict[str, torch.nn.Parameter]:
    """The re-laid-out parameters of the engine's packed layers, by name."""
    from framework.engine.model_prep import relaid_parameters

    return {
        f"{name}.{attr}": p
        for name in llm.packed_layers
        for attr, p in relaid_parameters(llm.model.get_submodule(name)).items()
    }


def anon_4k(t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    flat = torch.frombuffer(m, dtype=torch.uint8)
    hp.madvise(flat.data_ptr(), len(m), hp.MADV_NOHUGEPAGE)
    out = flat[:nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def mapped(names: list[str], path: str, huge: bool) -> tuple[dict, dict]:
    """The tensors as the warm start maps them (``framework.cache.weights.map_safetensors``:
    a private map of the processed-weights file); ``huge``: the map advised ``MADV_HUGEPAGE``
    before first touch, then ``MADV_COLLAPSE`` -- file pages mapped as huge pages where the
    kernel and the page cache allow it."""
    from framework.cache.weights import map_safetensors

    tensors, _ = map_safetensors(Path(path))
    out = {n: tensors[n] for n in names}
    storage = next(iter(out.values())).untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    info: dict[str, Any] = {}
    if huge:
        info["huge_errno"] = hp.madvise(base, size, hp.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    for v in out.values():
        v.view(-1).view(torch.uint8)[:: mmap.PAGESIZE].sum()  # touch every page
    info["touch_s"] = time.perf_counter() - t0
    if huge:
        t0 = time.perf_counter()
        info["collapse_errno"] = hp.madvise(base, size, hp.MADV_COLLAPSE)
        info["collapse_s"] = time.perf_counter() - t0
    return out, info


def run(args: argparse.Namespace) -> dict[str, Any]:
    from framework import LLM, CompilationConfig

    if args.model_dir:
        path = args.model_dir
    else:
        from experiments.bench.memory import ensure_checkpoint

        path = str(ensure_checkpoint(args.layers))
    t0 = time.perf_counter()
    llm = LLM(
        path,
        dtype="bfloat16",
        cache_dir=args.cache_dir,
        max_num_seqs=1,
        max_model_len=args.prompt_len + args.steps + 8,
        compilation_config=CompilationConfig(level=2, progress_bar=False),
    )
    print(
        f"# LLM(...) {time.perf_counter() - t0:.1f} s, weights cache "
        f"{llm.stats.get('weights_cache')}, {llm.weights_path}",
        flush=True,
    )
    params = streamed(llm)
    loaded = {n: p.data for n, p in params.items()}
    nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
    placements: dict[str, dict[str, torch.Tensor]] = {}
    info: dict[str, Any] = {}
    for v in args.variants:
        t0 = time.perf_counter()
        if v == "as_loaded":
            placements[v] = loaded
        elif v == "anon_4k":
            placements[v] = {n: anon_4k(t) for n, t in loaded.items()}
        elif v in ("anon_2m", "anon_slabs"):
            alloc = hp.HugePageAllocator() if v == "anon_2m" else hp.HugePageAllocator.for_weights()
            placements[v] = {n: alloc.copy(t) for n, t in loaded.items()}
            info[v] = {"placed_huge_gb": alloc.huge_bytes / 1e9}
        elif v in ("mapped", "mapped_huge"):
            if not llm.weights_path:
                print(f"# {v} skipped: no processed-weights file")
                continue
            placements[v], info[v] = mapped(list(loaded), llm.weights_path, v == "mapped_huge")
        info.setdefault(v, {})["place_s"] = time.perf_counter() - t0
    prompt = [[(7 * i + 3) % 1000 + 1 for i in range(args.prompt_len)]]

    def use(v: str) -> None:
        for n, p in params.items():
            p.data = placements[v][n]

    steps: dict[str, list[float]] = {v: [] for v in placements}
    tokens: dict[str, Any] = {}
    for v in placements:  # warm-up, and the first touch of every copy
        use(v)
        tokens[v] = llm.generate(prompt, args.steps, ignore_eos=True)
        b = hp.page_backing(list(placements[v].values()))
        info[v].update(
            rss_gb=b.rss / 1e9, anon_huge_gb=b.anon_huge / 1e9, file_pmd_gb=b.file_pmd / 1e9
        )
        print(f"# {v}: {info[v]}", flush=True)
    names = list(placements)
    for r in range(args.rounds):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            use(v)
            llm.runner.step_times["decode"].clear()
            out = llm.generate(prompt, args.steps, ignore_eos=True)
            assert out == tokens[names[0]], f"{v}: tokens differ"
            steps[v].append(statistics.median(llm.runner.step_times["decode"]) * 1e3)
        print(f"# round {r}: " + ", ".join(f"{v} {steps[v][-1]:.2f}" for v in names), flush=True)
    use(names[0])
    base = statistics.median(steps["anon_2m"]) if "anon_2m" in steps else None
    rows = {}
    print(f"# {nbytes / 1e9:.2f} GB streamed per step, {torch.get_num_threads()} threads")
    print("| placement | decode step ms (median) | min | vs anon_2m | GB/s | huge pages GB |")
    print("|---|---|---|---|---|---|")
    for v in names:
        med = statistics.median(steps[v])
        rows[v] = {"median_ms": med, "all_ms": steps[v], **info[v]}
        huge = info[v]["anon_huge_gb"] + info[v]["file_pmd_gb"]
        ratio = f"{med / base:.3f}" if base else "-"
        print(
            f"| {v} | {med:.2f} | {min(steps[v]):.2f} | {ratio} | {nbytes / med / 1e6:.1f} | "
            f"{huge:.2f} |"
        )
    return {"bytes": nbytes, "variants": rows, "tokens_equal": True}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="artifact cache root (default: the project's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model_dir:
        Path(args.model_dir).resolve(strict=True)
    return run(args)


if __name__ == "__main__":
    main()
