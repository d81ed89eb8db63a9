"""fuse_moe_router: softmax + top-k (+ renormalise) -> piecewise::topk_softmax, on a block and
on a tiny Qwen3-MoE through ``LLM`` with every CPU pass (O3) verified; the counts of the
other passes on the MoE model are printed for the report."""

import pytest
import torch
from graph_test_backend import TestBackend, assert_close_to_eager, compile_with, count_op

import passes.ops  # noqa: F401
from framework import LLM, CompilationConfig, PassConfig
from passes.manager import PassManager
from passes.ops.moe import topk_softmax_torch

aten, ops = torch.ops.aten, torch.ops.piecewise
E, H, I = 8, 32, 24  # noqa: E741


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    return (
        (0.1 * torch.randn(E, H, generator=g)).to(dtype),
        (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype),
        (0.1 * torch.randn(E, H, I, generator=g)).to(dtype),
    )


def _block(top_k, renormalize, cast):
    def block(x, gate, w13, w2):
        logits = torch.nn.functional.linear(x, gate)
        weights, ids = topk_softmax_torch(logits, top_k, renormalize)
        if cast:
            weights = weights.to(x.dtype)
        return ops.fused_moe(x, weights, ids, w13, w2)

    return block


@pytest.mark.parametrize(
    "dtype,top_k,renormalize",
    [(torch.float32, 2, True), (torch.bfloat16, 2, True), (torch.float32, 4, False)],
)
def test_router_fused(dtype, top_k, renormalize):
    pm = PassManager(PassConfig(passes=["noop_elimination", "fuse_moe_router"]), dtype=dtype)
    backend = TestBackend(pm)
    args = [torch.randn(6, H, dtype=dtype), *_weights(dtype)]
    fn = _block(top_k, renormalize, cast=dtype != torch.float32)
    out = compile_with(fn, backend, *args)
    assert count_op(backend.graph_before, aten.topk) == 1
    assert count_op(backend.graph_after, ops.topk_softmax) == 1
    assert count_op(backend.graph_after, aten.topk) == 0
    assert count_op(backend.graph_after, aten.exp) == 0
    assert pm.stats()["fuse_moe_router"]["total_matches"] == 1
    (node,) = [n for n in backend.graph_after.nodes if n.target is ops.topk_softmax.default]
    assert node.args[1:] == (top_k, renormalize)
    assert_close_to_eager(out, fn(*args), dtype)


def test_softmax_without_topk_is_left_alone():
    pm = PassManager(PassConfig(passes=["fuse_moe_router"]), dtype=torch.float32)
    backend = TestBackend(pm)
    compile_with(
        lambda x: torch.softmax(x, -1, dtype=torch.float32) * 2, backend, torch.randn(3, E)
    )
    assert count_op(backend.graph_after, ops.topk_softmax) == 0
    assert pm.warn_unmatched() == ["fuse_moe_router"]


@pytest.mark.slow  # ~15-40 s: every O3 pass verified on every piece of a 3-layer MoE
def test_o3_passes_on_a_moe_model_verify_and_match(tiny_checkpoint, compile_cache_dir):
    """Every CPU pass at O3 plus the router fusion, each verified against the piece before
    it; the router fusion matches once per MoE layer; tokens equal O0."""
    path = str(tiny_checkpoint("qwen3_moe"))
    prompts = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]
    expected = LLM(path, optimization_level=0, max_model_len=64).generate(
        prompts, 6, ignore_eos=True
    )
    llm = LLM(
        path,
        max_model_len=64,
        optimization_level=3,
        compilation_config=CompilationConfig(
            compiler="eager",
            progress_bar=False,
            cache_dir=compile_cache_dir,
            pass_config=PassConfig(verify_passes=True),
        ),
    )
    passes = llm.stats["passes"]
    counts = {name: rec["total_matches"] for name, rec in passes.items()}
    print("pass matches on test-qwen3_moe at O3 (eager adaptor):", counts)
    for name, rec in passes.items():
        assert rec["status"] == "ran", (name, rec["status"])
        assert rec["pieces"] and all(p["max_abs_error"] is not None for p in rec["pieces"])
    moe_layers = sum(llm.model_config.is_moe_layer(i) for i in range(3))
    assert counts["fuse_moe_router"] == moe_layers == 2
    assert counts["fuse_add_rmsnorm"] > 0 and counts["fuse_qk_norm_rope"] > 0
    assert llm.generate(prompts, 6, ignore_eos=True) == expected
