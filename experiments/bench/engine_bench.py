"""What the benches that time one in-process engine's decode steps share (``step_parts``,
``engine_ab``): their model and engine arguments, and the ``LLM`` built from them."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser, batch: list[int]) -> None:
    """The model (``--preset`` tiny model or ``--model-dir``), dtype, level, batches, prompt
    length, decode steps, threads and artifact cache."""
    p.add_argument("--preset", default="default")
    p.add_argument("--model-dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=batch)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="artifact cache root (default: the user cache)")
    p.add_argument("--quantization", help="e.g. int8_per_token (default: none)")


def build_llm(args: argparse.Namespace):
    """(the ``LLM`` for the largest batch and the longest generation the bench runs, the
    model folder)."""
    from framework import LLM, CompilationConfig
    from models.tiny import ensure_tiny_model

    path = args.model_dir or str(ensure_tiny_model(preset=args.preset))
    llm = LLM(
        path,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=max(args.batch),
        max_model_len=args.prompt_len + args.steps + 16,
        compilation_config=CompilationConfig(
            level=args.level, cache_dir=args.cache_dir, progress_bar=False
        ),
    )
    return llm, path
