"""MoE models in bf16: the engine re-lays every layer's stacked experts once for the small-M
kernel (``process_weights``): the packed stacks are the model's own tensors (no plain expert
weights left), the logits and greedy tokens stay those of the plain experts, and an O2 engine
runs ``piecewise::fused_moe_packed`` inside its pieces (the ``prepack_linear`` pass counts
it) with the tokens of an O0 engine (plain experts)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import MOE_FAMILIES
from paged_harness import PagedHarness

from framework import LLM
from framework.core.config import CompilationConfig, KernelConfig, PassConfig
from framework.engine.model_prep import process_weights
from models.loader import load_model
from models.moe import FusedMoE
from passes import small_m_linear as small_m
from passes.ops.packed_moe import PackedExpertsMethod

pytestmark = pytest.mark.skipif(
    not small_m.kernel_available(), reason="needs the small-M kernel built here"
)

PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250], [5] * 20]
NEW_TOKENS = 8


def _config(**kernels) -> CompilationConfig:
    return CompilationConfig(
        pass_config=PassConfig(passes=["prepack_linear"]), kernel_config=KernelConfig(**kernels)
    )


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_are_packed_once_and_compute_the_same(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    model, config = load_model(path, torch.bfloat16)
    harness = PagedHarness(model)
    logits = harness.prefill_logits(PROMPTS)
    tokens = PagedHarness(model).greedy(PROMPTS, NEW_TOKENS)
    bytes_before = sum(p.numel() for p in model.parameters())
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]
    assert experts
    names = process_weights(model, _config())
    assert [n for n, _ in experts] == [n for n in names if n.endswith(".experts")]
    I, H = config.moe_intermediate_size, config.hidden_size  # noqa: E741
    for _, m in experts:
        assert isinstance(m.moe_method, PackedExpertsMethod)
        assert m.w13.shape == (config.num_experts, *small_m.panel_shape(2 * I, H))
        assert m.w2.shape == (config.num_experts, *small_m.panel_shape(H, I))
    # no plain [E, N, K] expert stack (nor any per-expert tensor) is left in the model
    assert not [n for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]
    assert sum(p.numel() for p in model.parameters()) >= bytes_before  # padding only
    after = PagedHarness(model).prefill_logits(PROMPTS)
    for a, b in zip(after, logits):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    assert PagedHarness(model).greedy(PROMPTS, NEW_TOKENS) == tokens, family
    assert process_weights(model, _config()) == []  # nothing left to re-lay out


def test_kernel_config_off_keeps_the_experts_plain(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("qwen3_moe"), torch.bfloat16)
    names = process_weights(model, _config(small_m_linear=False))
    assert not [n for n in names if n.endswith(".experts")]
    assert all(
        m.moe_method is None and m.w13.dim() == 3
        for m in model.modules()
        if isinstance(m, FusedMoE)
    )


def test_fp32_experts_stay_plain(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("qwen3_moe"), torch.float32)
    process_weights(model, _config())
    assert all(m.moe_method is None for m in model.modules() if isinstance(m, FusedMoE))


@pytest.mark.slow  # three engines, an Inductor compile (~40-60 s here)
def test_llm_o2_bf16_runs_the_packed_experts_with_the_o0_tokens(tiny_checkpoint, tmp_path):
    """Cold and warm (artifacts loaded) O2 engines run the packed experts inside their
    pieces with the tokens of an O0 engine on the plain experts.  Its own cache, and the cold
    build dumps (which makes Inductor run the passes even where its own FX-graph cache holds
    the graph from another test): "cold" must run prepack_linear."""
    path = str(tiny_checkpoint("qwen3_moe"))
    kw = dict(dtype="bfloat16", max_model_len=64, max_num_seqs=4)
    expected = LLM(path, optimization_level=0, **kw).generate(PROMPTS, NEW_TOKENS, ignore_eos=True)
    config = dict(progress_bar=False, cache_dir=str(tmp_path / "cache"))
    for start in ("cold", "warm"):
        dump = {"debug_dump_path": str(tmp_path / "dump")} if start == "cold" else {}
        cc = CompilationConfig(**config, **dump)
        llm = LLM(path, optimization_level=2, compilation_config=cc, **kw)
        moe_layers = [m for m in llm.model.modules() if isinstance(m, FusedMoE)]
        assert len(moe_layers) == 2 and all(
            isinstance(m.moe_method, PackedExpertsMethod) for m in moe_layers
        )
        assert {f"model.layers.{i}.mlp.experts" for i in (0, 2)} <= set(llm.packed_layers)
        assert llm.generate(PROMPTS, NEW_TOKENS, ignore_eos=True) == expected, start
        packed = sum(m.w13.numel() * 2 + m.w2.numel() * 2 for m in moe_layers)
        assert llm.stats["memory_packed_weight_bytes"] >= packed  # the stacks count as packed
        if start == "cold":
            stats = llm.stats["passes"]["prepack_linear"]
            assert stats["status"] == "ran" and stats["total_matches"] > 0
        else:
            assert llm.stats["compile_compiles"] == 0
