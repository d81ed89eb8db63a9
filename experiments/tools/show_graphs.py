"""Print one piece's graph at each stage a pass author cares about.

    python -m experiments.tools.show_graphs              # default tiny model, O2, piece submod_2
    python -m experiments.tools.show_graphs --model test-qwen3 --level 3 --piece submod_0
    python -m experiments.tools.show_graphs --model /path/to/hf_folder \
        --passes noop_elimination,my.mod:MyPass
    python -m experiments.tools.show_graphs --list  # the pieces and their stage files

Stages: ``dynamo`` (the piece as split from Dynamo's graph: torch-level ops), ``post_grad`` (what
the first pass receives: AOTAutograd-functionalized, Inductor-decomposed aten, after Inductor's
own post-grad passes) and ``after_<pass>`` for every pass in run order.  It builds the model
with ``debug_dump_path`` (which forces every piece to compile, caches notwithstanding) into a
temporary folder, or ``--dump DIR`` to keep the files.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from framework.core.config import CompilationConfig, PassConfig
from framework.engine.llm import LLM
from models.tiny import ensure_tiny_model


def _model_path(model: str) -> str:
    if Path(model).is_dir():
        return model
    return str(ensure_tiny_model(preset=model))


def stage_files(dump: Path, piece: str) -> list[tuple[str, Path]]:
    """``(stage name, file)`` of one piece in a ``debug_dump_path`` folder, in stage order."""
    stages = [("dynamo", dump / f"{piece}.py")]
    piece_dir = dump / "passes" / piece
    if not piece_dir.is_dir():
        return stages
    for rng_dir in sorted(piece_dir.iterdir()):
        shared = rng_dir / "same_graph_as.txt"
        if shared.is_file():  # identical layers compile once: show the original's graphs
            original = shared.read_text().strip()
            return [("dynamo", dump / f"{piece}.py")] + stage_files(dump, original)[1:]
        for f in sorted(rng_dir.glob("*.txt")):
            name = "post_grad" if f.name.startswith("00_") else f.stem.split("_", 1)[1]
            stages.append((f"{name} [{rng_dir.name}]", f))
        break  # the first range shows the forms; --dump keeps the others
    return stages


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.tools.show_graphs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="default",
        help="tiny-model preset (default, test-llama, test-qwen3, ...) or HF folder",
    )
    p.add_argument("--level", type=int, default=2, help="optimization level (default 2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--compiler",
        default="inductor",
        choices=["inductor", "eager"],
        help="compiler adaptor (eager: same post-grad graphs, no Inductor codegen)",
    )
    p.add_argument(
        "--passes", default=None, help="comma-separated pass list (default: the level's)"
    )
    p.add_argument(
        "--piece",
        default="submod_2",
        help="piece name (default submod_2: a "
        "middle piece, the second half of layer 0 and the first of layer 1)",
    )
    p.add_argument("--stage", default=None, help="print only stages starting with this")
    p.add_argument("--dump", default=None, help="keep the dump here (default: temporary)")
    p.add_argument("--list", action="store_true", help="list pieces and stages only")
    args = p.parse_args(argv)

    dump = Path(args.dump or tempfile.mkdtemp(prefix="piecewise-graphs-"))
    pass_config = PassConfig(passes=args.passes.split(",")) if args.passes else PassConfig()
    LLM(
        _model_path(args.model),
        dtype=args.dtype,
        max_model_len=64,
        optimization_level=args.level,
        compilation_config=CompilationConfig(
            debug_dump_path=str(dump),
            progress_bar=False,
            compiler=args.compiler,
            pass_config=pass_config,
        ),
    )
    pieces = sorted(
        (f.stem for f in dump.glob("submod_*.py")), key=lambda n: int(n.removeprefix("submod_"))
    )
    if args.list or args.piece not in pieces:
        if not args.list:
            print(f"no piece {args.piece!r}; pieces: {', '.join(pieces)}", file=sys.stderr)
        for piece in pieces:
            print(piece + ": " + ", ".join(s for s, _ in stage_files(dump, piece)))
        return 0 if args.list else 2
    for stage, path in stage_files(dump, args.piece):
        if args.stage and not stage.startswith(args.stage):
            continue
        print(f"===== {args.piece} · {stage} ({path})\n{path.read_text()}")
    if not args.dump:
        print(f"(files under {dump})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
