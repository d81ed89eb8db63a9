"""The tensor-parallel passes: fuse_allreduce_rmsnorm and sequence_parallelism.

The end-to-end test runs TP=2 (gloo, two processes) at O2 with both passes, a concrete
compile size of 32 tokens and a sequence-parallel threshold of 16:
the general range (1..128) gets the all-reduce fusion, the 32-token pieces get sequence
parallelism, and greedy tokens equal TP=1.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from process_group_harness import run_ranks, run_script
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from framework.core.parallel_state import TPState, tp_state
from passes.base import PassContext
from passes.fuse_allreduce_rmsnorm import FuseAllReduceRMSNormPass
from passes.fusion_patterns import rms_norm_hf
from passes.pattern_fusion import trace_pattern
from passes.registry import order_passes
from passes.sequence_parallelism import SequenceParallelismPass
from passes.verify import PassVerifier

_C10D = torch.ops._c10d_functional

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


def _decoder_tail(group):
    """o_proj output -> all-reduce -> residual add -> RMSNorm, as a decoder layer ends."""

    def f(x, residual, weight):
        reduced = _C10D.wait_tensor(_C10D.all_reduce(x, "sum", group))
        add = residual + reduced
        return rms_norm_hf(add, weight, 1e-6), add

    return f


@pytest.mark.parametrize("cls", [SequenceParallelismPass, FuseAllReduceRMSNormPass])
def test_tp_passes_build_and_match_without_running_a_collective(cls):
    """Building the pass traces its pattern on fake tensors: no process group is needed (a
    real trace would run the all-reduce, a cross-rank call, and fail here on the unknown
    group), and the pattern still matches a graph of the same shape."""
    assert not dist.is_initialized()
    with tp_state(TPState(0, 2, "no-such-group")):
        p = cls(PassContext(dtype=torch.float32, sequence_parallel_min_tokens=16))
        with FakeTensorMode():
            args = [torch.randn(32, 16), torch.randn(32, 16), torch.randn(16)]
            gm = trace_pattern(_decoder_tail("no-such-group"), args)
        p(gm.graph)
    assert p.match_count == 1
    targets = {n.target for n in gm.graph.nodes}
    assert _C10D.all_reduce.default not in targets
    if cls is SequenceParallelismPass:
        assert {_C10D.reduce_scatter_tensor.default, _C10D.all_gather_into_tensor.default} <= (
            targets
        )


def _verify_collectives_rank(rank, world):
    """One rank: verify a graph of gloo collectives under the Python dispatcher (as Inductor
    calls the passes), several times."""
    group = dist.group.WORLD.group_name

    def f(x):
        g = _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, world, group))
        r = _C10D.wait_tensor(_C10D.reduce_scatter_tensor(g * 2, "sum", world, group))
        return _C10D.wait_tensor(_C10D.all_reduce(r + 1, "sum", group)).sum(-1)

    with FakeTensorMode():
        gm = trace_pattern(f, [torch.randn(8, 16)])
    for _ in range(10):
        v = PassVerifier()
        with enable_python_dispatcher():
            v.start_piece(gm.graph, None)
            err = v.check_pass("unchanged", gm.graph)
        assert (err.max_abs, err.max_rel) == (0.0, 0.0)


def test_verify_passes_runs_collectives_across_ranks_without_deadlock():
    """Before the fix the verifier's collectives ran with Inductor's Python dispatcher on: the
    gloo thread inherited it and needed the GIL for its own ``narrow`` while this thread held
    the GIL waiting for it (a hang on the first or second iteration)."""
    run_ranks(_verify_collectives_rank, world=2, timeout_s=90)


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


@pytest.mark.slow(reason="two TP=2 O2 builds with Inductor compiles (~16 s)")
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
            "passes": ["+sequence_parallelism", "+fuse_allreduce_rmsnorm"],
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
    # Each rank dumps into its own folder (before: both wrote into one).
    assert sorted(p.name for p in dump.iterdir()) == ["rank_0", "rank_1"]
    after_sp = {}
    for r in (0, 1):
        code = (dump / f"rank_{r}" / "split_graph.py").read_text()
        assert code.count("_c10d_functional.all_reduce") == 5  # the trace itself is unchanged
        files = sorted((dump / f"rank_{r}" / "passes").glob("*/*/*_after_sequence_parallelism.txt"))
        after_sp[r] = [f.read_text() for f in files]
    assert len(after_sp[0]) == len(after_sp[1]) > 0
    assert after_sp[0] != after_sp[1]  # each rank keeps its own slice of the residual


_VERIFY_RUN = """
import json, sys, torch
from framework.engine.llm import LLM
torch.set_num_threads(1)
path, cache, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cc = {
    "level": 2,
    "compile_sizes": [32],
    "pass_config": {
        "passes": ["+sequence_parallelism", "+fuse_allreduce_rmsnorm"],
        "sequence_parallel_min_tokens": 16,
        "verify_passes": True,
    },
}
llm = LLM(path, compilation_config=cc, tensor_parallel_size=2, cache_dir=cache, max_model_len=128)
try:
    tokens = llm.generate(prompts, max_new_tokens=4)
    passes = llm.stats["passes"]
finally:
    llm.close()
print("RESULT " + json.dumps({"tokens": tokens, "passes": passes}))
"""


@pytest.mark.slow  # reason: a cold TP=2 O2 compile that runs every piece before and after
# each pass (28 s on a quiet machine, 40 s under load)
def test_tp2_verify_passes_with_sequence_parallelism_on_every_rank(mqa_checkpoint, tmp_path):
    """verify_passes at TP=2 with both TP passes: each rank runs every piece before and after
    each pass (the collectives in the piece run on both ranks in step: reduce-scatter and
    all-gathers in the 32-token pieces) and records its error.  In a child process under a
    deadline, so a deadlock fails the test instead of hanging it."""
    from framework.engine.llm import LLM

    ref = LLM(str(mqa_checkpoint), optimization_level=0, max_model_len=128)
    expected = ref.generate(PROMPTS, max_new_tokens=4)
    env = {**os.environ, "PIECEWISE_TP_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}
    args = ["-c", _VERIFY_RUN, str(mqa_checkpoint), str(tmp_path / "cache"), json.dumps(PROMPTS)]
    done = run_script(args, timeout_s=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["tokens"] == expected
    sp, fused = result["passes"]["sequence_parallelism"], result["passes"]["fuse_allreduce_rmsnorm"]
    assert _by_range(sp) == {(32, 32): 4}  # verified in range, on the SP-sized pieces only
    assert _by_range(fused) == {(1, 128): 4, (32, 32): 0}
    for record in (sp, fused):
        errors = [p["max_abs_error"] for p in record["pieces"] if p["matches"]]
        assert errors and all(e == 0 for e in errors)  # two ranks: a + b either way
