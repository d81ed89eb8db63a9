"""The tensor-parallel passes: fuse_allreduce_rmsnorm and sequence_parallelism.

The end-to-end test runs TP=2 (gloo, two processes) at O2 with both passes, a concrete
compile size of 32 tokens and a sequence-parallel threshold of 16:
the general range (1..128) gets the all-reduce fusion, the 32-token pieces get sequence
parallelism, and greedy tokens equal TP=1.
"""

from __future__ import annotations

import pytest
import torch

from framework.core.parallel_state import TPState, tp_state
from passes.base import PassContext
from passes.registry import order_passes
from passes.sequence_parallelism import SequenceParallelismPass

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], list(range(20, 45))]  # 32 tokens in the first step


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


def test_order_puts_tp_passes_before_the_add_norm_fusion():
    names = ["fuse_add_rmsnorm", "fuse_allreduce_rmsnorm", "sequence_parallelism"]
    assert order_passes(names) == [
        "sequence_parallelism",
        "fuse_allreduce_rmsnorm",
        "fuse_add_rmsnorm",
    ]


def test_sequence_parallelism_applies_only_to_big_concrete_sizes():
    sp = SequenceParallelismPass(PassContext(sequence_parallel_min_tokens=64))
    with tp_state(TPState(0, 2, "")):
        assert not sp.is_applicable(_Range(1, 512))  # a dynamic range: chunks may be unequal
        assert not sp.is_applicable(_Range(32, 32))  # below the threshold
        assert not sp.is_applicable(_Range(65, 65))  # not divisible by the world size
        assert sp.is_applicable(_Range(64, 64))
        assert sp.is_applicable(_Range(256, 256))
    assert not sp.is_applicable(_Range(256, 256))  # one process


@pytest.fixture(scope="module")
def mqa_checkpoint(tmp_path_factory):
    from models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt-mqa-passes")
    return write_tiny_checkpoint(
        root / "mqa", "test-llama", seed=1, num_key_value_heads=1, vocab_size=251
    )


def _by_range(stats):
    out = {}
    for p in stats["pieces"]:
        key = tuple(p["compile_range"])
        out[key] = out.get(key, 0) + p["matches"]
    return out


def test_tp2_o2_with_both_passes(mqa_checkpoint, tmp_path):
    from framework.engine.llm import LLM

    torch.set_num_threads(1)
    ref = LLM(str(mqa_checkpoint), optimization_level=0, max_model_len=128)
    expected = ref.generate(PROMPTS, max_new_tokens=6)
    dump = tmp_path / "dump"
    cc = {
        "level": 2,
        "compile_sizes": [32],
        "debug_dump_path": str(dump),
        "pass_config": {
            "enable": ["sequence_parallelism", "fuse_allreduce_rmsnorm"],
            "sequence_parallel_min_tokens": 16,
        },
    }
    llm = LLM(
        str(mqa_checkpoint),
        compilation_config=cc,
        tensor_parallel_size=2,
        cache_dir=str(tmp_path / "cache"),
        max_model_len=128,
    )
    try:
        assert llm.generate(PROMPTS, max_new_tokens=6) == expected
        assert llm.runner.trace[0]["num_padded_tokens"] == 32  # the first step ran the SP pieces
        passes = llm.stats["passes"]
    finally:
        llm.close()
    # Two decoder layers, two all-reduce + add + norm sites each (the last feeds the final norm).
    sp, fused = passes["sequence_parallelism"], passes["fuse_allreduce_rmsnorm"]
    assert _by_range(sp) == {(32, 32): 4}  # only the concrete size above the threshold
    assert _by_range(fused) == {(1, 128): 4, (32, 32): 0}  # SP took those sites first
    code = (dump / "split_graph.py").read_text()
    assert code.count("_c10d_functional.all_reduce") == 5  # the trace itself is unchanged


@pytest.mark.slow  # reason: another cold TP=2 O2 compile (~2 min under load)
def test_tp2_verify_passes_runs_on_every_rank(mqa_checkpoint, tmp_path):
    """verify_passes at TP=2: each rank runs every piece before and after each pass (the
    collectives in the piece run on both ranks in step) and records its error."""
    from framework.engine.llm import LLM

    cc = {
        "level": 2,
        "pass_config": {"enable": ["fuse_allreduce_rmsnorm"], "verify_passes": True},
    }
    llm = LLM(
        str(mqa_checkpoint),
        compilation_config=cc,
        tensor_parallel_size=2,
        cache_dir=str(tmp_path / "cache"),
        max_model_len=128,
    )
    try:
        llm.generate(PROMPTS[:2], max_new_tokens=2)
        fused = llm.stats["passes"]["fuse_allreduce_rmsnorm"]
    finally:
        llm.close()
    assert _by_range(fused) == {(1, 128): 4}
    errors = [p["max_abs_error"] for p in fused["pieces"] if p["matches"]]
    assert errors and all(e == 0 for e in errors)  # the reference op is bit-identical
