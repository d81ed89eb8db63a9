"""A tiny LLM at O2 (cold, then warm from the artifact cache) gives the same greedy tokens as
at O0.  Run by the GPU-image CI stage (scripts/ci_gpu_stack.sh) with torch 2.11; prints one
line and exits 1 on a mismatch.  ``python scripts/o2_equals_o0.py [cache_dir]``."""

from __future__ import annotations

import sys
import tempfile

import torch

from framework import LLM
from models.tiny import ensure_tiny_model

PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]


def main(argv: list[str]) -> int:
    cache = argv[0] if argv else tempfile.mkdtemp(prefix="o2-equals-o0-")
    path = str(ensure_tiny_model(cache + "/models", preset="test-llama"))
    kw = dict(max_model_len=64, max_num_seqs=2)
    o0 = LLM(path, optimization_level=0, **kw).generate(PROMPTS, 8, ignore_eos=True)
    cold = LLM(path, optimization_level=2, cache_dir=cache + "/artifacts", **kw)
    o2 = cold.generate(PROMPTS, 8, ignore_eos=True)
    warm = LLM(path, optimization_level=2, cache_dir=cache + "/artifacts", **kw)
    o2_warm = warm.generate(PROMPTS, 8, ignore_eos=True)
    ok = o0 == o2 == o2_warm
    print(
        f"torch {torch.__version__}: O0 {o0} | O2 cold {o2} (compiles "
        f"{cold.stats['compile_compiles']}) | O2 warm {o2_warm} (compiles "
        f"{warm.stats['compile_compiles']}): "
        f"{'same tokens' if ok else 'MISMATCH'}"
    )
    compiled = cold.stats["compile_compiles"] > 0 and warm.stats["compile_compiles"] == 0
    return 0 if ok and compiled else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
